"""CPU: the pre-flight's ordering rules on sm_90a builds (``wgmma-order``, ``pdl-order``),
each failing a shipped build edited to break it (one PTX instruction, or one recorded
fact) on the instruction that breaks it, and passing a legal edit next to that.
Sources: the PTX ISA's wgmma.wait_group and griddepcontrol
(``csrc_free_kernels/preflight/wgmma_order.py``, ``pdl_order.py``)."""

import dataclasses
import re

from csrc_free_kernels import preflight

from .test_preflight import _rules, builds  # noqa: F401 (the session's builds)

GEMM = "gemm_decode16"              # one MMA warpgroup, PDL at its entry
PREFETCH = "gemm_decode16_bk_prefetch"  # PDL with weights and offs read before the wait
LAST_WAIT = "wgmma.wait_group.sync.aligned \t0;"


def _line_of(text: str, pattern: str, after: int = 0) -> int:
    """The first 1-based PTX line after ``after`` whose text matches ``pattern``."""
    return next(n for n, line in enumerate(text.splitlines(), 1)
                if n > after and re.search(pattern, line))


def _check(builds, name, text, facts=None):
    return preflight.check(name, text, facts or builds[name][1])


# ------------------------------------------------------------------ wgmma-order
def test_accumulators_read_with_a_group_still_pending_fail(builds):
    """The epilogue after ``wgmma.wait_group 1`` instead of 0: the last k-tile's MMAs may
    still write the accumulators its first conversion reads."""
    text = builds[GEMM][0]
    assert text.count(LAST_WAIT) == 1
    found = _check(builds, GEMM, text.replace(LAST_WAIT, "wgmma.wait_group.sync.aligned \t1;"))
    # the last stage is given back after that wait too (wgmma-smem-release)
    assert _rules(found) == ["wgmma-order", "wgmma-smem-release"] and len(found) == 2, found
    found = [v for v in found if v.rule == "wgmma-order"]
    wait = _line_of(text, re.escape(LAST_WAIT))
    assert found[0].line == _line_of(text, r"^\s*cvt\..*%r\d+, %r\d+;", after=wait)
    assert "before a wgmma.wait_group retires its group" in found[0].why


def test_an_empty_group_committed_before_waiting_for_one_passes(builds):
    """``commit_group`` with no MMA since adds an empty group: waiting until one group is
    pending then retires every MMA, as ``wait_group 0`` did."""
    text = builds[GEMM][0]
    legal = text.replace(LAST_WAIT, "wgmma.commit_group.sync.aligned;\n\t"
                                    "wgmma.wait_group.sync.aligned \t1;")
    assert _check(builds, GEMM, legal) == []


def test_accumulators_read_before_their_group_is_committed_fail(builds):
    """Without the k-loop's commit the MMAs are in no group: no wait retires them."""
    text = builds[GEMM][0]
    commit = "wgmma.commit_group.sync.aligned;"
    assert text.count(commit) == 1
    found = _check(builds, GEMM, text.replace(commit, ""))
    assert "wgmma-order" in _rules(found)
    found = [v for v in found if v.rule == "wgmma-order"]
    assert found[0].line == _line_of(text, r"^\s*cvt\..*%r\d+, %r\d+;",
                                     after=_line_of(text, re.escape(LAST_WAIT)))


# ------------------------------------------------------------------ pdl-order
def test_launching_dependents_before_the_wait_fails(builds):
    text = builds[GEMM][0]
    swapped = re.sub(r"griddepcontrol\.wait;(\s*// end inline asm\s*// begin inline asm\s*)"
                     r"griddepcontrol\.launch_dependents;",
                     r"griddepcontrol.launch_dependents;\1griddepcontrol.wait;", text, count=1)
    assert swapped != text
    found = _check(builds, GEMM, swapped)
    assert _rules(found) == ["pdl-order"] and len(found) == 1
    assert found[0].line == _line_of(text, r"griddepcontrol\.wait;")
    assert "lets the dependent grid launch" in found[0].why


def test_a_build_without_its_wait_fails_at_its_first_global_access(builds):
    text = builds[GEMM][0]
    found = _check(builds, GEMM, text.replace("griddepcontrol.wait;", "", 1))
    assert "pdl-order" in _rules(found)
    first = min(v.line for v in found if v.rule == "pdl-order")
    access = _line_of(text, r"^\s*(@!?%p\d+ )?(ld|st|atom|red)\.global|cp\.async\.bulk")
    assert first == min(access, _line_of(text, "launch_dependents"))


def test_reads_before_the_wait_fail_unless_the_trace_declared_them(builds):
    text, facts = builds[PREFETCH]
    assert facts.pdl_early_reads is True
    assert _check(builds, PREFETCH, text) == []
    undeclared = _check(builds, PREFETCH, text, dataclasses.replace(facts, pdl_early_reads=False))
    assert _rules(undeclared) == ["pdl-order"]
    assert undeclared[0].line == _line_of(text, r"ld\.global\.cg\.")
    assert {v.why.split(" before")[0] for v in undeclared} == {"reads global memory"}


def test_a_write_before_the_wait_fails_even_where_reads_are_declared(builds):
    text = builds[PREFETCH][0]
    load = re.search(r"\tld\.global\.cg\.b32 (%r\d+), \[(%rd\d+)\];\n", text)
    planted = text.replace(load.group(0), load.group(0) + f"\tst.global.b32 [{load.group(2)}], "
                                                         f"{load.group(1)};\n", 1)
    found = _check(builds, PREFETCH, planted)
    assert _rules(found) == ["pdl-order"] and len(found) == 1
    assert found[0].line == _line_of(text, r"ld\.global\.cg\.") + 1
    assert found[0].why.startswith("writes global memory")
