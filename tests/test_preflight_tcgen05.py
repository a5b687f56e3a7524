"""CPU: the pre-flight's tensor-memory rules for sm_100a (``tcgen05-order``,
``tcgen05-lanes``), each failing the shipped 2-SM GEMM edited to break it (one PTX
instruction) on the instruction that breaks it, and passing a legal edit next to that.
No Blackwell GPU runs here: these rules and ptxas are the checks the kernel has.
Sources: the PTX ISA's tcgen05 memory consistency model and access restrictions
(``csrc_free_kernels/preflight/tmem_order.py``, ``tmem_lanes.py``)."""

import re

import pytest

from csrc_free_kernels import preflight

from .test_preflight import _rules, builds  # noqa: F401 (the session's builds)

GEMM = "sm100_gemm_n256"
SWIGLU = "sm100_swiglu_n256_bk"   # two tcgen05.ld per chunk (gate and up)
AFTER = "\ttcgen05.fence::after_thread_sync;\n"
BEFORE = "\ttcgen05.fence::before_thread_sync;\n"
WAIT_LD = "\ttcgen05.wait::ld.sync.aligned;\n"


def _lines(text: str, pattern: str) -> list:
    """The 1-based PTX lines whose text matches ``pattern``."""
    return [n for n, line in enumerate(text.splitlines(), 1) if re.search(pattern, line)]


def _blank(text: str, line: str, which: int) -> str:
    """``text`` with the ``which``-th occurrence of ``line`` emptied (numbering kept)."""
    at = -1
    for _ in range(which + 1):
        at = text.index(line, at + 1)
    return text[:at] + "\n" + text[at + len(line):]


def _found(builds, name, text):
    return preflight.check(name, text, builds[name][1])


def test_the_shipped_order_is_the_isas(builds):
    """The MMA warp fences after its stage waits, the epilogue after its accumulator wait
    and before its release, after tcgen05.wait::ld; and it reads the loaded registers
    before that wait, which the ISA allows (a true register dependency is respected)."""
    for name in (GEMM, SWIGLU):
        text = builds[name][0]
        assert text.count(AFTER) == 2 and text.count(BEFORE) == 1, name
        first_ld = _lines(text, r"^\s*tcgen05\.ld\.")[0]
        dest = re.search(r"tcgen05\.ld\.[\w.]+ \{(%r\d+),", text).group(1)
        use = _lines(text, rf"^\s*\w[\w.]* .*[ ,{{]{re.escape(dest)}[,}}]")
        wait = _lines(text, r"tcgen05\.wait::ld")[0]
        assert first_ld < min(n for n in use if n > first_ld) < wait
        assert "tcgen05-order" not in _rules(_found(builds, name, text))


def test_the_mma_without_a_fence_after_its_waits_fails(builds):
    text = builds[GEMM][0]
    found = _found(builds, GEMM, _blank(text, AFTER, 0))
    assert _rules(found) == ["tcgen05-order"] and len(found) == 1, found
    assert found[0].line == _lines(text, r"^\s*tcgen05\.mma\.")[0]
    assert "fence::after_thread_sync" in found[0].why


def test_the_fence_between_the_two_stage_waits_fails(builds):
    """After the token wait but before the weight wait: the weight wait is unfenced."""
    text = builds[GEMM][0]
    waits = [m.start() for m in re.finditer(r"\{\s*\.reg \.pred\s+P1;", text)]
    fence = text.index(AFTER)
    second = max(w for w in waits if w < fence)  # the weight wait's inline block
    moved = _blank(text, AFTER, 0)
    moved = moved[:second] + AFTER + moved[second:]
    found = _found(builds, GEMM, moved)
    assert _rules(found) == ["tcgen05-order"]
    assert found[0].line == _lines(text, r"^\s*tcgen05\.mma\.")[0] + 1


def test_a_second_fence_after_the_waits_passes(builds):
    text = builds[GEMM][0]
    assert _found(builds, GEMM, text.replace(AFTER, AFTER + AFTER, 1)) == []


def test_the_tmem_load_without_a_fence_after_the_accumulator_wait_fails(builds):
    text = builds[GEMM][0]
    found = _found(builds, GEMM, _blank(text, AFTER, 1))
    assert _rules(found) == ["tcgen05-order"] and len(found) == 1, found
    assert found[0].line == _lines(text, r"^\s*tcgen05\.ld\.")[0]


def test_the_release_without_a_fence_before_it_fails(builds):
    text = builds[SWIGLU][0]
    found = _found(builds, SWIGLU, _blank(text, BEFORE, 0))
    assert _rules(found) == ["tcgen05-order"]
    release = min(n for n in _lines(text, r"^\s*mbarrier\.arrive")
                  if n > _lines(text, r"fence::before_thread_sync")[0])
    assert found[0].line == release and "before_thread_sync" in found[0].why


def test_the_release_without_waiting_for_the_loads_fails(builds):
    """tcgen05.wait::ld is what makes the loads complete before the MMA may overwrite
    the stage: without it the release is flagged, not the register reads."""
    text = builds[SWIGLU][0]
    found = _found(builds, SWIGLU, _blank(text, WAIT_LD, 0))
    assert _rules(found) == ["tcgen05-order"]
    assert {v.line for v in found} <= set(_lines(text, r"^\s*(mbarrier\.arrive|bar\.sync)"))
    assert "tcgen05.wait::ld" in str(found)


def test_the_fence_before_the_wait_for_the_loads_passes(builds):
    text = builds[SWIGLU][0]
    assert _found(builds, SWIGLU, text.replace(WAIT_LD + BEFORE, BEFORE + WAIT_LD)) == []


def test_the_build_as_it_was_without_fences_fails_three_times(builds):
    """The sm_100a GEMM before the fences (no tcgen05.fence at all): the MMA after its
    waits, the TMEM load after the accumulator wait, and the release."""
    text = builds[GEMM][0]
    bare = _blank(_blank(_blank(text, AFTER, 1), AFTER, 0), BEFORE, 0)
    found = _found(builds, GEMM, bare)
    assert [v.line for v in found] == [
        _lines(text, r"^\s*tcgen05\.mma\.")[0], _lines(text, r"^\s*tcgen05\.ld\.")[0],
        min(n for n in _lines(text, r"^\s*mbarrier\.arrive") if n > _lines(text, "wait::ld")[0])]


# ------------------------------------------------------------------ lanes
def _lane_mask(text):
    """The ``and`` that keeps a thread's warp index as its TMEM lane (bits 21-24)."""
    return re.search(r"and\.b32 \t(%r\d+), (%r\d+), 31457280;", text)


@pytest.mark.parametrize("mask, why", [
    # bit 22 only: warps 0 and 1 both on lane 0, warps 2 and 3 on lane 64
    (1 << 22, "warp 1 (warp 1 of its warpgroup) reaches TMEM lanes 32-63, but its 32-lane "
              "access starts at lane 0"),
    # bits 20-23: the upper half of each warp a quarter further on
    (15 << 20, "the threads of warp 0 give taddr lanes [0, 16]"),
])
def test_a_load_outside_the_warps_lane_quarter_fails(builds, mask, why):
    text = builds[GEMM][0]
    m = _lane_mask(text)
    found = _found(builds, GEMM, text.replace(m.group(0), m.group(0).replace(
        "31457280", str(mask))))
    assert _rules(found) == ["tcgen05-lanes"] and why in str(found), found
    assert found[0].line == _lines(text, r"^\s*tcgen05\.ld\.")[0]


def test_a_load_one_quarter_on_fails_and_a_column_on_passes(builds):
    text = builds[GEMM][0]
    ld = re.search(r"(tcgen05\.ld\.[^\n]*\[)(%r\d+)\]", text)
    lane_on = text.replace(ld.group(0), f"{ld.group(1)}{ld.group(2)}+{32 << 16}]", 1)
    found = _found(builds, GEMM, lane_on)
    assert _rules(found) == ["tcgen05-lanes"] and "starts at lane 32" in str(found)
    column_on = text.replace(ld.group(0), f"{ld.group(1)}{ld.group(2)}+32]", 1)
    assert _found(builds, GEMM, column_on) == []
