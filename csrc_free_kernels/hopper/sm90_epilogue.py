"""Pieces the Hopper (sm_90a) WGMMA kernels share: a thread's MMA operands and
accumulators, the mainloop's steps (one ring stage's WGMMAs, the release of a
finished stage), and the epilogue's copies (accumulators -> shared memory by
``stmatrix``, shared -> global by 16-byte thread stores): plain functions,
traced inline inside the kernels' ``@cute.jit`` methods.  And
:class:`RaggedTileEpilogue`, the grouped GEMM's epilogue as methods its kernel
classes inherit (and a variant replaces).
"""

from typing import NamedTuple

import cutlass
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


class RaggedTileEpilogue:
    """A ragged output tile from the accumulators of the Hopper grouped GEMM:
    ``tile_m x out_tile_n`` through ``epi_tile`` sub-tiles, stmatrix into
    ``epi_stages`` swizzled shared-memory buffers, each stored right away by
    16-byte thread stores predicated on the expert's rows and on N, so a tile
    never writes a row of a neighbouring expert.

    A mixin of :class:`csrc_free_kernels.hopper.grouped_gemm_sm90.GroupedGemmSm90`,
    whose ``_setup`` sets what these methods read: ``cfg``, ``out_tile_n``,
    ``epi_tile``, ``epi_stages``, ``epi_threads``, ``epi_barrier`` and
    ``c_dtype``.  :meth:`epilogue_fragment` is the hook for what a sub-tile
    holds (the SwiGLU kernel's ``silu(gate) * up``).
    """

    def make_epi_smem_layout(self, c_dtype, c_layout):
        """The epilogue's shared-memory buffers: ``epi_stages`` swizzled sub-tiles."""
        return sm90_utils.make_smem_layout_epi(c_dtype, c_layout, self.epi_tile,
                                               self.epi_stages)

    def epilogue_buffers(self, storage, epi_smem_layout):
        """The epilogue's shared-memory tensor (``sC``) of ``storage``."""
        return storage.sC.get_tensor(epi_smem_layout.outer, swizzle=epi_smem_layout.inner)

    def epi_subtiles(self):
        """(m_subs, n_subs, chunks_n): the output tile's sub-tiles ``(mi, ni)``,
        and the accumulator chunks per sub-tile row.  The retiled accumulators
        hold a thread's values row block by row block (mode 1), each with all
        of its columns in mode 0, so sub-tile ``(mi, ni)`` is chunk
        ``mi * chunks_n + ni``."""
        return (self.cfg.tile_m // self.epi_tile[0], self.out_tile_n // self.epi_tile[1],
                self.cfg.tile_n // self.epi_tile[1])

    def tile_stores(self, sC, ctid):
        """The 16-byte stores of the epilogue: thread ``ctid``'s copy and its view
        of the buffers ``sC``."""
        thr_s2g = self.make_store_copy().get_slice(ctid)
        return thr_s2g, thr_s2g.partition_S(sC)

    @cute.jit
    def epilogue(self, staged, stores, mC, row0, n_tile, rows_valid, epi_count):
        """Tile ``(row0, n_tile)`` of C from the accumulators: sub-tile by sub-tile
        through ``epi_stages`` shared-memory buffers, each stored right away by
        predicated 16-byte stores of the expert's ``rows_valid`` rows (up to N).
        ``epi_count``: the sub-tiles stored so far (it picks the buffer);
        returns it advanced past this tile's."""
        cfg = self.cfg
        r2s, tRS_sC, tRS_rAcc, tRS_rD, tRS_rOut = staged
        thr_s2g, tSsC = stores
        m_subs, n_subs, chunks_n = self.epi_subtiles()
        # (tile_m, out_tile_n) of C at (row0, n_tile); its coordinates
        gC = cute.local_tile(cute.domain_offset((row0, 0), mC),
                             (cfg.tile_m, self.out_tile_n), (0, n_tile))
        cC = cute.local_tile(cute.make_identity_tensor(mC.shape),
                             (cfg.tile_m, self.out_tile_n), (0, n_tile))
        for epi in cutlass.range_constexpr(m_subs * n_subs):
            mi, ni = divmod(epi, n_subs)
            buf = epi_count % self.epi_stages
            self.epilogue_fragment(tRS_rAcc, mi * chunks_n + ni, tRS_rD, tRS_rOut)
            cute.copy(r2s, tRS_rOut, tRS_sC[None, None, None, buf])
            self.epi_barrier.arrive_and_wait()
            self.store_subtile(thr_s2g, tSsC, gC, cC, mi, ni, buf, rows_valid, mC.shape[1])
            epi_count += 1
        return epi_count

    @cute.jit
    def store_subtile(self, thr_s2g, tSsC, gC, cC, mi, ni, buf, rows_valid, n_cols):
        """Sub-tile ``(mi, ni)`` of the tile ``gC`` (coordinates ``cC``) from buffer
        ``buf``: this thread's 16-byte vectors of the first ``rows_valid`` rows, up to
        column ``n_cols``."""
        # (epi_m, epi_n) sub-tile of C and of its coordinates
        tSgC = thr_s2g.partition_D(cute.local_tile(gC, self.epi_tile, (mi, ni)))
        tScC = thr_s2g.partition_D(cute.local_tile(cC, self.epi_tile, (mi, ni)))
        for i in cutlass.range_constexpr(cute.size(tSgC, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(tSgC, mode=[2])):
                crd = tScC[0, i, j]
                if crd[0] < rows_valid and crd[1] < n_cols:
                    cute.autovec_copy(tSsC[None, i, j, buf], tSgC[None, i, j])

    accumulator_chunk = staticmethod(accumulator_chunk)

    @cute.jit
    def epilogue_fragment(self, tRS_rAcc, chunk, tRS_rD, tRS_rOut):
        """An output sub-tile in registers, from accumulator chunk ``chunk``: fp32
        accumulators -> output dtype."""
        self.accumulator_chunk(tRS_rAcc, chunk, tRS_rD)
        tRS_rOut.store(tRS_rD.load().to(self.c_dtype))

    def make_store_copy(self):
        """16-byte vectors, rows of the epilogue tile spread over a tile's MMA threads."""
        return store_copy(self.c_dtype, self.epi_tile[1], self.epi_threads)
