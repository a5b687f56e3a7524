"""The MMA warpgroups of the Hopper (sm_90a) ragged grouped GEMM: the walk over
the CTA's tiles, each tile's mainloop and epilogue, as methods its kernel
classes inherit (:class:`RaggedTileMma`) and variants override at the hooks
:meth:`~RaggedTileMma.bind_mma`, :meth:`~RaggedTileMma.mainloop` and
:meth:`~RaggedTileMma.scale_accumulators` (the FP8 kernel's promotion and
scales), besides the epilogue's of :class:`.sm90_epilogue.RaggedTileEpilogue`.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cp
from cutlass.cute.nvgpu import warpgroup

from .sm90_epilogue import (MmaOperands, RaggedTileEpilogue, StageToShared, mma_operands,
                            mma_stage, release_stage, stage_to_shared)
from ..common.tile_schedule import TileScheduler, WorkTile


class MmaThread(NamedTuple):
    """What an MMA thread keeps for its whole walk."""

    tiled_mma: object
    ops: MmaOperands       # its fragments of the ring's stages, its accumulators
    staged: StageToShared  # the epilogue's register -> shared copy
    stores: object         # the epilogue's shared -> global stores (tile_stores)
    wg_row0: object        # the first tile row of its warpgroup


class RaggedTileMma(RaggedTileEpilogue):
    """The MMA warpgroups' side of
    :class:`csrc_free_kernels.hopper.grouped_gemm_sm90.GroupedGemmSm90`, a mixin whose
    ``_setup`` sets what these methods read (``cfg``, ``stages``, ``acc_dtype``,
    ``c_layout``, ``c_dtype`` and the epilogue's)."""

    @cute.jit
    def consume(self, tiled_mma, mC, sA, sB, sC, ring, ctid, sched: TileScheduler, k_tiles,
                extra):
        """Every tile of the CTA's walk (:meth:`mma_tile`); ``ctid`` the thread's
        index among the MMA threads, ``extra`` the kernel's (after
        :meth:`bind_mma`)."""
        cfg = self.cfg
        ops = mma_operands(tiled_mma, sA, sB, ctid, (cfg.tile_m, cfg.tile_n), self.acc_dtype)
        extra = self.bind_mma(tiled_mma, ops.acc, ctid, extra)

        # epilogue: registers -> shared (stmatrix) -> global (16-byte predicated)
        staged = stage_to_shared(
            tiled_mma, ops.acc, sC, ctid, self.c_layout, self.c_dtype, self.acc_dtype)
        stores = self.tile_stores(sC, ctid)
        m_subs, _, _ = self.epi_subtiles()
        assert cute.size(staged.acc, mode=[1]) == m_subs and cute.size(staged.acc, mode=[2]) == 1, \
            (staged.acc.layout, self.epi_tile)
        # the first tile row of this thread's warpgroup: with both warpgroups
        # on one tile (64 rows each), one whose rows are all past the
        # expert's end skips its MMAs, and the tensor cores run the other's
        # alone: a part-empty last m-tile costs about what its rows need
        wg_row0 = 0
        if cutlass.const_expr(cfg.mma_warpgroups > 1):
            wg_row0 = cute.arch.make_warp_uniform(ctid // 128) * 64
        thread = MmaThread(tiled_mma, ops, staged, stores, wg_row0)

        read = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.stages)
        release = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.stages)
        lead, total_tiles = sched.lead, sched.total_tiles
        n_cols = mC.shape[1]
        t = sched.first
        epi_count = cutlass.Int32(0)
        while t - lead < total_tiles:
            tile = sched.work_tile(cutlass.min(t, total_tiles - 1))
            # rows of this expert in this CTA's tile (<= 0: the spare half of a
            # cluster tile, which still takes its share of the multicast but
            # skips the MMAs: idle tensor cores leave power to clock the others
            # higher)
            rows_valid = self.stored_rows(tile.row0, tile.seg_end, t, total_tiles)
            mma_rows = rows_valid
            run = tile.expert < sched.num_experts
            if cutlass.const_expr(cfg.pair_tiles):
                # every stage the pair's producers fill: the tile missing from
                # a pair stores nothing (stored_rows), the zero tail computes nothing
                if tile.expert >= sched.num_experts:
                    run = t - lead < total_tiles  # true in the loop: run the stages
                    mma_rows = cutlass.Int32(0)
            epi_count, release, read = self.mma_tile(
                thread, ring, read, release, k_tiles, tile, run, mma_rows, rows_valid, mC,
                n_cols, epi_count, extra)
            t += sched.step

    @cute.jit
    def mma_tile(self, thread: MmaThread, ring, read, release, k_tiles, tile: WorkTile, run,
                 mma_rows, rows_valid, mC, n_cols, epi_count, extra):
        """One tile: the accumulators zeroed, then (``run``) :meth:`mainloop` and
        :meth:`scale_accumulators`, then the epilogue of its ``rows_valid`` rows.
        Returns ``(epi_count, release, read)`` advanced, the order in which the
        walk's loop carries them (the order shapes the compiled code)."""
        thread.ops.acc.fill(0.0)
        if run:
            read, release = self.mainloop(thread.tiled_mma, thread.ops, ring, read, release,
                                          k_tiles, mma_rows, thread.wg_row0, tile, n_cols, extra)
            self.scale_accumulators(thread.ops.acc, tile, n_cols, extra)
        epi_count = self.epilogue(thread.staged, thread.stores, mC, tile.row0, tile.n_tile,
                                  rows_valid, epi_count)
        return epi_count, release, read

    def bind_mma(self, tiled_mma, acc, ctid, extra):
        """MMA thread ``ctid``, before its first tile: ``extra`` with what a
        variant's mainloop keeps in registers added; as it is here."""
        return extra

    @cute.jit
    def mainloop(self, tiled_mma, ops: MmaOperands, ring, read, release, k_tiles, mma_rows,
                 wg_row0, tile: WorkTile, n_cols, extra):
        """``ops.acc += A @ B`` over the tile's ``k_tiles`` ring stages, the MMAs
        skipped by a warpgroup whose rows (from ``wg_row0``) are all past
        ``mma_rows``; returns the consumer states ``(read, release)`` advanced
        past the stages."""
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.fence()
        for k in cutlass.range(k_tiles, unroll=1):
            ring.consumer_wait(read)
            self.stage_visible()
            if mma_rows > wg_row0:
                mma_stage(tiled_mma, ops.acc, ops.a, ops.b, read.index)
            warpgroup.commit_group()
            # keep one k-tile of WGMMA in flight; free the one before it
            if k > 0:
                release_stage(ring, release, 1)
                release.advance()
            read.advance()
        release_stage(ring, release, 0)
        release.advance()
        return read, release

    def stage_visible(self):
        """After a stage's full barrier, before its MMAs read it: nothing here (the
        stage is written by TMA, in the MMA's own async proxy)."""

    def scale_accumulators(self, acc, tile: WorkTile, n_cols, extra):
        """The tile's accumulators after its mainloop, before its epilogue: as
        they are here."""

    @cute.jit
    def stored_rows(self, row0, seg_end, t, total_tiles):
        """Rows of tile ``t`` that its epilogue stores: the expert's rows in this
        CTA's tile (<= 0: the spare half of a cluster tile); none for the tile
        missing from a pair (``t`` past the walk's end)."""
        rows = cutlass.min(seg_end - row0, self.cfg.rows)
        if cutlass.const_expr(self.cfg.pair_tiles):
            if t >= total_tiles:
                rows = cutlass.Int32(0)
        return rows
