"""The Hopper grouped GEMM with its output tiles stored by a warp of their own: a variant
that lost its A/B (bench/notes/2026-12-04-store-warp-epilogue.md, the H100 numbers in
2026-12-06-h100-run.md), kept here as a probe of the pre-flight's bulk-copy and
proxy-fence rules (the one build that stores global memory with non-tensor bulk copies of
rows threads wrote to shared memory).  Never launched.

The MMA threads write the whole output tile to shared memory (``stmatrix``,
rows padded by 16 bytes) and go back to their mainloop; the SCHEDULE warp, idle
after building the schedule, stores it, a bulk copy (``cp.async.bulk``) per row
of the expert, and frees the buffer once the copies have read it.  What it
trades (the 66 KB buffer costs the 128x256 tile a ring stage), what the CPU
has checked and the A/B to run: bench/notes/2026-12-04-store-warp-epilogue.md.

:class:`StoreWarpEpilogue` replaces the kernel's epilogue; the kernel classes
are :class:`GroupedGemmStoreWarpSm90` and :class:`GroupedGemmSwigluStoreWarpSm90`.
"""

import enum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cp
from cutlass.experimental.primitives import cp_async_bulk_global_shared_cta

from csrc_free_kernels.common.tile_schedule import TileScheduler
from csrc_free_kernels.hopper.grouped_gemm_sm90 import (GroupedGemmSm90, GroupedGemmSwigluSm90,
                                                        TileConfig, Warp)


class StoreWarpBarrier(enum.IntEnum):
    """Named barriers between the MMA threads and the store warp (the kernel's own
    :class:`csrc_free_kernels.hopper.grouped_gemm_sm90.Barrier` ids are below these)."""

    TILE_STAGED = 5   # the tile is in shared memory (MMA threads -> store warp)
    TILE_STORED = 6   # its buffer is free again (store warp -> MMA threads)


STORE = Warp.SCHEDULE  # the warp that stores the staged tiles


class StoreWarpEpilogue:
    """The epilogue of :class:`csrc_free_kernels.hopper.grouped_gemm_sm90.GroupedGemmSm90`
    with the stores moved to the STORE warp: a mixin placed before the kernel
    class.  128-row tiles (both MMA warpgroups share the staged tile), 16-bit
    row-major output."""

    def __init__(self, config: TileConfig, acc_dtype=cutlass.Float32,
                 prefetch_weights: bool = False):
        if config.tile_m != 128:
            raise ValueError(f"store_warp stages the 128-row tile both MMA warpgroups share "
                             f"(not 64-row tiles): {config}")
        super().__init__(config, acc_dtype, prefetch_weights)
        self.tile_staged = cp.NamedBarrier(barrier_id=StoreWarpBarrier.TILE_STAGED,
                                           num_threads=self.epi_threads + 32)
        self.tile_stored = cp.NamedBarrier(barrier_id=StoreWarpBarrier.TILE_STORED,
                                           num_threads=self.epi_threads + 32)

    def _setup(self, a_dtype, c_dtype, a_layout, b_layout, c_layout):
        if c_dtype.width != 16 or not c_layout.is_n_major_c():
            raise ValueError(f"{self.cfg}: store_warp stages 16-bit row-major output tiles, "
                             f"got {c_dtype} ({c_layout})")
        super()._setup(a_dtype, c_dtype, a_layout, b_layout, c_layout)

    def make_epi_smem_layout(self, c_dtype, c_layout):
        """The whole output tile in shared memory, row-major, rows of
        ``staged_row`` elements (padded by 16 bytes: ``stmatrix`` without bank
        conflicts, and each row one contiguous bulk copy), as ``(epi_m, epi_n,
        sub-tiles)`` for the epilogue's sub-tile loop (sub-tile ``mi * n_subs +
        ni``)."""
        self.staged_row = self.out_tile_n + 128 // c_dtype.width
        epi_m, epi_n = self.epi_tile[0], self.epi_tile[1]
        m_subs, n_subs = self.cfg.tile_m // epi_m, self.out_tile_n // epi_n
        return cute.make_layout((epi_m, epi_n, (n_subs, m_subs)),
                                stride=(self.staged_row, 1, (epi_n, epi_m * self.staged_row)))

    def epilogue_buffers(self, storage, epi_smem_layout):
        return storage.sC.get_tensor(epi_smem_layout)

    def tile_stores(self, sC, ctid):
        """None: the MMA threads store nothing themselves."""
        return None

    @cute.jit
    def epilogue(self, staged, stores, mC, row0, n_tile, rows_valid, epi_count):
        """The whole tile into the staged buffer once the STORE warp has stored the
        tile before (``epi_count``: the tiles staged so far; returned plus one),
        then handed to it."""
        r2s, tRS_sC, tRS_rAcc, tRS_rD, tRS_rOut = staged
        m_subs, n_subs, chunks_n = self.epi_subtiles()
        if epi_count > 0:
            self.tile_stored.arrive_and_wait()
        for epi in cutlass.range_constexpr(m_subs * n_subs):
            mi, ni = divmod(epi, n_subs)
            self.epilogue_fragment(tRS_rAcc, mi * chunks_n + ni, tRS_rD, tRS_rOut)
            cute.copy(r2s, tRS_rOut, tRS_sC[None, None, None, epi])
        # stmatrix writes (generic proxy) before the bulk copies' reads
        cute.arch.fence_proxy("async.shared", space="cta")
        self.tile_staged.arrive()
        return epi_count + 1

    @cute.jit
    def extra_roles(self, warp_idx, mC, sC, sched: TileScheduler):
        if warp_idx == STORE:
            self.store_tiles(mC, sC, sched)

    @cute.jit
    def store_tiles(self, mC: cute.Tensor, sC: cute.Tensor, sched: TileScheduler):
        """The STORE warp: each tile of the CTA's walk, once the MMA threads have
        staged it, stored a row per bulk copy (``cp.async.bulk``, lane ``i`` rows
        ``i, i + 32, ...``): the expert's rows only, up to N (16-byte granules:
        the output's rows are padded to 16 bytes).  The buffer is given back
        once the copies have read it; the writes complete before the warp
        exits."""
        cfg = self.cfg
        lane = cute.arch.lane_idx()
        n_cols = mC.shape[1]
        granule = 128 // self.c_dtype.width  # elements per 16 bytes
        lead, total_tiles = sched.lead, sched.total_tiles
        t = sched.first
        while t - lead < total_tiles:
            _, row0, seg_end, n_tile = sched.work_tile(cutlass.min(t, total_tiles - 1))
            rows = self.stored_rows(row0, seg_end, t, total_tiles)
            n0 = n_tile * self.out_tile_n
            cols = cutlass.min(n_cols - n0, self.out_tile_n)
            nbytes = (cols + granule - 1) // granule * 16
            self.tile_staged.arrive_and_wait()  # the tile is in shared memory
            for i in cutlass.range_constexpr(cfg.tile_m // 32):
                r = lane + 32 * i
                if r < rows:
                    cp_async_bulk_global_shared_cta(
                        mC.iterator + cute.crd2idx((row0 + r, n0), mC.layout),
                        sC.iterator + r * self.staged_row, nbytes)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            if t + sched.step - lead < total_tiles:
                self.tile_stored.arrive()  # the buffer is free
            t += sched.step
        cute.arch.cp_async_bulk_wait_group(0)


class GroupedGemmStoreWarpSm90(StoreWarpEpilogue, GroupedGemmSm90):
    """:class:`csrc_free_kernels.hopper.grouped_gemm_sm90.GroupedGemmSm90`, its tiles
    stored by the STORE warp."""


class GroupedGemmSwigluStoreWarpSm90(StoreWarpEpilogue, GroupedGemmSwigluSm90):
    """:class:`csrc_free_kernels.hopper.grouped_gemm_sm90.GroupedGemmSwigluSm90`, its tiles
    stored by the STORE warp."""
