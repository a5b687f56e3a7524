"""K-grouped GEMM for Hopper (sm_90a): the weight gradient of a MoE grouped GEMM.

``out[e] = a[rows of e].T @ dy[rows of e]`` (fp32 accumulation) for every
expert ``e``, the experts splitting the shared token dim ``M`` by ``offs``
(read on the device).  See :class:`GroupedGemmDwSm90` for the design; its
configurations are in :mod:`.grouped_gemm_dw_sm90_config`, its torch entry
point in :mod:`.grouped_gemm_dw_sm90_launch`.
"""

import enum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cp
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

import ts_pipeline

from .grouped_gemm_dw_sm90_config import MAX_EXPERTS, SMEM_CAPACITY, DwConfig
from .sm90_epilogue import (accumulator_chunk, mma_operands, mma_stage, release_stage,
                            stage_to_shared)
from ..common.tile_schedule import KGroupedTileSchedule, KGroupedTileScheduler, RaggedTileSchedule


class Warp(enum.IntEnum):
    """Warp roles of a CTA (``128 * (1 + mma_warpgroups)`` threads)."""

    LOAD_A = 0     # TMA of the a^T tile; the task warp leader (arms each full barrier)
    LOAD_DY = 1    # warps 1 .. dy_warps: TMA of one dy part each
    SCHEDULE = 3   # builds the experts' row-end table in shared memory, then idles
    MMA = 4        # warps 4..: the WGMMA warpgroups, then the epilogue
    EPI_STORE = 4  # the first MMA warp also issues the epilogue's TMA stores


class Barrier(enum.IntEnum):
    """Named barriers among the MMA threads (id 0 is the CTA-wide one)."""

    EPILOGUE = 1   # an epilogue sub-tile is in shared memory; the next one's buffer is free
    TAIL = 2       # the rows past an expert's end are zeroed in the last stage


class GroupedGemmDwSm90:
    """Persistent k-grouped GEMM: ``out[e] (K, N) = a[rows e]^T @ dy[rows e]``.

    In CuTe's terms C (K, N) = A (K, rows) B (N, rows)^T per expert, both
    operands MN-major (K resp. N contiguous in global and shared memory), the
    reduction over the expert's token rows.

    Warp roles (:class:`Warp`; one CTA per SM, ``128 * (1 + tile_m / 64)`` threads):

    - LOAD_A (warp 0): TMA of the a^T tile ``a[r:r+tile_k, m0:m0+tile_m]``; the
      task warp leader: it alone arms each stage's full barrier, with the
      bytes of all the stage's loads.
    - LOAD_DY (warps 1..dy_warps): TMA of ``tile_n / dy_warps`` columns each of
      ``dy[r:r+tile_k, n0:n0+tile_n]``.
    - SCHEDULE (warp 3): ``seg_end = cummax(clamp(offs, 0, M))`` into shared
      memory at start (no host sync), then idles.
    - MMA (warpgroups 1..): WGMMA 64 x tile_n x 16 each (their 64 rows of the
      output tile), fp32 accumulators in registers; then the epilogue,
      ``tile_m x 32`` sub-tiles through shared-memory buffers: registers
      -> stmatrix -> shared memory -> global memory by an asynchronous TMA
      store (below; thread stores lost to it:
      bench/notes/2026-12-04-dw-thread-store-epilogue.md).

    TMA-store epilogue: the output is a 3-D tensor map (K, N, E) over the
    (E, K, N) tensor (row strides any 16-byte multiple), so each box is
    clipped at its expert's K and N edges.  ``B`` buffers (4 of 16-bit, 2 of
    fp32 sub-tiles).  Per sub-tile ``i``: all MMA threads stmatrix into
    buffer ``i % B`` and fence it to the async proxy; the EPI_STORE warp
    waits (``cp.async.bulk.wait_group.read B - 2``) until the store issued
    from buffer ``(i + 1) % B`` has read it; :attr:`Barrier.EPILOGUE`; then
    one thread of EPI_STORE issues the store of buffer ``i % B`` and commits
    its bulk group.  The next sub-tile, and the next tile's stmatrix, write
    only a buffer whose store has been waited for, so after the last
    sub-tile's store the MMA warpgroups go straight on to the next tile's
    WGMMAs while the store drains; EPI_STORE waits for all its stores before
    the CTA exits.

    Schedule: :class:`csrc_free_kernels.common.tile_schedule.KGroupedTileSchedule`
    (``E * m_tiles * n_tiles`` output tiles in raster bands of ``band_n``
    n-tiles, a ``KWorkTile`` per step; the experts' row ends built by the
    SCHEDULE warp from ``offs`` in shared memory).

    Pipeline: LOAD_A + LOAD_DY -> MMA, ``ts_pipeline.TSPipelineTmaAsync``,
    ``stages`` stages of ``(tile_m + tile_n) * tile_k * 2`` bytes (one a^T
    tile plus ``dy_warps`` dy parts), one full-barrier arrival (the leader's),
    one empty-barrier arrival per MMA warp.

    Rows: a tile's chunks start at the expert's first row, at any alignment;
    the last chunk may run past the expert's end into the next expert (or
    past M: zero-filled by the TMA).  After that chunk's full barrier the MMA
    threads zero its rows past the end in both operand tiles, fence them to
    the async proxy and meet at :attr:`Barrier.TAIL` before the WGMMA reads
    the stage.  A tile without rows skips the mainloop and stores zeros.

    Deterministic: each output tile is owned by one CTA, its rows
    reduced in order; no atomics.
    """

    producer_regs = 40

    def __init__(self, config: DwConfig, acc_dtype=cutlass.Float32):
        self.cfg = config
        self.acc_dtype = acc_dtype
        self.num_mma_warpgroups = config.mma_warpgroups
        self.num_mma_threads = 128 * self.num_mma_warpgroups
        self.threads = 32 * Warp.MMA + self.num_mma_threads
        self.mma_regs = 232 if self.num_mma_warpgroups == 2 else 240
        self.dy_part_n = config.tile_n // max(config.dy_warps, 1)
        # epilogue sub-tiles: all tile_m rows by 32 columns, in epi_buffers(c_bits)
        # shared-memory buffers (set for the output dtype in _plan_smem)
        self.epi_n = 32
        self.epi_barrier = cp.NamedBarrier(barrier_id=Barrier.EPILOGUE,
                                           num_threads=self.num_mma_threads)
        self.tail_barrier = cp.NamedBarrier(barrier_id=Barrier.TAIL,
                                            num_threads=self.num_mma_threads)
        self.schedule = KGroupedTileSchedule(tile_m=config.tile_m, tile_n=config.tile_n,
                                             band_n=config.band_n, max_experts=MAX_EXPERTS)
        self._validate_config()

    @property
    def full_arrivals(self) -> int:
        """Arrivals per stage on a full barrier: the task warp leader's expect_tx."""
        return 1

    @property
    def empty_arrivals(self) -> int:
        """Arrivals per stage on an empty barrier: one per MMA warp."""
        return self.num_mma_threads // 32

    def _validate_config(self):
        """What the configuration alone decides (shared memory: :meth:`stage_count`
        here, the real storage at trace time in :meth:`_validate_smem`)."""
        cfg = self.cfg
        if cfg.tile_m not in (64, 128):
            raise ValueError(f"{cfg}: tile_m must be 64 or 128 (one or two MMA warpgroups)")
        if cfg.tile_n % 64 or not 64 <= cfg.tile_n <= 256:
            raise ValueError(f"{cfg}: tile_n must be a multiple of 64 up to 256 (one WGMMA)")
        if cfg.tile_k % 16 or cfg.tile_k < 16:
            raise ValueError(f"{cfg}: tile_k must be a multiple of 16 (WGMMA k)")
        if not 1 <= cfg.dy_warps <= Warp.SCHEDULE - Warp.LOAD_DY:
            raise ValueError(f"{cfg}: dy_warps must be 1..{Warp.SCHEDULE - Warp.LOAD_DY} "
                             f"(warps {Warp.LOAD_DY}..{Warp.SCHEDULE - 1})")
        if cfg.tile_n % (64 * cfg.dy_warps):
            raise ValueError(f"{cfg}: each dy part ({cfg.tile_n}/{cfg.dy_warps} columns) must "
                             f"be whole 64-column swizzle atoms")
        if cfg.band_n < 1:
            raise ValueError(f"{cfg}: band_n must be >= 1")
        if not (Warp.MMA <= Warp.EPI_STORE < Warp.MMA + 4 * self.num_mma_warpgroups):
            raise ValueError(f"{cfg}: the TMA-store warp {int(Warp.EPI_STORE)} must be an MMA "
                             f"warp (it meets the others at the EPILOGUE barrier)")
        # warp counts: the producer roles fit below the MMA warps; arrival counts:
        # every MMA warp releases each stage it read, and nothing else does
        if Warp.LOAD_DY + cfg.dy_warps > Warp.SCHEDULE or self.threads > 1024:
            raise ValueError(f"{cfg}: {self.threads} threads, dy warps {cfg.dy_warps}")
        if self.empty_arrivals != 4 * self.num_mma_warpgroups or self.full_arrivals != 1:
            raise ValueError(f"{cfg}: arrival counts {self.full_arrivals}/{self.empty_arrivals}")
        if (32 * Warp.MMA * self.producer_regs
                + self.num_mma_threads * self.mma_regs) > 65536:
            raise ValueError(f"{cfg}: the register split exceeds the register file")

    # ---------------------------------------------------------------- host
    def _setup(self, ab_dtype, c_dtype):
        """Layouts, MMA and the stage count for these dtypes."""
        cfg = self.cfg
        self._plan_smem(ab_dtype, c_dtype)
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            ab_dtype, ab_dtype, self.mn_major.sm90_mma_major_mode(),
            self.mn_major.sm90_mma_major_mode(), self.acc_dtype,
            (self.num_mma_warpgroups, 1, 1), tiler_mn=(64, cfg.tile_n))

    # a^T (K, rows) is M-major, dy^T (N, rows) N-major: COL_MAJOR in CuTe's terms
    mn_major = LayoutEnum.COL_MAJOR
    c_layout = LayoutEnum.ROW_MAJOR

    epi_bytes = 32 * 1024  # the TMA store's buffers: 2 of fp32, 4 of 16-bit sub-tiles

    def epi_buffers(self, c_bits: int) -> int:
        """Epilogue buffers: as many as fit in :attr:`epi_bytes` (at least 2), so
        a TMA store has ``buffers - 1`` sub-tiles' time to read its buffer before
        that is written again."""
        return max(2, self.epi_bytes // (self.cfg.tile_m * self.epi_n * c_bits // 8))

    def stage_count(self, ab_bits: int, c_bits: int) -> int:
        """As many stages as fit, up to the config's: the tiles (1 KB multiples,
        first in shared memory, so unpadded), the epilogue buffers, the
        row-end table and the barriers.  Plain Python (the CPU tests call it);
        the kernel checks its real shared storage at trace time."""
        cfg = self.cfg
        fixed = (self.epi_buffers(c_bits) * cfg.tile_m * self.epi_n * c_bits // 8
                 + 4 * MAX_EXPERTS + 16 * cfg.stages)
        stage_bytes = (cfg.tile_m + cfg.tile_n) * cfg.tile_k * ab_bits // 8
        stages = min(cfg.stages, (SMEM_CAPACITY - fixed) // stage_bytes)
        if stages < 2:
            raise ValueError(f"{cfg} leaves room for {stages} stages")
        return stages

    def _plan_smem(self, ab_dtype, c_dtype):
        """The shared-memory layouts and the stage count."""
        cfg = self.cfg
        if ab_dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"operands must be bf16 or fp16, got {ab_dtype}")
        self.ab_dtype, self.c_dtype = ab_dtype, c_dtype
        tile_mnk = (cfg.tile_m, cfg.tile_n, cfg.tile_k)
        self.epi_tile = (cfg.tile_m, self.epi_n)
        self.epi_stages = self.epi_buffers(c_dtype.width)
        self.epi_smem_layout = sm90_utils.make_smem_layout_epi(
            c_dtype, self.c_layout, self.epi_tile, self.epi_stages)
        if (self.epi_n * c_dtype.width // 8) % 16:
            raise ValueError(f"{cfg}: a TMA box row of {self.epi_n} {c_dtype} is not a "
                             f"16-byte multiple")
        self.stage_bytes = (cfg.tile_m + cfg.tile_n) * cfg.tile_k * ab_dtype.width // 8
        self.stages = self.stage_count(ab_dtype.width, c_dtype.width)
        self.a_smem_layout = sm90_utils.make_smem_layout_a(self.mn_major, tile_mnk, ab_dtype,
                                                           self.stages)
        self.b_smem_layout = sm90_utils.make_smem_layout_b(self.mn_major, tile_mnk, ab_dtype,
                                                           self.stages)
        self.a_stage_layout = cute.slice_(self.a_smem_layout, (None, None, 0))
        # one dy part of one stage: (dy_part_n, tile_k), whole swizzle atoms of the tile
        self.dy_part_layout = cute.slice_(sm90_utils.make_smem_layout_b(
            self.mn_major, (cfg.tile_m, self.dy_part_n, cfg.tile_k), ab_dtype, 1),
            (None, None, 0))

    def _validate_smem(self, storage_bytes: int):
        if storage_bytes > SMEM_CAPACITY:
            raise ValueError(f"{self.cfg}: {storage_bytes} bytes of shared memory with "
                             f"{self.stages} stages, over {SMEM_CAPACITY}")

    @cute.jit
    def __call__(self, mA_mk: cute.Tensor, mDy_mn: cute.Tensor, mOut_ekn: cute.Tensor,
                 mOffs: cute.Tensor, num_ctas: cutlass.Int32, stream):
        """mA_mk (M, K), mDy_mn (M, N), mOut_ekn (E, K, N) as torch lays them out, mOffs (E,)."""
        self._setup(mA_mk.element_type, mOut_ekn.element_type)
        cfg = self.cfg
        # CuTe's GEMM convention: A (K, M), B (N, M), C (K, N, E)
        mA = cute.make_tensor(mA_mk.iterator, cute.select(mA_mk.layout, mode=[1, 0]))
        mB = cute.make_tensor(mDy_mn.iterator, cute.select(mDy_mn.layout, mode=[1, 0]))
        mC = cute.make_tensor(mOut_ekn.iterator, cute.select(mOut_ekn.layout, mode=[1, 2, 0]))
        tma_atom_a, mA_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mA, self.a_stage_layout,
            (cfg.tile_m, cfg.tile_k))
        tma_atom_b, mB_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mB, self.dy_part_layout,
            (self.dy_part_n, cfg.tile_k))
        # the TMA store: boxes of one epilogue buffer, (K, N, E) clipped per expert
        tma_atom_c, mC_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC,
            cute.slice_(self.epi_smem_layout, (None, None, 0)), self.epi_tile)

        @cute.struct
        class SharedStorage:
            sA: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_layout)], 1024]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_layout)], 1024]
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_layout)], 1024]
            ring_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            seg_end: cute.struct.MemRange[cutlass.Int32, self.schedule.max_experts]

        self._validate_smem(SharedStorage.size_in_bytes())
        self.shared_storage = SharedStorage
        self.kernel(tma_atom_a, mA_tma, tma_atom_b, mB_tma, tma_atom_c, mC_tma, mC, mOffs,
                    self.tiled_mma,
                    self.a_smem_layout, self.b_smem_layout, self.epi_smem_layout,
                    ).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1),
                             min_blocks_per_mp=1, stream=stream)

    # -------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA: cute.Tensor, tma_atom_b: cute.CopyAtom,
               mB: cute.Tensor, tma_atom_c, mC_tma, mC: cute.Tensor, mOffs: cute.Tensor,
               tiled_mma: cute.TiledMma, a_smem_layout: cute.ComposedLayout,
               b_smem_layout: cute.ComposedLayout, epi_smem_layout: cute.ComposedLayout):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == Warp.LOAD_A:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            cpasync.prefetch_descriptor(tma_atom_c)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        k_rows, n_cols, num_experts = mC.shape
        m_rows = mA.shape[1]
        sched = KGroupedTileScheduler.create(self.schedule, bidx, grid).bind(
            storage, num_experts, k_rows, n_cols)
        if warp_idx == Warp.SCHEDULE:
            sched.build(mOffs, m_rows)
        cute.arch.sync_threads()  # the table, for every role

        ring = ts_pipeline.TSPipelineTmaAsync.create(
            num_stages=self.stages,
            producer_group=cp.CooperativeGroup(cp.Agent.Thread, self.full_arrivals),
            consumer_group=cp.CooperativeGroup(cp.Agent.Thread, self.empty_arrivals),
            tx_count=self.stage_bytes,
            barrier_storage=storage.ring_barriers.data_ptr(),
            is_task_warp_leader=warp_idx == Warp.LOAD_A)  # syncs the CTA

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sC = storage.sC.get_tensor(epi_smem_layout.outer, swizzle=epi_smem_layout.inner)

        if warp_idx < Warp.MMA:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx <= Warp.LOAD_DY + cfg.dy_warps - 1:
                self.produce(tma_atom_a, mA, tma_atom_b, mB, sA, sB, ring, warp_idx, sched)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume(tiled_mma, tma_atom_c, mC_tma, mC, sA, sB, sC, ring,
                         tidx - 32 * Warp.MMA, warp_idx == Warp.EPI_STORE, sched)

    @cute.jit
    def produce(self, tma_atom_a, mA, tma_atom_b, mB, sA, sB, ring, warp_idx,
                sched: KGroupedTileScheduler):
        """Every producer warp walks the same tiles and chunks; LOAD_A loads a^T
        and arms the barrier, LOAD_DY + p dy part p."""
        cfg = self.cfg
        # (dy_part_n, tile_k, dy_warps, 1, stages): the dy parts of each stage
        sB_parts = cute.flat_divide(sB, (self.dy_part_n, cfg.tile_k))
        state = cp.make_pipeline_state(cp.PipelineUserType.Producer, self.stages)
        t = sched.first
        while t < sched.total_tiles:
            tile = sched.work_tile(t)
            chunks = RaggedTileSchedule.ceil_div(tile.row_end - tile.row_start, cfg.tile_k)
            # (tile_m, tile_k, chunks) of a^T and (dy_part_n, tile_k, N parts, chunks) of
            # dy^T from the expert's first row (any alignment: TMA coordinates)
            gA = cute.local_tile(cute.domain_offset((0, tile.row_start), mA),
                                 (cfg.tile_m, cfg.tile_k), (tile.m_tile, None))
            gB = cute.local_tile(cute.domain_offset((0, tile.row_start), mB),
                                 (self.dy_part_n, cfg.tile_k), (None, None))
            tAsA, tAgA = cpasync.tma_partition(
                tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
                cute.group_modes(gA, 0, 2))
            tBsB, tBgB = cpasync.tma_partition(
                tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB_parts, 0, 2),
                cute.group_modes(gB, 0, 2))
            part = warp_idx - Warp.LOAD_DY
            for j in cutlass.range(chunks, unroll=1):
                ring.producer_acquire(state)
                bar = ring.producer_get_barrier(state)
                if warp_idx == Warp.LOAD_A:
                    cute.copy(tma_atom_a, tAgA[None, j], tAsA[None, state.index],
                              tma_bar_ptr=bar)
                else:
                    cute.copy(tma_atom_b, tBgB[None, tile.n_tile * cfg.dy_warps + part, j],
                              tBsB[None, part, 0, state.index], tma_bar_ptr=bar)
                state.advance()
            t += sched.step
        ring.producer_tail(state)

    @cute.jit
    def zero_tail(self, sA_stage, sB_stage, valid, ctid):
        """Zero token rows ``valid .. tile_k - 1`` of one stage's a^T and dy tiles
        (through their swizzled layouts), fence the writes to the async proxy
        and meet the other MMA threads: the WGMMA then reads zeros there."""
        zero = cute.make_rmem_tensor(cute.make_layout(8), self.ab_dtype)
        zero.fill(0.0)
        dead = self.cfg.tile_k - valid
        # 8-element pieces of a token row: 16 contiguous bytes, also when swizzled
        for tile in (sA_stage, sB_stage):
            pieces = cute.zipped_divide(tile, (8, 1))  # ((8, 1), (cols / 8, tile_k))
            per_row = cute.size(pieces, mode=[1, 0])
            for i in cutlass.range(ctid, dead * per_row, self.num_mma_threads, unroll=1):
                piece = pieces[(None, 0), (i % per_row, valid + i // per_row)]
                cute.autovec_copy(zero, piece)
        cute.arch.fence_proxy("async.shared", space="cta")
        self.tail_barrier.arrive_and_wait()

    @cute.jit
    def consume(self, tiled_mma, tma_atom_c, mC_tma, mC, sA, sB, sC, ring, ctid, epi_store_warp,
                sched: KGroupedTileScheduler):
        """The MMAs and epilogue of every tile of the CTA's walk; ``ctid`` the
        thread's index among the MMA threads, ``epi_store_warp`` whether its warp
        is EPI_STORE."""
        cfg = self.cfg
        tCrA, tCrB, acc = mma_operands(tiled_mma, sA, sB, ctid, (cfg.tile_m, cfg.tile_n),
                                       self.acc_dtype)

        # epilogue: registers -> shared (stmatrix) -> global (TMA store)
        r2s, tRS_sC, tRS_rAcc, tRS_rD, tRS_rOut = stage_to_shared(
            tiled_mma, acc, sC, ctid, self.c_layout, self.c_dtype, self.acc_dtype)
        num_epi = cfg.tile_n // self.epi_tile[1]
        # the epilogue buffers as TMA sources: (box, epi_stages)
        sC_boxes = cute.group_modes(sC, 0, 2)

        read = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.stages)
        release = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.stages)
        epi_count = cutlass.Int32(0)
        t = sched.first
        while t < sched.total_tiles:
            tile = sched.work_tile(t)
            rows = tile.row_end - tile.row_start
            chunks = RaggedTileSchedule.ceil_div(rows, cfg.tile_k)
            # token rows of the expert in its last chunk, 1..tile_k
            last_rows = rows - (chunks - 1) * cfg.tile_k
            acc.fill(0.0)
            if chunks > 0:
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                for j in cutlass.range(chunks, unroll=1):
                    ring.consumer_wait(read)
                    if j == chunks - 1 and last_rows < cfg.tile_k:
                        self.zero_tail(sA[None, None, read.index], sB[None, None, read.index],
                                       last_rows, ctid)
                    warpgroup.fence()  # the accumulators, once per chunk
                    mma_stage(tiled_mma, acc, tCrA, tCrB, read.index)
                    warpgroup.commit_group()
                    # keep one chunk of WGMMA in flight; free the one before it
                    if j > 0:
                        release_stage(ring, release, 1)
                        release.advance()
                    read.advance()
                release_stage(ring, release, 0)
                release.advance()

            # (box, num_epi): the tile's sub-tiles of the output's tensor map
            gC_boxes = cute.local_tile(mC_tma[None, None, tile.expert],
                                       (cfg.tile_m, cfg.tile_n), (tile.m_tile, tile.n_tile))
            tTsC, tTgC = cpasync.tma_partition(
                tma_atom_c, 0, cute.make_layout(1), sC_boxes,
                cute.group_modes(cute.local_tile(gC_boxes, self.epi_tile, (0, None)), 0, 2))
            for epi in cutlass.range_constexpr(num_epi):
                buf = epi_count % self.epi_stages
                accumulator_chunk(tRS_rAcc, epi, tRS_rD)
                tRS_rOut.store(tRS_rD.load().to(self.c_dtype))
                cute.copy(r2s, tRS_rOut, tRS_sC[None, None, None, buf])
                # the stmatrix writes, for the TMA (async proxy) to read
                cute.arch.fence_proxy("async.shared", space="cta")
                if epi_store_warp:
                    # the store from the buffer the next sub-tile (or tile)
                    # writes, epi_stages - 1 sub-tiles ago, has read it: the
                    # later ones may still be pending
                    cute.arch.cp_async_bulk_wait_group(self.epi_stages - 2, read=True)
                self.epi_barrier.arrive_and_wait()
                if epi_store_warp:
                    # one lane issues and commits (this DSL's S2G copy elects
                    # no lane of its own: the PTX test checks it)
                    with cute.arch.elect_one():
                        cute.copy(tma_atom_c, tTsC[None, buf], tTgC[None, epi])
                        cute.arch.cp_async_bulk_commit_group()
                epi_count += 1
            t += sched.step
        if epi_store_warp:
            # every store done before the CTA (and its shared memory) goes
            cute.arch.cp_async_bulk_wait_group(0)
