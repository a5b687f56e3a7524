"""CPU: the pre-flight's memory and Blackwell rules (``csrc_free_kernels.preflight``),
each failing a build edited to break it (one instruction, or one recorded fact) and
passing a legal edit next to that: bulk copies, TMA boxes in shared memory, clusters,
the proxy fence, wgmma descriptors, tcgen05.  Sources per rule:
``bench/notes/2026-12-06-preflight-rules.md``."""

import dataclasses
import re

import pytest

from csrc_free_kernels.preflight.ptx import Kernel

from .test_preflight import _rules, builds  # noqa: F401 (the session's builds)
from .test_preflight_protocol import _check

C2, SW, SM100 = "gemm_prefill_c2", "gemm_prefill_sw", "sm100_gemm_n256"


# ------------------------------------------------------------------ bulk-copy
@pytest.mark.parametrize("edit, why", [
    ((r"shl\.b32 \t%r51, %r775, 4;", "shl.b32 \t%r51, %r775, 3;"), "multiple of 16"),
    ((r"add\.s32 \t%r39, %r616, 152576;", "add.s32 \t%r39, %r616, 152584;"), "[%r39]"),
])
def test_a_bulk_copy_off_16_bytes_fails(builds, edit, why):
    found = _check(builds, SW, edit)
    assert "bulk-copy" in _rules(found) and why in str(found), found


@pytest.mark.parametrize("operands", [None, "align<8>"])
def test_a_bulk_copy_to_a_tensor_not_promised_16_bytes_fails(builds, operands):
    facts = builds[SW][1]
    weaker = None if operands is None else [o.replace("align<16>", operands)
                                             for o in facts.operands]
    found = _check(builds, SW, facts=dataclasses.replace(facts, operands=weaker))
    assert _rules(found) == ["bulk-copy"] and "%rd" in str(found), found


@pytest.mark.parametrize("edit", [
    (r"shl\.b32 \t%r51, %r775, 4;", "shl.b32 \t%r51, %r775, 5;"),
    (r"add\.s32 \t%r39, %r616, 152576;", "add.s32 \t%r39, %r616, 152592;"),
])
def test_a_bulk_copy_of_other_16_byte_multiples_passes(builds, edit):
    assert "bulk-copy" not in _rules(_check(builds, SW, edit))


# ------------------------------------------------------------------ tma-smem
A_BOX = r"\[%r704\+5120\]"


def test_a_tma_box_past_the_allocation_fails(builds):
    found = _check(builds, C2, (A_BOX, "[%r704+205824]"))
    assert _rules(found) == ["tma-smem"] and "which has" in str(found), found


def test_a_tma_box_moved_inside_the_allocation_passes(builds):
    assert "tma-smem" not in _rules(_check(builds, C2, (A_BOX, "[%r704+6144]")))


# ------------------------------------------------------------------ cluster
@pytest.mark.parametrize("edit, facts, why", [
    ((r"mov\.b16 \t%rs5, 3;", "mov.b16 \t%rs5, 7;"), {}, "ctaMask 0x0007"),
    ((r"and\.b32 \t%r15, %r2, 1;", "and.b32 \t%r15, %r2, 1;\n\tadd.s32 \t%r15, %r15, 2;"),
     {}, "ranks [2, 3]"),
    (None, {"cluster": [16, 1, 1]}, "over the portable 8"),
])
def test_a_cluster_rule_broken_fails(builds, edit, facts, why):
    found = _check(builds, C2, *([edit] if edit else []),
                   facts=dataclasses.replace(builds[C2][1], **facts))
    assert "cluster" in _rules(found) and why in str(found), found


def test_a_multicast_to_one_cta_of_the_cluster_passes(builds):
    found = _check(builds, C2, (r"mov\.b16 \t%rs5, 3;", "mov.b16 \t%rs5, 2;"))
    assert "cluster" not in _rules(found)


def test_a_portable_cluster_of_eight_passes(builds):
    facts = dataclasses.replace(builds["gemm_prefill"][1], cluster=[8, 1, 1])
    assert _check(builds, "gemm_prefill", facts=facts) == []


# ------------------------------------------------------------------ ordinary accesses
# sm100: the epilogue reads the TMEM address the allocator wrote (a constant offset)
TMEM_SLOT = r"bar\.sync \t1, 160;\n\tld\.shared\.b32 \t(%r\d+), \[(%r\d+)\+232\];"


def _slot_load(builds, offset: int):
    """A load planted after that one, from ``offset`` of the same base; its line."""
    text = builds[SM100][0]
    slot = re.search(TMEM_SLOT, text)
    planted = f"{slot.group(0)}\n\tld.shared.b32 \t%r9990, [{slot.group(2)}+{offset}];"
    found = _check(builds, SM100, (re.escape(slot.group(0)), planted))
    return found, text.count("\n", 0, slot.start()) + 3


def test_a_shared_load_past_the_allocation_fails(builds):
    found, line = _slot_load(builds, builds[SM100][1].smem_bytes)
    assert _rules(found) == ["smem-bounds"] and found[0].line == line


def test_a_misaligned_shared_load_fails(builds):
    found, line = _slot_load(builds, 234)
    assert _rules(found) == ["access-align"] and found[0].line == line
    assert "4-byte aligned" in found[0].why


def test_a_shared_load_of_the_next_word_passes_both(builds):
    found, _ = _slot_load(builds, 236)
    assert not {"smem-bounds", "access-align"} & set(_rules(found)), found


@pytest.mark.parametrize("offset, rules", [(72, ["access-align"]), (80, [])])
def test_a_vector_store_to_global_is_aligned_to_its_size(builds, offset, rules):
    text = builds["gemm_decode16"][0]
    store = re.search(r"st\.global\.v4\.b32 \t\[(%rd\d+)\+64\]", text)
    found = _check(builds, "gemm_decode16", (re.escape(store.group(0)),
                                             store.group(0).replace("+64]", f"+{offset}]")))
    assert _rules(found) == rules, found
    if rules:
        assert found[0].line == text.count("\n", 0, store.start()) + 1


# ------------------------------------------------------------------ proxy-fence
FENCE = r"\tfence\.proxy\.async\.shared::cta;\n(\t// begin inline asm\n\tbar\.arrive 5, 288;)"


def test_a_store_warp_reading_unfenced_rows_fails(builds):
    # the MMA warpgroups' stmatrix rows reach the store warp through barrier 5
    found = _check(builds, SW, (FENCE, r"\1"))
    assert _rules(found) == ["proxy-fence"] and "cp.async.bulk.global" in str(found)


def test_a_tma_store_of_its_own_unfenced_rows_fails(builds):
    found = _check(builds, "dw_128x128", (r"\tfence\.proxy\.async\.shared::cta;\n"
                                          r"(\t@%p43 bra \t\$L__BB0_67;)", r"\1"))
    assert _rules(found) == ["proxy-fence"] and "cp.async.bulk.tensor" in str(found)


def test_a_write_into_the_rows_after_the_fence_fails(builds):
    text = builds[SW][0]
    last = [ln for ln in text.splitlines() if ln.strip().startswith("stmatrix")][-1]
    found = _check(builds, SW, (FENCE, "\tfence.proxy.async.shared::cta;\n" + last
                                + r"\n\1"))
    assert _rules(found) == ["proxy-fence"]


def test_a_write_elsewhere_after_the_fence_passes(builds):
    """A word between the tile table and the A stages (the table itself is read for
    other warps' control flow in that phase: ``raced-uniform``)."""
    found = _check(builds, SW, (FENCE, "\tfence.proxy.async.shared::cta;\n"
                                       "\tst.shared.b32 \t[%r1+4152], %r2;\n" + r"\1"))
    assert found == [], found


GATHER_FENCE = "\tcp.async.wait_group \t0;\n\tfence.proxy.async.shared::cta;\n"


def _first_mma(text: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1)
                if line.strip().startswith("tcgen05.mma"))


def test_the_2sm_mma_reading_unfenced_gathered_rows_fails(builds):
    """The gather threads' cp.async rows reach the MMA through the tokens-full barrier;
    without fence.proxy.async the MMA (async proxy) may read them stale."""
    text = builds[SM100][0]
    assert text.count(GATHER_FENCE) == 1
    found = _check(builds, SM100, (GATHER_FENCE, "\tcp.async.wait_group \t0;\n\n"))
    assert _rules(found) == ["proxy-fence"] and found[0].line == _first_mma(text)


def test_the_fence_before_the_copies_complete_fails(builds):
    """A fence before cp.async.wait_group orders copies not yet written."""
    text = builds[SM100][0]
    found = _check(builds, SM100, (GATHER_FENCE, "\tfence.proxy.async.shared::cta;\n"
                                                 "\tcp.async.wait_group \t0;\n"))
    assert _rules(found) == ["proxy-fence"] and found[0].line == _first_mma(text)


def test_the_fence_repeated_after_the_copies_passes(builds):
    found = _check(builds, SM100, (GATHER_FENCE, GATHER_FENCE
                                   + "\tfence.proxy.async.shared::cta;\n"))
    assert found == [], found


# ------------------------------------------------------------------ wgmma-descriptor
A_DESC, B_DESC = "4611686293305360384", "4611686293338849280"   # 128B; B MN-major


@pytest.mark.parametrize("old, new, why", [
    (A_DESC, str(int(A_DESC) + (1 << 62)), "swizzle mode 2"),           # 64B
    (A_DESC, str(int(A_DESC) - (32 << 32)), "stride byte offset 512"),
    (B_DESC, str(int(B_DESC) - (256 << 16)), "leading byte offset 4096"),
])
def test_a_descriptor_unlike_the_tma_layout_fails(builds, old, new, why):
    found = _check(builds, "gemm_decode16", (old, new))
    assert _rules(found) == ["wgmma-descriptor"] and why in str(found), found


def test_a_k_major_descriptors_unused_leading_offset_passes(builds):
    found = _check(builds, "gemm_decode16", (A_DESC, str(int(A_DESC) + (1 << 16))))
    assert found == [], found


def test_a_tcgen05_descriptor_without_its_fixed_bits_fails(builds):
    found = _check(builds, SM100, ("4611756662049538048", str(4611756662049538048 - (1 << 46))))
    assert _rules(found) == ["wgmma-descriptor"] and "0b001" in str(found), found


# ------------------------------------------------------------------ tcgen05
@pytest.mark.parametrize("edits, why", [
    ([(r"mov\.b32 \t%r313, 512;", "mov.b32 \t%r313, 384;")], "power of two"),
    ([(r"\ttcgen05\.dealloc[^\n]*\n", "")], "512 tensor-memory columns allocated"),
    ([(r"(\ttcgen05\.alloc)", r"\ttcgen05.relinquish_alloc_permit.cta_group::2.sync.aligned;\n\1")],
     "after relinquish_alloc_permit"),
    ([(r"tcgen05\.dealloc\.cta_group::2", "tcgen05.dealloc.cta_group::1")], "same"),
    ([(r"\t@%p150 bra \t\$L__BB0_101;\n", "")], "issued by one thread"),
    ([(r"add\.s32 \t%r456, %r85, 192;", "add.s32 \t%r456, %r85, 208;")], "no thread waits"),
])
def test_a_tcgen05_rule_broken_fails(builds, edits, why):
    found = _check(builds, SM100, *edits)
    assert "tcgen05" in _rules(found) and why in str(found), found


def test_a_smaller_allocation_freed_whole_passes(builds):
    found = _check(builds, SM100, (r"mov\.b32 \t%r313, 512;", "mov.b32 \t%r313, 256;"),
                   (r"mov\.b32 \t%r1029, 512;", "mov.b32 \t%r1029, 256;"))
    assert found == [], found


# ------------------------------------------------------------------ the readers
_HALVES = """
.visible .entry k(.param .u64 k_param_0)
.reqntid 32
{{
	mov.u32 	%r5, %tid.x;
	cvt.u64.u32 	%rd2, %r5;
	shl.b64 	%rd3, %rd2, {shift};
	mov.b64 	{{%r6, %r7}}, %rd3;
	mov.b64 	%rd4, {{%r7, %r6}};
	ret;
}}
"""


@pytest.mark.parametrize("shift, lo, hi", [(4, 4, 0), (36, 64, 4)])
def test_an_unpacked_64_bit_value_gives_each_half_its_own_alignment(shift, lo, hi):
    align = Kernel(_HALVES.format(shift=shift)).alignment()
    assert (align["%r6"], align["%r7"]) == (lo, hi)
    assert align["%rd4"] == min(hi, lo + 32)   # packed back, halves swapped
