"""Pieces the Hopper (sm_90a) WGMMA kernels share: a thread's MMA operands and
accumulators, the mainloop's steps (one ring stage's WGMMAs, the release of a
finished stage), and the epilogue's copies (accumulators -> shared memory by
``stmatrix``, shared -> global by 16-byte thread stores).

Plain functions, traced inline inside the kernels' ``@cute.jit`` methods.
"""

from typing import NamedTuple

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup


class MmaOperands(NamedTuple):
    """One thread's view of a CTA tile's MMA: A and B fragments, the accumulators."""

    a: cute.Tensor
    b: cute.Tensor
    acc: cute.Tensor


def mma_operands(tiled_mma, sA, sB, ctid, tile_mn: tuple, acc_dtype) -> MmaOperands:
    """Fragments of the shared-memory operand tiles ``sA``, ``sB`` for MMA thread
    ``ctid``, and its accumulators of a ``tile_mn`` output tile."""
    thr_mma = tiled_mma.get_slice(ctid)
    frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
    frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
    acc = cute.make_rmem_tensor(thr_mma.partition_C(cute.make_identity_tensor(tile_mn)).shape,
                                acc_dtype)
    return MmaOperands(frag_a, frag_b, acc)


def mma_stage(tiled_mma, acc, frag_a, frag_b, stage) -> None:
    """``acc += A @ B`` over ring stage ``stage``: its k-blocks' WGMMAs, issued
    (the caller commits them as one group)."""
    for kb in range(cute.size(frag_a, mode=[2])):  # plain Python: unrolled at trace time
        cute.gemm(tiled_mma, acc, frag_a[None, None, kb, stage], frag_b[None, None, kb, stage],
                  acc)


def release_stage(ring, release, in_flight: int) -> None:
    """Wait until at most ``in_flight`` committed WGMMA groups are pending, then
    give the oldest stage still held (``release``) back to the producers; the
    caller advances ``release`` (a state the tracer must see rebound in its own
    loop).  The mainloops keep one stage's WGMMAs in flight (``in_flight`` 1) and
    drain with 0."""
    warpgroup.wait_group(in_flight)
    ring.consumer_release(release)


class StageToShared(NamedTuple):
    """The epilogue's register -> shared copy of one thread: the ``stmatrix``
    copy, its shared-memory destination, the accumulators retiled for it, and
    one sub-tile's registers in fp32 (``frag``) and in the output dtype (``out``)."""

    copy: object
    dst: cute.Tensor
    acc: cute.Tensor
    frag: cute.Tensor
    out: cute.Tensor


def stage_to_shared(tiled_mma, acc, sC, ctid, c_layout, c_dtype, acc_dtype) -> StageToShared:
    """``stmatrix`` (8x8 x4) from the accumulators ``acc`` into the epilogue
    buffers ``sC`` of layout ``c_layout``."""
    r2s = cute.make_tiled_copy_S(
        sm90_utils.sm90_get_smem_store_op(c_layout, c_dtype, acc_dtype),
        cute.make_tiled_copy_C_atom(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), c_dtype),
            tiled_mma))
    thr_r2s = r2s.get_slice(ctid)
    dst = thr_r2s.partition_D(sC)
    acc_view = r2s.retile(acc)
    frag = cute.make_rmem_tensor(cute.shape(thr_r2s.partition_S(sC))[:3], acc_dtype)
    return StageToShared(r2s, dst, acc_view, frag, cute.make_rmem_tensor(frag.shape, c_dtype))


def store_copy(c_dtype, epi_cols: int, threads: int):
    """Shared -> global in 16-byte vectors: the rows of an ``epi_cols``-wide
    epilogue sub-tile spread over ``threads`` threads."""
    vec = 128 // c_dtype.width
    per_row = epi_cols // vec
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), c_dtype, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(
        atom, cute.make_layout((threads // per_row, per_row), stride=(per_row, 1)),
        cute.make_layout((1, vec)))


def accumulator_chunk(acc, chunk, frag) -> None:
    """Copy epilogue sub-tile ``chunk`` of the (retiled) accumulators into ``frag``."""
    for v in range(cute.size(frag)):  # plain Python: unrolled at trace time
        frag[v] = acc[chunk * cute.size(frag) + v]
