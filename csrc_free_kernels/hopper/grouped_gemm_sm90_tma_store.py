"""The Hopper grouped GEMM with its whole output tiles stored by TMA, awaiting its A/B.

Why: on Qwen3-30B-A3B down at T = 16384 (K = 768, twelve k-tiles a tile) about 7.7 k
cycles of each tile's ~20 k are fixed cost, and the epilogue's 16-byte ``st.global`` from
every MMA thread (64 KB a 128x256 tile, through L1: a 35 % L1 hit rate against QuACK's
91 % with TMA stores) is its largest part (``bench/notes/2026-12-07-gemm-core-h100.md``).

A tile whose rows all belong to its expert (``rows_valid >= tile_m``) cannot write a
neighbour's rows, so one tensor map over all of C serves it (columns past N are clipped
by the map).  Such a tile's sub-tiles leave by asynchronous TMA stores, each buffer's
wait deferred to its next reuse; the last, partial m-tile of an expert keeps the
predicated thread stores.  Both go through the same ``epi_stages`` buffers, so the
store thread waits before every sub-tile's barrier.  Not chosen by ``choose_config``;
the harness runs it as ``ts_moe:kernel=tma_store`` (in the tiles ``choose_config``
picks), :func:`builds` are its pre-flighted builds.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from .grouped_gemm_sm90 import GroupedGemmSm90, GroupedGemmSwigluSm90, Warp
from .sm90_mma import RaggedTileMma
from ..common.tile_schedule import TileScheduler, WorkTile


class TmaStoreEpilogue:
    """The epilogue of :mod:`.grouped_gemm_sm90_tma_store`, a mixin ahead of a
    :class:`GroupedGemmSm90` class.

    Per sub-tile ``i`` (buffer ``i % B``, ``B`` = ``epi_stages``, two: a third would cost
    the 128x256 tile a ring stage's room, and ``i % 3`` an offset the pre-flight cannot
    bound): every MMA thread stmatrix-es its part and fences it to the async proxy (on
    every path: the pre-flight's ``proxy-fence`` rule does not correlate branches); the
    store warp (the first MMA warp) waits (``cp.async.bulk.wait_group.read B - 2``) until the
    store issued from the buffer sub-tile ``i + 1`` writes has read it; the epilogue
    barrier; then one lane of the store warp issues the tile's TMA store and commits its
    group, or every thread stores its part of a partial tile.  The store warp waits for
    all its stores before the CTA exits.  ``extra``: the store's atom and tensor map.
    """

    variant = "tma_store"  # the builds' name suffix (grouped_gemm_sm90_launch.build)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB_ekn: cute.Tensor, mC: cute.Tensor,
                 mOffs: cute.Tensor, num_ctas: cutlass.Int32, stream):
        self.launch(mA, mB_ekn, mC, mOffs, (mC,), num_ctas, stream)

    def extra_params(self, tma_atom_a, mC) -> tuple:
        """The TMA store's atom and tensor map: boxes of one epilogue buffer over C."""
        tma_atom_c, mC_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC,
            cute.slice_(self.epi_smem_layout, (None, None, 0)), self.epi_tile)
        return (tma_atom_c, mC_tma)

    def prefetch_extra(self, extra):
        cpasync.prefetch_descriptor(extra[0])

    def tile_stores(self, sC, ctid):
        thr_s2g, tSsC = super().tile_stores(sC, ctid)
        return thr_s2g, tSsC, sC

    @cute.jit
    def consume(self, tiled_mma, mC, sA, sB, sC, ring, ctid, sched: TileScheduler, k_tiles,
                extra):
        # (the DSL's rewrite of a jit method loses super()'s class cell: named)
        RaggedTileMma.consume(self, tiled_mma, mC, sA, sB, sC, ring, ctid, sched, k_tiles, extra)
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == Warp.MMA:
            # every store has read its buffer before the CTA's shared memory goes
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def mma_tile(self, thread, ring, read, release, k_tiles, tile: WorkTile, run, mma_rows,
                 rows_valid, mC, n_cols, epi_count, extra):
        thread.ops.acc.fill(0.0)
        if run:
            read, release = self.mainloop(thread.tiled_mma, thread.ops, ring, read, release,
                                          k_tiles, mma_rows, thread.wg_row0, tile, n_cols, extra)
            self.scale_accumulators(thread.ops.acc, tile, n_cols, extra)
        epi_count = self.store_tile(thread.staged, thread.stores, mC, extra, tile.row0,
                                    tile.n_tile, rows_valid, epi_count)
        return epi_count, release, read

    @cute.jit
    def store_tile(self, staged, stores, mC, extra, row0, n_tile, rows_valid, epi_count):
        """Tile ``(row0, n_tile)`` of C: by TMA where all its ``tile_m`` rows are the
        expert's, else by predicated thread stores of its ``rows_valid`` rows."""
        cfg = self.cfg
        r2s, tRS_sC, tRS_rAcc, tRS_rD, tRS_rOut = staged
        thr_s2g, tSsC, sC = stores
        tma_atom_c, mC_tma = extra
        m_subs, n_subs, chunks_n = self.epi_subtiles()
        whole = rows_valid >= cfg.tile_m
        store_warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == Warp.MMA
        tile_mn = (cfg.tile_m, self.out_tile_n)
        # the tile's sub-tiles in the tensor map (TMA, m_subs, n_subs), and in C for the
        # thread stores, with their coordinates
        gC_tma = cute.local_tile(cute.domain_offset((row0, 0), mC_tma), tile_mn, (0, n_tile))
        tTsC, tTgC = cpasync.tma_partition(
            tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
            cute.group_modes(cute.flat_divide(gC_tma, self.epi_tile), 0, 2))
        gC = cute.local_tile(cute.domain_offset((row0, 0), mC), tile_mn, (0, n_tile))
        cC = cute.local_tile(cute.make_identity_tensor(mC.shape), tile_mn, (0, n_tile))
        for epi in cutlass.range_constexpr(m_subs * n_subs):
            mi, ni = divmod(epi, n_subs)
            buf = epi_count % self.epi_stages
            self.epilogue_fragment(tRS_rAcc, mi * chunks_n + ni, tRS_rD, tRS_rOut)
            cute.copy(r2s, tRS_rOut, tRS_sC[None, None, None, buf])
            # the stmatrix writes, for the TMA (async proxy) to read
            cute.arch.fence_proxy("async.shared", space="cta")
            if store_warp:
                # the store from the buffer the next sub-tile writes, epi_stages - 1
                # sub-tiles ago, has read it: the later ones may still be pending
                cute.arch.cp_async_bulk_wait_group(self.epi_stages - 2, read=True)
            self.epi_barrier.arrive_and_wait()
            if whole:
                if store_warp:
                    with cute.arch.elect_one():
                        cute.copy(tma_atom_c, tTsC[None, buf], tTgC[None, mi, ni])
                        cute.arch.cp_async_bulk_commit_group()
            else:
                self.store_subtile(thr_s2g, tSsC, gC, cC, mi, ni, buf, rows_valid, mC.shape[1])
            epi_count += 1
        return epi_count


class GroupedGemmTmaStoreSm90(TmaStoreEpilogue, GroupedGemmSm90):
    """:class:`GroupedGemmSm90` with :class:`TmaStoreEpilogue`."""


class GroupedGemmSwigluTmaStoreSm90(TmaStoreEpilogue, GroupedGemmSwigluSm90):
    """:class:`GroupedGemmSwigluSm90` with :class:`TmaStoreEpilogue`."""


def builds():
    """The variant's builds the PTX tests and the pre-flight compile: bf16, K-major weights
    (the layer's), plain and SwiGLU, in the 128-row configurations (the 64-row ones store
    by threads alone) and ``decode`` (its thread-store path)."""
    import torch

    from .grouped_gemm_sm90_config import CONFIGS
    from .grouped_gemm_sm90_launch import build

    for name in ("prefill_p2", "mid", "decode"):
        for cls in (GroupedGemmTmaStoreSm90, GroupedGemmSwigluTmaStoreSm90):
            yield build(CONFIGS[name], torch.bfloat16, torch.bfloat16, False,
                        cls is GroupedGemmSwigluTmaStoreSm90, kernel_cls=cls)
