"""CPU: the pre-flight's protocol rules (``csrc_free_kernels.preflight``), each failing
a build edited to break it (one instruction, or one recorded fact) and passing a legal
edit next to that: the mbarrier protocol per barrier, the collectives at their scopes,
the register budget, the facts the rules stand on.  Sources per rule:
``bench/notes/2026-12-06-preflight-rules.md``."""

import dataclasses
import re

import pytest

from csrc_free_kernels import preflight

from .test_preflight import _rules, builds  # noqa: F401 (the session's builds)

C2 = "gemm_prefill_c2"     # a 2-CTA cluster: multicast loads, remote arrivals
DECODE = "gemm_decode16"  # one-CTA ring of 8 stages, a producer and a consumer


def _check(builds, name, *edits, facts=None, count=1):
    """The violations of ``name`` with each ``(old, new)`` replaced ``count`` times
    (-1: every time), ``old`` a regex that must match."""
    text, recorded = builds[name]
    for old, new in edits:
        assert re.search(old, text), old
        text = re.sub(old, new, text, count=0 if count < 0 else count)
    return preflight.check(name, text, facts or recorded)


def _wrap(target: str, test: str) -> str:
    """``target`` under a branch on ``%tid.x``: ``test`` sets ``%p9990`` from ``%r9990``
    (the thread index) or ``%r9991`` (the warp index)."""
    return ("\tmov.u32 \t%r9990, %tid.x;\n\tshr.u32 \t%r9991, %r9990, 5;\n\t" + test
            + "\n\t@%p9990 bra \t$L__PREFLIGHT;\n\t" + target + "\n$L__PREFLIGHT:")


# ------------------------------------------------------------------ expect-tx
def test_a_load_on_another_stages_barrier_fails(builds):
    found = _check(builds, C2, (r"(\[%r704\+5120\], \[%rd66, \{%r743, %r32\}\]), \[%r35\]",
                                r"\1, [%r35+8]"))
    # the last stage's load then names a barrier past the array's four (stage-range)
    assert _rules(found) == ["expect-tx", "stage-range"]
    assert "no expect_tx arms" in str(found) and "deliver 32768" in str(found)


def test_a_load_on_another_pipelines_barrier_fails(builds):
    found = _check(builds, C2, (r"(\[%r704\+5120\], \[%rd66, \{%r743, %r32\}\]), \[%r35\]",
                                r"\1, [%r35+32]"))
    assert "expect-tx" in _rules(found) and "no expect_tx arms" in str(found)


def test_an_armed_count_over_the_tx_range_fails(builds):
    found = _check(builds, C2, (r"mov\.b32 \t%r701, 49152;", "mov.b32 \t%r701, 1048576;"))
    assert _rules(found) == ["expect-tx"] and "2^20 - 1" in str(found)


def test_arming_one_stage_in_two_parts_passes(builds):
    found = _check(builds, C2, (
        r"mbarrier\.arrive\.expect_tx\.shared\.b64 %rd65, \[%r35\], %r701;",
        "mbarrier.expect_tx.shared.b64 [%r35], 16384;\n\t"
        "mbarrier.arrive.expect_tx.shared.b64 %rd65, [%r35], 32768;"))
    assert found == [], found


# ------------------------------------------------------------------ mbarrier-init
def test_an_init_count_unlike_the_arrivals_fails(builds):
    found = _check(builds, C2, (r"mov\.b32 \t%r141, 16;", "mov.b32 \t%r141, 8;"))
    assert _rules(found) == ["mbarrier-init"] and "gets 16 arrivals" in str(found)


def test_more_threads_arriving_than_counted_fails(builds):
    # lanes 0-3 of each consumer warp release, not 0-1: 32 arrivals a phase, count 16
    found = _check(builds, C2, (r"and\.b32 \t%r14, %r2, 30;", "and.b32 \t%r14, %r2, 28;"))
    assert _rules(found) == ["mbarrier-init"] and "gets 32 arrivals" in str(found)


def test_an_arrival_on_no_barrier_fails(builds):
    found = _check(builds, C2, (r"add\.s32 \t%r369, %r368, 32;", "add.s32 \t%r369, %r368, 64;"))
    assert "mbarrier-init" in _rules(found) and "names no barrier" in str(found)


def test_half_the_threads_arriving_twice_passes(builds):
    # lanes 0-1 of the even consumer warps, each arriving with count 2: still 16
    found = _check(builds, C2, (r"and\.b32 \t%r14, %r2, 30;", "and.b32 \t%r14, %r2, 62;"),
                   (r"mov\.b32 \t%r372, 1;", "mov.b32 \t%r372, 2;"),
                   (r"mov\.b32 \t%r381, 1;", "mov.b32 \t%r381, 2;"))
    assert found == [], found


# ------------------------------------------------------------------ re-init, arrive twice
def _line(text: str, pattern: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if re.search(pattern, line))


def test_a_live_barrier_initialised_again_fails(builds):
    """The first barrier set up again after the pipelines start (its phase and pending
    arrivals lost)."""
    text = builds[DECODE][0]
    init = re.search(r"\tmbarrier\.init\.shared\.b64 \t\[(%r\d+)\], (%r\d+);\n", text)
    wait = re.search(r"\t// begin inline asm\n\t\{\n\t\.reg \.pred\s+P1;", text)
    planted = text[:wait.start()] + init.group(0) + text[wait.start():]
    found = preflight.check(DECODE, planted, builds[DECODE][1])
    assert _rules(found) == ["mbarrier-reinit"] and len(found) == 1
    assert found[0].line == text.count("\n", 0, wait.start()) + 1


def test_a_barrier_invalidated_before_its_new_init_passes_the_reinit_rule(builds):
    text = builds[DECODE][0]
    init = re.search(r"\tmbarrier\.init\.shared\.b64 \t\[(%r\d+)\], (%r\d+);\n", text)
    wait = re.search(r"\t// begin inline asm\n\t\{\n\t\.reg \.pred\s+P1;", text)
    planted = (text[:wait.start()] + f"\tmbarrier.inval.shared.b64 \t[{init.group(1)}];\n"
               + init.group(0) + text[wait.start():])
    assert "mbarrier-reinit" not in _rules(preflight.check(DECODE, planted, builds[DECODE][1]))


RELEASE = r"\tmbarrier\.arrive\.shared\.b64 %rd\d+, \[(%r\d+)\+64\], (%r\d+);\n"


def test_a_release_arrived_twice_by_the_same_threads_fails(builds):
    text = builds[DECODE][0]
    release = re.search(RELEASE, text)
    found = _check(builds, DECODE, (re.escape(release.group(0)), release.group(0) * 2))
    # the second arrival gives back the stage the MMAs still read, too
    assert _rules(found) == ["arrive-twice", "wgmma-smem-release"]
    found = [v for v in found if v.rule == "arrive-twice"]
    assert len(found) == 1
    assert found[0].line == text.count("\n", 0, release.start()) + 2


def test_releases_of_successive_stages_pass(builds):
    """The consumer releases a stage in its k-loop and the last one after it, the stage
    counter advanced between: not the same barrier twice."""
    text = builds[DECODE][0]
    releases = list(re.finditer(RELEASE, text))
    assert len(releases) == 2 and releases[0].group(1) != releases[1].group(1)
    assert "arrive-twice" not in _rules(preflight.check(DECODE, text, builds[DECODE][1]))


# ------------------------------------------------------------------ stage-range
WRAP = r"setp\.eq\.b32 \t(%p\d+), (%r\d+), 8;\n\tselp\.b32 \t(%r\d+), 0, \2, \1;"


def _consumer_counter(text: str) -> tuple:
    """``(line, counter)``: the consumer's full-barrier wait (the text's last parity wait)
    and the stage counter its address is ``8 x`` of."""
    n, line = [(n, line) for n, line in enumerate(text.splitlines(), 1)
               if "mbarrier.try_wait.parity" in line][-1]
    addr = re.search(r"\[(%r\d+)\]", line).group(1)
    offset = re.search(rf"add\.s32 \t{re.escape(addr)}, %r\d+, (%r\d+);", text).group(1)
    return n, re.search(rf"shl\.b32 \t{re.escape(offset)}, (%r\d+), 3;", text).group(1)


def _wraps(text: str, counter: str) -> list:
    return [m for m in re.finditer(WRAP, text) if m.group(3) == counter]


def test_a_ring_counter_that_wraps_one_stage_late_fails(builds):
    text = builds[DECODE][0]
    line, counter = _consumer_counter(text)
    (wrap,) = _wraps(text, counter)
    late = wrap.group(0).replace(", 8;", ", 9;")
    found = _check(builds, DECODE, (re.escape(wrap.group(0)), late))
    assert _rules(found) == ["stage-range"], found
    assert found[0].line == line and "+0..+64" in found[0].why


def test_a_ring_counter_wrapping_on_its_inequality_passes(builds):
    text = builds[DECODE][0]
    (wrap,) = _wraps(text, _consumer_counter(text)[1])
    p, nxt, reg = wrap.groups()
    same = (f"setp.ne.b32 \t{p}, {nxt}, 8;\n\tselp.b32 \t{reg}, {nxt}, 0, {p};")
    assert _check(builds, DECODE, (re.escape(wrap.group(0)), same)) == []


# ------------------------------------------------------------------ mbarrier-phase
def _phase_of_first_wait(text: str) -> tuple:
    """``(line, phase register)`` of the text's first parity wait (the producer's, on
    the stages it fills: they start free)."""
    n, line = next((n, line) for n, line in enumerate(text.splitlines(), 1)
                   if "mbarrier.try_wait.parity" in line)
    return n, re.search(r"\], (%r\d+),", line).group(1)


def test_a_producer_starting_at_parity_0_hangs(builds):
    text = builds[DECODE][0]
    line, phase = _phase_of_first_wait(text)
    found = _check(builds, DECODE, (rf"mov\.b32 \t{phase}, 1;", f"mov.b32 \t{phase}, 0;"),
                   count=-1)
    assert _rules(found) == ["mbarrier-phase"] and len(found) == 1, found
    assert found[0].line == line and "a hang on the first round" in found[0].why


def test_a_consumer_waiting_on_the_barrier_it_releases_hangs(builds):
    """The wrong barrier: the consumer's full-stage wait moved to the empty barrier of
    the same stage (+64), which only its own release, after that wait, completes."""
    text = builds[DECODE][0]
    line, _ = _consumer_counter(text)
    wait = text.splitlines()[line - 1]
    addr = re.search(r"\[(%r\d+)\]", wait).group(1)
    found = _check(builds, DECODE, (re.escape(wait.strip()), wait.strip().replace(
        f"[{addr}]", f"[{addr}+64]")))
    hangs = [v for v in found if "a hang on the first round" in v.why]
    assert _rules(found) == ["mbarrier-phase"] and [v.line for v in hangs] == [line]


def _flip_consumer_parity(text: str, times: int) -> tuple:
    """The consumer's full-barrier wait with its parity operand xor-ed with 1 ``times``
    times just before it; and that wait's line."""
    wait = list(re.finditer(r"mbarrier\.try_wait\.parity\.shared\.b64 P1, \[(%r\d+)\], "
                            r"(%r\d+), 10000000;", text))[-1]
    line = text.count("\n", 0, wait.start()) + 1
    flips = "".join(f"\txor.b32 \t%r999{i + 1}, %r999{i}, 1;\n" for i in range(times))
    start = text.rindex("// begin inline asm", 0, wait.start())
    edited = (text[:start] + f"mov.b32 \t%r9990, {wait.group(2)};\n" + flips
              + text[start:wait.start()] + wait.group(0).replace(wait.group(2), f"%r999{times}")
              + text[wait.end():])
    return edited, line + 1 + times


def test_a_consumer_starting_at_parity_1_passes_before_the_bytes_land(builds):
    edited, line = _flip_consumer_parity(builds[DECODE][0], 1)
    found = preflight.check(DECODE, edited, builds[DECODE][1])
    assert _rules(found) == ["mbarrier-phase"] and len(found) == 1, found
    assert found[0].line == line and "before the first phase's bytes land" in found[0].why


def test_a_consumer_parity_flipped_twice_passes(builds):
    edited, _ = _flip_consumer_parity(builds[DECODE][0], 2)
    assert preflight.check(DECODE, edited, builds[DECODE][1]) == []


# ------------------------------------------------------------------ mbarrier-align
def test_a_misaligned_wait_fails(builds):
    found = _check(builds, C2, (r"add\.s32 \t%r698, %r35, 32;", "add.s32 \t%r698, %r35, 36;"))
    assert "mbarrier-align" in _rules(found) and "[%r698]" in str(found)


def test_a_wait_on_another_aligned_barrier_is_aligned(builds):
    found = _check(builds, C2, (r"add\.s32 \t%r698, %r35, 32;", "add.s32 \t%r698, %r35, 40;"))
    assert "mbarrier-align" not in _rules(found) and "mbarrier-init" not in _rules(found)


# ------------------------------------------------------------------ mbarrier-fence
def test_a_cluster_barrier_without_its_init_fence_fails(builds):
    found = _check(builds, C2, (r"\tfence\.mbarrier_init\.release\.cluster;\n", ""))
    assert _rules(found) == ["mbarrier-fence"] and "multicast" in str(found)


CLUSTER_SYNC = ("\tfence.mbarrier_init.release.cluster;\n\tbarrier.cluster.arrive.relaxed;\n"
                "\tbarrier.cluster.wait;\n")


def test_the_init_fence_after_the_cluster_barrier_fails(builds):
    """The peer's first multicast load may reach a barrier whose init it has not seen:
    the fence must come before the cluster barrier that carries it (its later waits on
    local barriers do not)."""
    text = builds[C2][0]
    assert text.count(CLUSTER_SYNC) == 1
    moved = ("\tbarrier.cluster.arrive.relaxed;\n\tbarrier.cluster.wait;\n"
             "\tfence.mbarrier_init.release.cluster;\n")
    found = _check(builds, C2, (re.escape(CLUSTER_SYNC), moved))
    assert _rules(found) == ["mbarrier-fence"] and "the cluster barrier" in found[0].why
    first = next(n for n, line in enumerate(text.splitlines(), 1) if "multicast" in line)
    assert found[0].line == first


def test_a_second_cluster_barrier_after_the_fence_passes(builds):
    found = _check(builds, C2, (re.escape(CLUSTER_SYNC), CLUSTER_SYNC.replace(
        "\tbarrier.cluster.wait;\n",
        "\tbarrier.cluster.wait;\n\tbarrier.cluster.arrive;\n\tbarrier.cluster.wait;\n")))
    assert found == [], found


def test_a_single_cta_barrier_without_the_fence_passes(builds):
    found = _check(builds, "gemm_prefill",
                   (r"\tfence\.mbarrier_init\.release\.cluster;\n", ""))
    assert found == [], found


# ------------------------------------------------------------------ setmaxnreg
INC = r"setmaxnreg\.inc\.sync\.aligned\.u32 \t232;"


@pytest.mark.parametrize("edit, why", [
    ((r"setmaxnreg\.dec\.sync\.aligned\.u32 \t40;", "setmaxnreg.dec.sync.aligned.u32 \t48;"),
     "65536 > the CTA's pool of 64512"),          # the example: 48+232+232
    ((INC, "setmaxnreg.inc.sync.aligned.u32 \t160;"), "inc 160 while the warpgroup may hold [168]"),
    ((INC, "setmaxnreg.inc.sync.aligned.u32 \t232;\n\tsetmaxnreg.dec.sync.aligned.u32 \t240;"),
     "dec 240 while the warpgroup may hold [232]"),
    # the largest count a warpgroup reaches counts, not the last
    ((INC, "setmaxnreg.inc.sync.aligned.u32 \t240;\n\tsetmaxnreg.dec.sync.aligned.u32 \t232;"),
     "66560 > the CTA's pool"),
])
def test_setmaxnreg_protocol_violations_fail(builds, edit, why):
    found = _check(builds, "gemm_mid", edit)
    assert _rules(found) == ["setmaxnreg"] and why in str(found), found


@pytest.mark.parametrize("edit", [
    (r"setmaxnreg\.dec\.sync\.aligned\.u32 \t40;", "setmaxnreg.dec.sync.aligned.u32 \t32;"),
    (INC, "setmaxnreg.inc.sync.aligned.u32 \t232;\n\tsetmaxnreg.dec.sync.aligned.u32 \t224;"),
])
def test_setmaxnreg_within_the_pool_passes(builds, edit):
    assert _check(builds, "gemm_mid", edit) == []


# ------------------------------------------------------------------ missing facts
@pytest.mark.parametrize("edit, change, why", [
    ((r"\.reqntid 384, 1, 1\n", ""), {}, "no .reqntid"),
    ((r"$", "\n.visible .entry second()\n.reqntid 32\n{\n\tret;\n}\n"), {}, "2 .entry"),
    (None, {"frame_bytes": None}, "stack frame is not known"),
    (None, {"registers": None}, "register count is not known"),
    (None, {"cluster": None}, "cluster shape was not recorded"),
])
def test_a_missing_fact_is_a_violation(builds, edit, change, why):
    facts = dataclasses.replace(builds[C2][1], **change)
    found = _check(builds, C2, *([edit] if edit else []), facts=facts)
    assert "missing-fact" in _rules(found) and why in str(found), found


def test_a_one_dimensional_reqntid_passes(builds):
    assert _check(builds, C2, (r"\.reqntid 384, 1, 1\n", ".reqntid 384\n")) == []


# ------------------------------------------------------------------ warp collectives
SHFL = "shfl.sync.bfly.b32 \t%r184, %r410, 1, 31, -1;"


@pytest.mark.parametrize("test, mask, rule_fires", [
    ("setp.eq.u32 \t%p9990, %r9990, 7;", "-1", True),      # one thread skips it
    ("setp.eq.u32 \t%p9990, %r9991, 0;", "-1", False),     # warp 0 skips it: whole warps
    ("setp.eq.u32 \t%p9990, %r9991, 0;", "65535", True),   # half a mask, every lane runs
])
def test_a_warp_collective_runs_at_warp_scope(builds, test, mask, rule_fires):
    shfl = SHFL.replace("-1;", f"{mask};")
    found = _check(builds, "route_slots", (re.escape(SHFL), _wrap(shfl, test)))
    assert ("warp-uniform" in _rules(found)) == rule_fires, found


def test_a_partial_mask_that_names_the_lanes_that_run_passes(builds):
    shfl = SHFL.replace("-1;", "65535;")
    found = _check(builds, "route_slots", (re.escape(SHFL), _wrap(
        shfl, "and.b32 \t%r9992, %r9990, 31;\n\tsetp.ge.u32 \t%p9990, %r9992, 16;")))
    assert "warp-uniform" not in _rules(found), found


def test_an_elect_under_a_lane_test_fails(builds):
    text = builds["gemm_decode16"][0]
    elect = re.search(r"elect\.sync \t%r\d+\|%p\d+, -1;", text).group(0)
    found = _check(builds, "gemm_decode16", (re.escape(elect), _wrap(
        elect, "setp.eq.u32 \t%p9990, %r9990, 3;")))
    assert "warp-uniform" in _rules(found), found


# ------------------------------------------------------------------ named barriers
BAR = r"bar\.sync \t1, 256;"


@pytest.mark.parametrize("new, count, why", [
    ("bar.sync \t1, 224;", 1, "used with thread counts"),
    ("bar.sync \t1, 224;", -1, "counts 224 threads, but 256 reach it"),
    ("bar.sync \t1, 250;", -1, "multiple of 32"),
    ("bar.sync \t16, 256;", -1, "in 0..15"),
])
def test_a_named_barrier_with_a_wrong_count_fails(builds, new, count, why):
    found = _check(builds, C2, (BAR, new), count=count)
    assert _rules(found) == ["named-barrier"] and why in str(found), found


def test_a_cta_barrier_under_a_warp_test_fails(builds):
    found = _check(builds, C2, (r"bar\.sync \t0;", _wrap("bar.sync \t0;",
                                                          "setp.eq.u32 \t%p9990, %r9991, 2;")))
    assert "named-barrier" in _rules(found) and "every thread of the CTA" in str(found)


def test_a_named_barrier_under_a_thread_test_fails(builds):
    found = _check(builds, C2, (BAR, _wrap("bar.sync \t1, 256;",
                                           "setp.eq.u32 \t%p9990, %r9990, 300;")))
    assert "named-barrier" in _rules(found) and "whole warps" in str(found)


def test_an_arrive_nobody_waits_for_fails(builds):
    found = _check(builds, "gemm_prefill_sw", (r"bar\.sync \t6, 288;", "bar.arrive \t6, 288;"))
    assert "named-barrier" in _rules(found) and "no thread waits" in str(found)


def test_the_same_barrier_renamed_everywhere_passes(builds):
    found = _check(builds, C2, (BAR, "barrier.sync.aligned \t9, 256;"), count=-1)
    assert found == [], found


# ------------------------------------------------------------------ warpgroup scope
def test_a_warpgroup_instruction_under_a_warpgroup_test_passes(builds):
    fence = "wgmma.fence.sync.aligned;"
    found = _check(builds, "gemm_decode16", (re.escape(fence), _wrap(
        fence, "setp.ge.u32 \t%p9990, %r9991, 8;")))
    assert found == [], found
