"""CPU: the pre-flight's buffer-release rules on sm_90a builds (``bulk-store-reuse``,
``wgmma-smem-release``), each failing a shipped build edited to break it (one PTX
instruction) on the instruction that breaks it, and passing a legal edit next to that.
Sources: the PTX ISA's cp.async.bulk.wait_group and wgmma.wait_group
(``csrc_free_kernels/preflight/bulk_reuse.py``, ``wgmma_release.py``)."""

import re

from .test_preflight import _rules, builds  # noqa: F401 (the session's builds)
from .test_preflight_order import _check, _line_of

DW = "dw_128x128"                 # 4 staging buffers, wait_group.read 2 per sub-tile
GEMM = "gemm_decode16"            # wait_group 1, then the previous stage released
FP8 = "fp8_decode16_blockwise"    # wait_group 0, then the current stage released
READ_WAIT = "cp.async.bulk.wait_group.read \t2;"
MMA_WAIT = "wgmma.wait_group.sync.aligned \t1;"
RELEASE = r"^\s*mbarrier\.arrive\.shared\.b64 "


def _after_wait(text, which):
    """The first stmatrix after the ``which``-th (0-based) epilogue wait."""
    waits = [n for n, line in enumerate(text.splitlines(), 1) if READ_WAIT in line]
    return _line_of(text, r"^\s*stmatrix", after=waits[which])


# ------------------------------------------------------------------ bulk-store-reuse
def test_a_staging_buffer_written_with_its_wait_removed_fails(builds):
    """Without the first sub-tile's wait, three stores are pending when sub-tile 1 writes
    buffer 1: the oldest, the previous tile's sub-tile 1 store, reads it."""
    text = builds[DW][0]
    assert text.count(READ_WAIT) == 4
    found = _check(builds, DW, text.replace(READ_WAIT, "", 1))
    assert _rules(found) == ["bulk-store-reuse"], found
    assert min(v.line for v in found) == _after_wait(text, 0)
    assert "3 newer groups committed" in found[0].why


def test_a_staging_buffer_written_with_a_shallower_wait_fails(builds):
    """``wait_group.read 3`` at sub-tile 2 (of 4 buffers) leaves buffer 3's store pending
    when sub-tile 3 writes it."""
    text = builds[DW][0]
    waits = text.split(READ_WAIT)
    planted = READ_WAIT.join(waits[:3]) + READ_WAIT.replace("2", "3") + \
        READ_WAIT.join(waits[3:])
    found = _check(builds, DW, planted)
    assert _rules(found) == ["bulk-store-reuse"], found
    assert min(v.line for v in found) == _after_wait(text, 2)


def test_a_deeper_bulk_wait_passes(builds):
    """``wait_group.read 1`` (or 0) retires more: legal, only slower."""
    text = builds[DW][0]
    for n in ("1", "0"):
        assert _check(builds, DW, text.replace(READ_WAIT, READ_WAIT.replace("2", n))) == []


# ------------------------------------------------------------------ wgmma-smem-release
def test_a_stage_released_after_a_shallower_wgmma_wait_fails(builds):
    """``wait_group 2`` before giving back stage ``s - 1``: its MMAs, one group old, may
    still be reading it."""
    text = builds[GEMM][0]
    assert text.count(MMA_WAIT) == 1
    found = _check(builds, GEMM, text.replace(MMA_WAIT, MMA_WAIT.replace("1", "2")))
    assert _rules(found) == ["wgmma-smem-release"] and len(found) == 1, found
    assert found[0].line == _line_of(text, RELEASE, after=_line_of(text, re.escape(MMA_WAIT)))
    assert "1 newer group committed" in found[0].why


def test_a_stage_released_before_the_wgmma_wait_fails(builds):
    """The release moved before ``wait_group 1`` (after the branch that elects its
    thread): the previous stage's MMAs may be pending."""
    text = builds[GEMM][0]
    m = re.search(r"(\twgmma\.wait_group\.sync\.aligned \t1;\n)((?:.*\n){1,6}?"
                  r"\tmbarrier\.arrive\.shared\.b64 [^\n]*\n(\$L__BB\d+_\d+:\n))", text)
    moved = text.replace(m.group(0), m.group(2) + m.group(1), 1)
    found = _check(builds, GEMM, moved)
    assert _rules(found) == ["wgmma-smem-release"] and len(found) == 1, found
    assert found[0].line == _line_of(moved, RELEASE, after=_line_of(moved, r"wgmma\.commit"))


def test_the_current_stage_released_after_wait_group_1_fails(builds):
    """The FP8 mainloop gives back the stage its MMAs just read: with ``wait_group 1``
    instead of 0 they may still be reading it."""
    text = builds[FP8][0]
    wait0 = "wgmma.wait_group.sync.aligned \t0;"
    first = _line_of(text, re.escape(wait0))
    found = _check(builds, FP8, text.replace(wait0, MMA_WAIT, 1))
    assert "wgmma-smem-release" in _rules(found), found
    (v,) = [v for v in found if v.rule == "wgmma-smem-release"]
    assert v.line == _line_of(text, RELEASE, after=first)
    assert "0 newer groups committed" in v.why


def test_a_deeper_wgmma_wait_passes(builds):
    text = builds[GEMM][0]
    assert _check(builds, GEMM, text.replace(MMA_WAIT, MMA_WAIT.replace("1", "0"))) == []
