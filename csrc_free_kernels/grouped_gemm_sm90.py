"""Ragged grouped GEMM for Hopper (sm_90a): WGMMA + TMA, persistent, warp-specialized.

``out[r] = a[r] @ b[e]`` for the rows ``r`` of expert ``e`` (``offs`` read on
the device), zeros for the rows past the last expert.  See
:class:`GroupedGemmSm90` for the design; its configurations are in
:mod:`.grouped_gemm_sm90_config`, its torch entry points in
:mod:`.grouped_gemm_sm90_launch`.
"""

import dataclasses
import enum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cp
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.experimental.primitives import cp_async_bulk_global_shared_cta
from cutlass.tensor_utils import LayoutEnum

import ts_pipeline

from . import pdl
from .grouped_gemm_sm90_config import MAX_EXPERTS, SMEM_CAPACITY, TileConfig
from .sm90_epilogue import (accumulator_chunk, mma_operands, mma_stage, release_stage,
                            stage_to_shared, store_copy)
from .tile_schedule import RaggedTileSchedule, TileScheduler


class Warp(enum.IntEnum):
    """Warp roles of a CTA (``128 * (1 + mma_warpgroups)`` threads)."""

    LOAD_A = 0     # TMA of the token tile; the task warp leader (arms each full barrier)
    LOAD_B = 1     # warps 1 .. b_warps: TMA of one weight part each
    SCHEDULE = 3   # builds the tile schedule in shared memory; then idles, or stores
                   # the output tiles (store_warp)
    MMA = 4        # warps 4..: the WGMMA warpgroups, then the epilogue


class Barrier(enum.IntEnum):
    """Named barriers among the MMA threads, and (``store_warp``) between them and
    warp 3 (id 0 is the CTA-wide one)."""

    EPILOGUE = 1      # an epilogue sub-tile is in shared memory (a tile's MMA threads)
    EPILOGUE_WG1 = 2  # the same for the second warpgroup of a ping-pong pair
    # ping-pong: warpgroup 0 (1) may start its next tile's mainloop, the other
    # one has passed all the ring waits of the tile before
    TURN_WG0 = 3
    TURN_WG1 = 4
    # store_warp: the tile is in shared memory (MMA threads -> warp 3), and its
    # buffer is free again (warp 3 -> MMA threads)
    TILE_STAGED = 5
    TILE_STORED = 6


class GroupedGemmSm90:
    """Persistent ragged grouped GEMM, ``C[rows of e] = A[rows of e] @ B[e]``.

    Warp roles (one CTA per SM, ``128 * (1 + mma_warpgroups)`` threads):

    - warp 0: TMA producer of the token tile ``A[row0:row0+tile_m, k:k+tile_k]``;
      the *task warp leader*: it arms each stage's full barrier once, with the
      bytes of all the stage's loads.
    - warps 1..b_warps: TMA producers of the expert-weight tile, each
      ``tile_n / b_warps`` rows of ``B[e]`` (``multi_warp=False``: warp 0
      issues these loads too).
    - warp 3: builds the tile schedule in shared memory at start, then idles,
      or with ``store_warp`` stores each output tile the MMA warpgroups staged
      (bulk copies, a row each; named barriers ``TILE_STAGED`` and
      ``TILE_STORED`` between the two roles).
    - warpgroups 1..: WGMMA consumers (64 rows each of every tile, skipping
      the MMAs of rows all past the expert's end, or with ``pingpong`` whole
      tiles, alternately), then the epilogue: registers ->
      stmatrix -> shared memory -> 16-byte predicated stores, so a tile never
      writes a row of a neighbouring expert.  Ping-pong warpgroups take turns
      through two named barriers: a warpgroup starts a tile's mainloop once
      the other has passed its ring waits of the tile before.

    Pipeline: TMA producers -> MMA warpgroups, ``TSPipelineTmaAsync``
    (``PipelineTmaAsync`` for ``multi_warp=False``), ``stages`` stages of
    ``(tile_m + tile_n) * tile_k * 2`` bytes: ``tile_m * tile_k * 2`` of tokens
    plus ``b_warps`` parts of ``tile_n / b_warps * tile_k * 2`` of weights.

    Schedule: :class:`csrc_free_kernels.tile_schedule.RaggedTileSchedule`
    (built by warp 3 from ``offs`` in shared memory; a ``WorkTile`` per step
    for every role), with the configuration's rows, cluster, pairs and bands.

    PDL (:mod:`csrc_free_kernels.pdl`): every thread waits for the kernel
    ahead before its first global access.  With ``prefetch_weights`` the
    weight warps do not: the schedule is built from ``offs`` (read from L2)
    and the weight parts of the first ``stages`` stages are loaded while the
    kernel ahead still runs; then they wait, and the token loads (warp 0,
    which arms the stages) and the stores follow the wait as always.  For
    callers whose ``offs`` and ``b`` are complete when the kernel ahead lets
    its dependents launch (``ts_moe.ops``: after its own row gather, or when
    told so).  Honoured with one CTA per cluster and multi-warp loads
    (:meth:`prefetch_supported`); otherwise off.
    """

    def __init__(self, config: TileConfig, acc_dtype=cutlass.Float32,
                 prefetch_weights: bool = False):
        self.cfg = config
        self.prefetch_weights = prefetch_weights and self.prefetch_supported(config)
        self.acc_dtype = acc_dtype
        self.tile_shape_mnk = (config.tile_m, config.tile_n, config.tile_k)
        self.b_part_n = config.tile_n // config.b_warps
        # output columns per tile (the SwiGLU kernel halves it)
        self.out_tile_n = config.tile_n
        self.num_mma_warpgroups = config.mma_warpgroups
        self.num_mma_threads = 128 * self.num_mma_warpgroups
        self.threads = 128 + self.num_mma_threads
        self.producer_regs = 40
        self.mma_regs = 232 if self.num_mma_warpgroups == 2 else 240
        # the threads of one tile's MMAs and epilogue; ping-pong: one warpgroup,
        # each with its own barrier and epilogue buffers
        self.epi_threads = 128 * config.stage_consumers
        self.epi_groups = self.num_mma_warpgroups // config.stage_consumers
        self.epi_barriers = [cp.NamedBarrier(barrier_id=Barrier.EPILOGUE + g,
                                             num_threads=self.epi_threads)
                             for g in range(self.epi_groups)]
        # ping-pong turns: a warpgroup waits on its own barrier and signals the
        # other's (a ring wait is by phase parity, so a warpgroup must not wait
        # on a stage more than one phase ahead of the ring: it would pass)
        self.turn_barriers = [cp.NamedBarrier(barrier_id=Barrier.TURN_WG0 + g,
                                              num_threads=2 * 128)
                              for g in range(self.epi_groups if config.pingpong else 0)]
        self.epi_stages = 2
        if config.store_warp and (config.pingpong or config.tile_m != 128):
            raise ValueError(f"store_warp stages the 128-row tile both MMA warpgroups share "
                             f"(not 64-row or ping-pong tiles): {config}")
        # store_warp: staged (MMA threads -> warp 3), stored (warp 3 -> MMA threads)
        self.tile_barriers = [cp.NamedBarrier(barrier_id=b, num_threads=self.epi_threads + 32)
                              for b in ((Barrier.TILE_STAGED, Barrier.TILE_STORED)
                                        if config.store_warp else ())]
        if config.pingpong and config.tile_m != 128:
            raise ValueError(f"a ping-pong warpgroup owns a 128-row tile: {config}")
        if config.b_warps not in (1, 2) or config.tile_n % config.b_warps:
            raise ValueError(f"b_warps must be 1 or 2 and divide tile_n: {config}")
        self.schedule = RaggedTileSchedule(
            cta_rows=config.rows, cluster_m=config.cluster_m, pair_tiles=config.pair_tiles,
            band_m=config.band_m, max_experts=MAX_EXPERTS)

    def staged_tile_layout(self):
        """``store_warp``: the whole output tile in shared memory, row-major, rows
        of ``staged_row`` elements (padded by 16 bytes: ``stmatrix`` without bank
        conflicts, and each row one contiguous bulk copy), as ``(epi_m, epi_n,
        sub-tiles)`` for the epilogue's sub-tile loop (sub-tile ``mi * n_subs +
        ni``)."""
        epi_m, epi_n = self.epi_tile[0], self.epi_tile[1]
        m_subs, n_subs = self.cfg.tile_m // epi_m, self.out_tile_n // epi_n
        return cute.make_layout((epi_m, epi_n, (n_subs, m_subs)),
                                stride=(self.staged_row, 1, (epi_n, epi_m * self.staged_row)))

    @staticmethod
    def prefetch_supported(config: TileConfig) -> bool:
        """Whether ``prefetch_weights`` takes effect: PDL on, and the weight warps
        own their CTA's weight loads alone (no multicast, not warp 0's)."""
        return pdl.ENABLED and config.cluster_m == 1 and config.multi_warp

    # ---------------------------------------------------------------- host
    def _setup(self, a_dtype, c_dtype, a_layout, b_layout, c_layout):
        cfg = self.cfg
        self.a_dtype, self.b_dtype, self.c_dtype = a_dtype, a_dtype, c_dtype
        self.a_layout, self.b_layout, self.c_layout = a_layout, b_layout, c_layout
        # a weight part (and a token box) must be whole swizzle atoms of the
        # tile, so that it is a contiguous piece of the stage: 8 rows of 128
        # bytes (K-major), or 64 columns (MN-major)
        if cfg.b_warps * cfg.cluster_m > 1:
            share_n = self.b_part_n // cfg.cluster_m
            if b_layout.is_k_major_b() and cfg.tile_k * a_dtype.width != 1024:
                raise ValueError(f"{cfg}: a split K-major weight tile needs 128-byte rows "
                                 f"(tile_k * element size), got {cfg.tile_k * a_dtype.width // 8}")
            if not b_layout.is_k_major_b() and share_n % 64:
                raise ValueError(f"{cfg}: each CTA's share of an N-major weight part, "
                                 f"{share_n} columns, must be a multiple of 64")
        assert a_layout.is_k_major_a(), "tokens are read K-major"
        if cfg.store_warp and (c_dtype.width != 16 or not c_layout.is_n_major_c()):
            raise ValueError(f"{cfg}: store_warp stages 16-bit row-major output tiles, "
                             f"got {c_dtype} ({c_layout})")
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            a_dtype, a_dtype,
            a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
            self.acc_dtype, (cfg.stage_consumers, 1, 1), tiler_mn=(64, cfg.tile_n),
        )
        # sub-tiles of all the tile's rows (128: a row of each warpgroup's 64),
        # or with ping-pong 64 rows, one of the warpgroup's two MMA row blocks
        self.epi_tile = sm90_utils.compute_tile_shape_or_override(
            self.tile_shape_mnk, c_dtype,
            is_cooperative=cfg.tile_m == 128 and not cfg.pingpong)
        if cfg.store_warp:
            self.staged_row = self.out_tile_n + 128 // c_dtype.width
            self.epi_smem_layout = self.staged_tile_layout()
        else:
            self.epi_smem_layout = sm90_utils.make_smem_layout_epi(
                c_dtype, c_layout, self.epi_tile, self.epi_stages * self.epi_groups)
        self.a_bytes = cfg.rows * cfg.tile_k * a_dtype.width // 8
        self.b_part_bytes = self.b_part_n * cfg.tile_k * a_dtype.width // 8
        self.stage_bytes = self.a_bytes + cfg.b_warps * self.b_part_bytes
        # as many stages as fit, up to the config's: an fp32 epilogue buffer
        # costs the 128x256 tile one of its four.  A stage holds a whole
        # tile_m-row token tile even where the box fills fewer rows
        fixed = (cute.cosize(self.epi_smem_layout) * c_dtype.width // 8
                 + 8 * self.schedule.table_words + 3 * 1024)
        stage_smem = (cfg.tile_m + cfg.tile_n) * cfg.tile_k * a_dtype.width // 8
        self.stages = min(cfg.stages, (SMEM_CAPACITY - fixed) // stage_smem)
        if self.stages < 2:
            raise ValueError(f"{cfg} leaves room for {self.stages} stages")
        # (tile_m, tile_k, stages), (tile_n, tile_k, stages)
        self.a_smem_layout = sm90_utils.make_smem_layout_a(
            a_layout, self.tile_shape_mnk, a_dtype, self.stages)
        self.b_smem_layout = sm90_utils.make_smem_layout_b(
            b_layout, self.tile_shape_mnk, a_dtype, self.stages)
        # one token box of one stage: (rows, tile_k), the first rows of the A tile
        self.a_box_smem_layout = cute.slice_(sm90_utils.make_smem_layout_a(
            a_layout, (cfg.rows, cfg.tile_n, cfg.tile_k), a_dtype, 1), (None, None, 0))
        # one weight part of one stage: (b_part_n, tile_k)
        self.b_part_smem_layout = cute.slice_(sm90_utils.make_smem_layout_b(
            b_layout, (cfg.tile_m, self.b_part_n, cfg.tile_k), a_dtype, 1), (None, None, 0))

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB_ekn: cute.Tensor, mC: cute.Tensor,
                 mOffs: cute.Tensor, num_ctas: cutlass.Int32, stream):
        """mA (M, K), mB_ekn (E, K, N) as torch lays it out, mC (M, N), mOffs (E,)."""
        # (N, K, E): CuTe's B convention
        mB = cute.make_tensor(mB_ekn.iterator, cute.select(mB_ekn.layout, mode=[2, 1, 0]))
        self._setup(mA.element_type, mC.element_type, LayoutEnum.from_tensor(mA),
                    LayoutEnum.from_tensor(mB), LayoutEnum.from_tensor(mC))
        cfg = self.cfg
        tma_atom_a, mA_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mA, self.a_box_smem_layout,
            (cfg.rows, cfg.tile_k))
        tma_atom_b, mB_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp() if cfg.cluster_m > 1
            else cpasync.CopyBulkTensorTileG2SOp(),
            mB, self.b_part_smem_layout, (self.b_part_n, cfg.tile_k),
            num_multicast=cfg.cluster_m)
        # pair_tiles: whole weight parts for a pair whose tiles differ
        tma_atom_b1, mB1_tma = tma_atom_b, mB_tma
        if cutlass.const_expr(cfg.pair_tiles):
            tma_atom_b1, mB1_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mB, self.b_part_smem_layout,
                (self.b_part_n, cfg.tile_k))

        @cute.struct
        class SharedStorage:
            ring_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            seg_end: cute.struct.MemRange[cutlass.Int32, self.schedule.table_words]
            tile_end: cute.struct.MemRange[cutlass.Int32, self.schedule.table_words]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_layout)], 1024]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_layout)], 1024]
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_atom_a, mA_tma, tma_atom_b, mB_tma, tma_atom_b1, mB1_tma, mC, mOffs,
            self.tiled_mma,
            self.a_smem_layout, self.b_smem_layout, self.epi_smem_layout,
        ).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1),
                 cluster=(cfg.cluster_m, 1, 1), min_blocks_per_mp=1, stream=stream,
                 use_pdl=pdl.ENABLED)

    # -------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA: cute.Tensor, tma_atom_b: cute.CopyAtom,
               mB: cute.Tensor, tma_atom_b1: cute.CopyAtom, mB1: cute.Tensor, mC: cute.Tensor,
               mOffs: cute.Tensor, tiled_mma: cute.TiledMma,
               a_smem_layout: cute.ComposedLayout, b_smem_layout: cute.ComposedLayout,
               epi_smem_layout):
        cfg = self.cfg
        early = self.prefetch_weights
        if cutlass.const_expr(not early):
            pdl.enter()  # before the first global access (offs, tokens, weights, out)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        sched = TileScheduler.create(self.schedule, cta_rank, bidx, grid)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            if cutlass.const_expr(cfg.pair_tiles):
                cpasync.prefetch_descriptor(tma_atom_b1)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        m_rows, n_cols = mC.shape
        sched = sched.bind(storage, mOffs.shape[0], n_cols, self.out_tile_n)
        k_tiles = (mA.shape[1] + cfg.tile_k - 1) // cfg.tile_k
        if warp_idx == Warp.SCHEDULE:
            sched.build(mOffs, m_rows, coherent=early)
        cute.arch.sync_threads()  # the schedule, for every role

        ring = self.make_ring(storage.ring_barriers.data_ptr(), warp_idx)  # syncs the cluster
        sched = sched.with_total()

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        if cutlass.const_expr(cfg.store_warp):
            sC = storage.sC.get_tensor(epi_smem_layout)
        else:
            sC = storage.sC.get_tensor(epi_smem_layout.outer, swizzle=epi_smem_layout.inner)

        if warp_idx < Warp.MMA:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if cutlass.const_expr(early):
                if warp_idx == Warp.LOAD_A or warp_idx > cfg.b_warps:
                    pdl.enter()  # the weight warps wait in produce()
            if warp_idx <= (cfg.b_warps if cutlass.const_expr(cfg.multi_warp) else 0):
                self.produce(tma_atom_a, mA, tma_atom_b, mB, tma_atom_b1, mB1, sA, sB, ring,
                             warp_idx, sched, k_tiles, n_cols)
            if cutlass.const_expr(cfg.store_warp):
                if warp_idx == Warp.SCHEDULE:
                    self.store_tiles(mC, sC, sched)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            if cutlass.const_expr(early):
                pdl.enter()
            if cutlass.const_expr(cfg.pingpong):
                group = (warp_idx - Warp.MMA) // 4
                for g in cutlass.range_constexpr(self.epi_groups):
                    if group == g:
                        self.consume(tiled_mma, mC, sA, sB, sC, ring,
                                     tidx - 128 * (Warp.MMA // 4 + g), sched, k_tiles, g)
            else:
                self.consume(tiled_mma, mC, sA, sB, sC, ring, tidx - 128, sched, k_tiles, 0)

    def make_ring(self, barriers, warp_idx):
        cluster_m = self.cfg.cluster_m
        # a stage is released by every consumer warp of every CTA whose
        # producer multicasts into it
        consumers = cp.CooperativeGroup(cp.Agent.Thread,
                                        4 * self.cfg.stage_consumers * cluster_m)
        common = dict(
            num_stages=self.stages,
            producer_group=cp.CooperativeGroup(cp.Agent.Thread),
            consumer_group=consumers,
            tx_count=self.stage_bytes,
            barrier_storage=barriers,
            cta_layout_vmnk=cute.make_layout((1, cluster_m, 1, 1)) if cluster_m > 1 else None,
        )
        if self.cfg.multi_warp:
            return ts_pipeline.TSPipelineTmaAsync.create(**common,
                                                         is_task_warp_leader=warp_idx == 0)
        return cp.PipelineTmaAsync.create(**common)

    @cute.jit
    def produce(self, tma_atom_a, mA, tma_atom_b, mB, tma_atom_b1, mB1, sA, sB, ring, warp_idx,
                sched: TileScheduler, k_tiles, n_cols):
        cfg = self.cfg
        cta_rank, lead, total_tiles = sched.cta_rank, sched.lead, sched.total_tiles
        # (rows, tile_k, stages): the token box, the first rows of each A stage
        sA_box = cute.flat_divide(sA, (cfg.rows, cfg.tile_k))[None, None, 0, 0, None]
        # (b_part_n, tile_k, b_warps, 1, stages): the weight parts of each stage
        sB_parts = cute.flat_divide(sB, (self.b_part_n, cfg.tile_k))
        # gB: (b_part_n, tile_k, N parts, k-tiles, E); with a cluster, this CTA
        # loads its 1/cluster_m of each part and multicasts it to the cluster
        gB = cute.local_tile(mB, (self.b_part_n, cfg.tile_k), (None, None, None))
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, cta_rank, cute.make_layout(cfg.cluster_m),
            cute.group_modes(sB_parts, 0, 2), cute.group_modes(gB, 0, 2))
        tBsB1, tBgB1 = tBsB, tBgB
        if cutlass.const_expr(cfg.pair_tiles):
            # the same, whole parts, loaded by this CTA alone
            tBsB1, tBgB1 = cpasync.tma_partition(
                tma_atom_b1, 0, cute.make_layout(1), cute.group_modes(sB_parts, 0, 2),
                cute.group_modes(cute.local_tile(mB1, (self.b_part_n, cfg.tile_k),
                                                 (None, None, None)), 0, 2))
        state = cp.make_pipeline_state(cp.PipelineUserType.Producer, self.stages)
        issued = cutlass.Int32(0)  # with prefetch_weights: stages loaded before the wait
        t = sched.first
        while t - lead < total_tiles:
            expert, row0, _, n_tile = sched.work_tile(cutlass.min(t, total_tiles - 1))
            run = expert < sched.num_experts
            shared = cutlass.Int32(1)  # the weight tile is multicast to the cluster
            if cutlass.const_expr(cfg.pair_tiles):
                # both CTAs of a pair fill every stage of every iteration: each
                # stage is released by the consumers of both.  A missing tile
                # or one of the zero tail loads expert 0's first tile, unused
                peer = t + 1 - 2 * cta_rank
                p_expert, _, _, p_n = sched.work_tile(cutlass.min(peer, total_tiles - 1))
                if t >= total_tiles or expert >= sched.num_experts:
                    expert = cutlass.Int32(0)
                    row0 = cutlass.Int32(0)
                    n_tile = cutlass.Int32(0)
                    shared = cutlass.Int32(0)
                if peer >= total_tiles or p_expert != expert or p_n != n_tile:
                    shared = cutlass.Int32(0)
                run = t - lead < total_tiles
            if run:
                # (rows, tile_k, k-tiles) of tokens starting at row0
                gA = cute.local_tile(cute.domain_offset((row0, 0), mA),
                                     (cfg.rows, cfg.tile_k), (0, None))
                tAsA, tAgA = cpasync.tma_partition(
                    tma_atom_a, 0, cute.make_layout(1),
                    cute.group_modes(sA_box, 0, 2), cute.group_modes(gA, 0, 2))
                for k in cutlass.range(k_tiles, unroll=1):
                    ring.producer_acquire(state)
                    bar = ring.producer_get_barrier(state)
                    if warp_idx == 0:
                        cute.copy(tma_atom_a, tAgA[None, k], tAsA[None, state.index],
                                  tma_bar_ptr=bar)
                    if cutlass.const_expr(cfg.multi_warp):
                        if warp_idx > 0:
                            self.load_b(tma_atom_b, tBgB, tBsB, tma_atom_b1, tBgB1, tBsB1,
                                        shared, warp_idx - 1, n_tile, n_cols, k, expert,
                                        state.index, bar)
                            if cutlass.const_expr(self.prefetch_weights):
                                # the ring is full: wait for the kernel ahead
                                issued += 1
                                if issued == self.stages:
                                    pdl.enter()
                    else:
                        for part in cutlass.range_constexpr(cfg.b_warps):
                            self.load_b(tma_atom_b, tBgB, tBsB, tma_atom_b1, tBgB1, tBsB1,
                                        shared, part, n_tile, n_cols, k, expert,
                                        state.index, bar)
                    state.advance()
            t += sched.step
        if cutlass.const_expr(self.prefetch_weights):
            if warp_idx > 0 and issued < self.stages:
                pdl.enter()  # fewer k-tiles than stages in the whole walk
        ring.producer_tail(state)

    @cute.jit
    def load_b(self, tma_atom_b, tBgB, tBsB, tma_atom_b1, tBgB1, tBsB1, shared, part, n_tile,
               n_cols, k, expert, stage, bar):
        """Weight part ``part`` of k-tile ``k`` into ``stage``: this CTA's share
        of it, multicast to the cluster, or (``shared`` 0) all of it, for itself."""
        coord = self.b_part_coord(n_tile, part, n_cols)
        dst = tBsB[None, part, 0, stage]
        if cutlass.const_expr(self.cfg.cluster_m == 1):
            cute.copy(tma_atom_b, tBgB[None, coord, k, expert], dst, tma_bar_ptr=bar)
        elif cutlass.const_expr(not self.cfg.pair_tiles):
            cute.copy(tma_atom_b, tBgB[None, coord, k, expert], dst, tma_bar_ptr=bar,
                      mcast_mask=cutlass.Int16((1 << self.cfg.cluster_m) - 1))
        else:
            if shared == 1:
                cute.copy(tma_atom_b, tBgB[None, coord, k, expert], dst, tma_bar_ptr=bar,
                          mcast_mask=cutlass.Int16((1 << self.cfg.cluster_m) - 1))
            else:
                cute.copy(tma_atom_b1, tBgB1[None, coord, k, expert],
                          tBsB1[None, part, 0, stage], tma_bar_ptr=bar)

    def b_part_coord(self, n_tile, part, n_cols):
        """Index (in ``b_part_n`` rows) of weight part ``part`` of n-tile ``n_tile``."""
        return n_tile * self.cfg.b_warps + part

    @cute.jit
    def consume(self, tiled_mma, mC, sA, sB, sC, ring, ctid, sched: TileScheduler, k_tiles,
                group: cutlass.Constexpr):
        """The MMAs and epilogue of the tiles of epilogue group ``group``: every
        tile, or with ``pingpong`` every other tile of the CTA's walk (the
        stages of the other group's tiles are skipped); ``ctid`` the thread's
        index in its group."""
        cfg = self.cfg
        tCrA, tCrB, acc = mma_operands(tiled_mma, sA, sB, ctid, (cfg.tile_m, cfg.tile_n),
                                       self.acc_dtype)

        # epilogue: registers -> shared (stmatrix) -> global (16-byte predicated)
        r2s, tRS_sC, tRS_rAcc, tRS_rD, tRS_rOut = stage_to_shared(
            tiled_mma, acc, sC, ctid, self.c_layout, self.c_dtype, self.acc_dtype)
        s2g = self.make_store_copy()
        thr_s2g = s2g.get_slice(ctid)
        tSsC = thr_s2g.partition_S(sC)
        # sub-tiles (mi, ni) of the output tile; the retiled accumulators hold
        # a thread's values row block by row block (mode 1), each with all of
        # its columns in mode 0, so sub-tile (mi, ni) is chunk mi * chunks_n + ni
        m_subs = cfg.tile_m // self.epi_tile[0]
        n_subs = self.out_tile_n // self.epi_tile[1]
        chunks_n = cfg.tile_n // self.epi_tile[1]
        assert cute.size(tRS_rAcc, mode=[1]) == m_subs and cute.size(tRS_rAcc, mode=[2]) == 1, \
            (tRS_rAcc.layout, self.epi_tile)
        epi_barrier = self.epi_barriers[group]
        # the first tile row of this thread's warpgroup: with both warpgroups
        # on one tile (64 rows each), one whose rows are all past the
        # expert's end skips its MMAs, and the tensor cores run the other's
        # alone: a part-empty last m-tile costs about what its rows need
        wg_row0 = 0
        if cutlass.const_expr(cfg.stage_consumers > 1):
            wg_row0 = cute.arch.make_warp_uniform(ctid // 128) * 64

        read = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.stages)
        release = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.stages)
        lead, total_tiles = sched.lead, sched.total_tiles
        t = sched.first
        turn = cutlass.Int32(0)  # the CTA's tiles so far
        epi_count = cutlass.Int32(0)
        while t - lead < total_tiles:
            expert, row0, seg_end, n_tile = sched.work_tile(cutlass.min(t, total_tiles - 1))
            # rows of this expert in this CTA's tile (<= 0: the spare half of a
            # cluster tile, which still takes its share of the multicast but
            # skips the MMAs: idle tensor cores leave power to clock the others
            # higher)
            rows_valid = self.stored_rows(row0, seg_end, t, total_tiles)
            mma_rows = rows_valid
            run = expert < sched.num_experts
            if cutlass.const_expr(cfg.pair_tiles):
                # every stage the pair's producers fill: the tile missing from
                # a pair stores nothing (stored_rows), the zero tail computes nothing
                if expert >= sched.num_experts:
                    run = t - lead < total_tiles  # true in the loop: run the stages
                    mma_rows = cutlass.Int32(0)
            if turn % self.epi_groups == group:
                if cutlass.const_expr(cfg.pingpong):
                    if turn > 0:
                        self.turn_barriers[group].arrive_and_wait()
                acc.fill(0.0)
                if run:
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.fence()
                    for k in cutlass.range(k_tiles, unroll=1):
                        ring.consumer_wait(read)
                        if mma_rows > wg_row0:
                            mma_stage(tiled_mma, acc, tCrA, tCrB, read.index)
                        warpgroup.commit_group()
                        # keep one k-tile of WGMMA in flight; free the one before it
                        if k > 0:
                            release_stage(ring, release, 1)
                            release.advance()
                        read.advance()
                    release_stage(ring, release, 0)
                    release.advance()
                if cutlass.const_expr(cfg.pingpong):
                    if t + sched.step - lead < total_tiles:  # the other's turn follows
                        self.turn_barriers[1 - group].arrive()

                if cutlass.const_expr(cfg.store_warp):
                    if turn > 0:  # warp 3 has stored the tile before
                        self.tile_barriers[1].arrive_and_wait()
                else:
                    # (tile_m, out_tile_n) of C at (row0, n_tile); its coordinates
                    gC = cute.local_tile(cute.domain_offset((row0, 0), mC),
                                         (cfg.tile_m, self.out_tile_n), (0, n_tile))
                    cC = cute.local_tile(cute.make_identity_tensor(mC.shape),
                                         (cfg.tile_m, self.out_tile_n), (0, n_tile))
                for epi in cutlass.range_constexpr(m_subs * n_subs):
                    mi, ni = divmod(epi, n_subs)
                    # store_warp: the whole tile, sub-tile by sub-tile; otherwise a
                    # sub-tile at a time through two buffers, stored right away
                    buf = epi
                    if cutlass.const_expr(not cfg.store_warp):
                        buf = group * self.epi_stages + epi_count % self.epi_stages
                    self.epilogue_fragment(tRS_rAcc, mi * chunks_n + ni, tRS_rD, tRS_rOut)
                    cute.copy(r2s, tRS_rOut, tRS_sC[None, None, None, buf])
                    if cutlass.const_expr(not cfg.store_warp):
                        epi_barrier.arrive_and_wait()
                        # (epi_m, epi_n) sub-tile of C and of its coordinates
                        tSgC = thr_s2g.partition_D(cute.local_tile(gC, self.epi_tile, (mi, ni)))
                        tScC = thr_s2g.partition_D(cute.local_tile(cC, self.epi_tile, (mi, ni)))
                        for i in cutlass.range_constexpr(cute.size(tSgC, mode=[1])):
                            for j in cutlass.range_constexpr(cute.size(tSgC, mode=[2])):
                                crd = tScC[0, i, j]
                                if crd[0] < rows_valid and crd[1] < mC.shape[1]:
                                    cute.autovec_copy(tSsC[None, i, j, buf], tSgC[None, i, j])
                        epi_count += 1
                if cutlass.const_expr(cfg.store_warp):
                    # stmatrix writes (generic proxy) before the bulk copies' reads
                    cute.arch.fence_proxy("async.shared", space="cta")
                    self.tile_barriers[0].arrive()  # for warp 3 to store
            else:
                if run:
                    # the other warpgroup's tile: its stages are not ours
                    for _ in cutlass.range(k_tiles, unroll=1):
                        read.advance()
                        release.advance()
            turn += 1
            t += sched.step

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

    @cute.jit
    def store_tiles(self, mC: cute.Tensor, sC: cute.Tensor, sched: TileScheduler):
        """``store_warp``, warp 3: each tile of the CTA's walk, once the MMA threads
        have staged it, stored a row per bulk copy (``cp.async.bulk``, lane ``i``
        rows ``i, i + 32, ...``): the expert's rows only, up to N (16-byte
        granules: the output's rows are padded to 16 bytes).  The buffer is
        given back once the copies have read it; the writes complete before the
        warp exits."""
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
            self.tile_barriers[0].arrive_and_wait()  # the tile is in shared memory
            for i in cutlass.range_constexpr(cfg.tile_m // 32):
                r = lane + 32 * i
                if r < rows:
                    cp_async_bulk_global_shared_cta(
                        mC.iterator + cute.crd2idx((row0 + r, n0), mC.layout),
                        sC.iterator + r * self.staged_row, nbytes)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            if t + sched.step - lead < total_tiles:
                self.tile_barriers[1].arrive()  # the buffer is free
            t += sched.step
        cute.arch.cp_async_bulk_wait_group(0)

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


class GroupedGemmSwigluSm90(GroupedGemmSm90):
    """``silu(A @ gate^T) * (A @ up^T)`` per expert, in one pass over the weights.

    ``B`` is the (E, 2I, H) ``gate_up`` weight (gate rows first).  A tile's
    weight stage has two parts loaded by two producer warps under the stage's
    one full barrier: warp 1 the ``tile_n / 2`` gate rows, warp 2 the matching
    up rows ``I`` further on; warp 0 loads the token tile and arms the barrier
    with the bytes of all three.  The MMA warpgroups hold both accumulators
    (gate in the first half of the tile's columns, up in the second), and the
    epilogue applies ``silu(gate) * up`` in fp32 before the single rounding.
    Everything else (schedule, ring, ragged stores) is the base kernel's.
    """

    def __init__(self, config: TileConfig, acc_dtype=cutlass.Float32,
                 prefetch_weights: bool = False):
        if config.b_warps != 2 or not config.multi_warp:
            config = dataclasses.replace(config, b_warps=2, multi_warp=True)
        super().__init__(config, acc_dtype, prefetch_weights)
        self.out_tile_n = config.tile_n // 2

    def b_part_coord(self, n_tile, part, n_cols):
        # part 0: gate rows [n_tile * tile_n/2, ...); part 1: the same rows of up,
        # I = n_cols rows further on (the host checks I % b_part_n == 0)
        return n_tile + part * (n_cols // self.b_part_n)

    @cute.jit
    def epilogue_fragment(self, tRS_rAcc, chunk, tRS_rD, tRS_rOut):
        # gate columns first, then the matching up columns out_tile_n further on
        up = cute.make_rmem_tensor(tRS_rD.shape, self.acc_dtype)
        self.accumulator_chunk(tRS_rAcc, chunk, tRS_rD)
        self.accumulator_chunk(tRS_rAcc, chunk + self.out_tile_n // self.epi_tile[1], up)
        g = tRS_rD.load()
        # silu(g) = g / (1 + e^-g), in fp32
        silu = g * cute.math.rcp(1.0 + cute.math.exp2(g * (-1.4426950408889634)))
        tRS_rOut.store((silu * up.load()).to(self.c_dtype))
