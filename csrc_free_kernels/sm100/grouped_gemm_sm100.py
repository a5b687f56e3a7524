"""Ragged grouped GEMM for Blackwell (sm_100a): tcgen05 MMA on 2-CTA pairs, gathered token rows.

**Compile- and schedule-verified only.**  No Blackwell GPU was available to this project:
this kernel has never run.  CI compiles every configuration for sm_100a, checks its PTX
(``tests/test_grouped_gemm_sm100_ptx.py``, the pre-flight's tcgen05 rules) and model-checks
its barrier protocol (``tests/test_sm100_protocol.py``); nothing here is a measured result.
``ts_moe`` runs it only on an explicit opt-in.

Same op semantics as the Hopper kernel (``grouped_gemm_sm90``): ``offs`` read on the
device, zeros past ``offs[-1]``, K and N tails, both weight layouts, plus a row index
(``a_index``) through which the token rows are gathered.  Configurations:
:mod:`.grouped_gemm_sm100_config`; the torch entry point: :mod:`.grouped_gemm_sm100_launch`.
"""

import enum
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cp
import cutlass.utils as cutlass_utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import cpasync, tcgen05

import ts_pipeline

from . import tcgen05_fence
from .grouped_gemm_sm100_config import MAX_EXPERTS, TileConfigSm100
from ..common.tile_schedule import RaggedTileSchedule, TileScheduler

CTA_ROWS = 128          # token rows of one CTA; the pair's MMA tile is 256 rows
SMEM_CAPACITY = 227 * 1024
TMEM_COLUMNS = 512


class Warp(enum.IntEnum):
    """Warp roles of a CTA (``THREADS`` = 10 warps)."""

    EPILOGUE = 0     # warps 0-3: TMEM -> registers -> global, 128 rows of the CTA
    MMA = 4          # the pair's MMA issuer (acts in the leader CTA only)
    LOAD_B = 5       # TMA producer of this CTA's half of the weight tile
    GATHER = 6       # warps 6-9: one token row per thread, cp.async into the A stage
    SCHEDULE = 5     # the weight producer also builds the tile schedule first


EPILOGUE_WARPS = 4
GATHER_WARPS = 4
LEADER_CTA = 0   # the pair's CTA whose MMA warp issues the pair's MMAs
THREADS = 32 * (Warp.GATHER + GATHER_WARPS)


@dataclass(frozen=True)
class Protocol:
    """Arrival counts of the kernel's mbarriers, per stage: the pipelines are built
    from these, and ``tests/sm100_protocol_model.py`` model-checks them.  The
    full barriers that matter are the leader CTA's: the MMA waits only there."""

    a_full: int = 2 * 32 * GATHER_WARPS   # every gather thread of both CTAs
    a_empty: int = 1                      # the MMA's tcgen05.commit, multicast to the pair
    b_full: int = 1                       # the leader's expect_tx (both halves' bytes)
    b_empty: int = 1                      # tcgen05.commit, multicast
    acc_full: int = 1                     # tcgen05.commit, multicast
    acc_empty: int = 2 * EPILOGUE_WARPS   # one elected thread per epilogue warp of both CTAs


PROTOCOL = Protocol()


class Barrier(enum.IntEnum):
    """Named barriers (id 0 is the CTA-wide one)."""

    TMEM_ALLOC = 1   # epilogue warps + the MMA warp: the TMEM address is published
    EPILOGUE = 2     # the epilogue warps: TMEM may be freed


class GroupedGemmSm100:
    """Persistent ragged grouped GEMM on CTA pairs, ``C[rows of e] = A[rows of e] @ B[e]``.

    A cluster is a CTA pair running 2-CTA tcgen05 MMAs (``CtaGroup.TWO``) on
    256-row tiles of one expert: CTA ``v`` owns rows ``128 v .. 128 v + 127``
    of the tile and holds half of the weight tile's columns; each CTA's
    accumulator (its 128 rows x ``tile_n``) lives in its own tensor memory.

    Warp roles (:class:`Warp`, 320 threads per CTA):

    - GATHER (warps 6-9, 128 threads): thread ``t`` owns row ``t`` of the CTA's
      part of the tile; it reads its token row's index once per tile (``a_index``
      when gathering, else the row itself) and copies the row's ``tile_k``
      columns of each k-tile with 16-byte ``cp.async`` into the swizzled A
      stage, writing zeros past K (K is a multiple of 8: whole 16-byte chunks).
      It waits for its own copies, fences them to the async proxy and commits
      to the *leader* CTA's full barrier (``TSPipelineAsyncUmma``,
      ``AsyncThread``: one ``mbarrier.arrive...shared::cluster`` per thread on
      the barrier address with the peer bit cleared).
    - LOAD_B (warp 5): first builds the tile schedule in shared memory (as
      warp 3 does on Hopper), then loads this CTA's half of each weight k-tile
      by TMA (``cta_group::2``: the bytes land in this CTA, the transaction
      counts on the leader's barrier, which the leader arms once per stage with
      both halves' bytes; ``PipelineTmaUmma``).
    - MMA (warp 4, leader CTA only): per tile, acquires an accumulator stage,
      then per k-tile waits on both full barriers (tokens and weights), issues
      the k-blocks' ``tcgen05.mma.cta_group::2`` and releases both stages by
      ``tcgen05.commit`` to the pair's empty barriers; finally commits the
      accumulator stage to both CTAs' epilogues (``PipelineUmmaAsync``).
    - EPILOGUE (warps 0-3, 128 threads): thread ``t`` reads TMEM lane ``t``
      (its row) 32 columns at a time (``tcgen05.ld 32x32b.x32``), converts
      (SwiGLU: ``silu(gate) * up`` in fp32 first) and stores 16-byte vectors
      of rows inside the expert, zeros for a gathered row whose index is out
      of range; then releases the accumulator stage.

    Pipelines (producer -> consumer), per CTA and stage:

    - tokens: GATHER (both CTAs, 256 arrivals) -> MMA, ``stages`` x
      ``128 x tile_k x 2`` bytes (16 KB at tile_k 64);
    - weights: LOAD_B (TMA, one armed arrival) -> MMA, ``stages`` x
      ``tile_n / 2 x tile_k x 2`` bytes (16 KB for n256);
    - accumulators: MMA -> EPILOGUE (both CTAs, 8 warps), 2 stages of
      ``tile_n`` TMEM columns.

    The barrier protocol, arrival counts and phases are written out in
    ``csrc_free_kernels/sm100/sm100_protocol.md`` and model-checked in CI.
    """

    def __init__(self, config: TileConfigSm100, *, gather: bool, b_n_major: bool,
                 swiglu: bool = False, acc_dtype=cutlass.Float32):
        if config.tile_n not in (128, 256) or config.tile_k % 64:
            raise ValueError(f"tile_n must be 128 or 256 and tile_k a multiple of 64: {config}")
        self.cfg = config
        self.gather = gather
        self.b_n_major = b_n_major
        self.swiglu = swiglu
        self.acc_dtype = acc_dtype
        self.mma_tiler = (2 * CTA_ROWS, config.tile_n, config.tile_k)
        self.out_tile_n = config.tile_n // 2 if swiglu else config.tile_n
        self.acc_stages = 2
        if self.acc_stages * config.tile_n > TMEM_COLUMNS:
            raise ValueError(f"{config}: {self.acc_stages} accumulators of {config.tile_n} "
                             f"columns exceed {TMEM_COLUMNS} TMEM columns")
        self.epi_cols = 32  # columns per tcgen05.ld (32x32b.x32)
        self.schedule = RaggedTileSchedule(cta_rows=CTA_ROWS, cluster_m=2,
                                           band_m=config.band_m, max_experts=MAX_EXPERTS)

    # ---------------------------------------------------------------- host
    def _setup(self, a_dtype, c_dtype, b_k_major: bool):
        cfg = self.cfg
        self.a_dtype, self.c_dtype = a_dtype, c_dtype
        b_major = tcgen05.OperandMajorMode.K if b_k_major else tcgen05.OperandMajorMode.MN
        self.tiled_mma = sm100_utils.make_trivial_tiled_mma(
            a_dtype, a_dtype, tcgen05.OperandMajorMode.K, b_major,
            self.acc_dtype, tcgen05.CtaGroup.TWO, self.mma_tiler[:2])
        self.cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((2, 1, 1)),
                                                     (self.tiled_mma.thr_id.shape,))
        a_bytes = CTA_ROWS * cfg.tile_k * a_dtype.width // 8
        b_bytes = cfg.tile_n // 2 * cfg.tile_k * a_dtype.width // 8
        self.b_tx_bytes = 2 * b_bytes  # both halves count on the leader's barrier
        fixed = 8 * self.schedule.table_words + 2048
        self.stages = min(cfg.stages, (SMEM_CAPACITY - fixed) // (a_bytes + b_bytes))
        if self.stages < 2:
            raise ValueError(f"{cfg} leaves room for {self.stages} stages")
        self.a_smem_layout = sm100_utils.make_smem_layout_a(
            self.tiled_mma, self.mma_tiler, a_dtype, self.stages)
        self.b_smem_layout = sm100_utils.make_smem_layout_b(
            self.tiled_mma, self.mma_tiler, a_dtype, self.stages)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB_ekn: cute.Tensor, mC: cute.Tensor,
                 mOffs: cute.Tensor, mIndex: cute.Tensor, num_ctas: cutlass.Int32, stream):
        """mA (M, K) K-major; mB_ekn (E, K, N) as torch lays it out; mC (M', N') with
        M' = len(mIndex) when gathering, else M (mIndex then unused); mOffs (E,)."""
        # (N, K, E): CuTe's B convention
        mB = cute.make_tensor(mB_ekn.iterator, cute.select(mB_ekn.layout, mode=[2, 1, 0]))
        if cutlass.const_expr(self.swiglu):
            mB = self._gate_up_view(mB)
        # weights (N, K, E) K-major where K is the unit-stride mode
        self._setup(mA.element_type, mC.element_type, not self.b_n_major)
        b_smem_one = cute.slice_(self.b_smem_layout, (None, None, None, 0))
        tma_atom_b, mB_tma = cute.nvgpu.make_tiled_tma_atom_B(
            cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.TWO), mB, b_smem_one,
            self.mma_tiler, self.tiled_mma, self.cluster_layout_vmnk.shape)

        @cute.struct
        class SharedStorage:
            a_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            b_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            acc_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.acc_stages]
            tmem_dealloc: cutlass.Int64
            tmem_address: cutlass.Int32
            seg_end: cute.struct.MemRange[cutlass.Int32, self.schedule.table_words]
            tile_end: cute.struct.MemRange[cutlass.Int32, self.schedule.table_words]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_layout)], 1024]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.b_smem_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(mA, tma_atom_b, mB_tma, mC, mOffs, mIndex, self.tiled_mma,
                    self.cluster_layout_vmnk, self.a_smem_layout, self.b_smem_layout,
                    ).launch(grid=(num_ctas, 1, 1), block=(THREADS, 1, 1), cluster=(2, 1, 1),
                             min_blocks_per_mp=1, stream=stream)

    def _gate_up_view(self, mB: cute.Tensor) -> cute.Tensor:
        """The (2I, H) gate/up weight as N columns where each ``tile_n`` block is
        ``tile_n / 2`` gate rows then the matching up rows: the pair's CTA 0
        holds the gate half, CTA 1 the up half (the host checks I % (tile_n / 2))."""
        half = self.cfg.tile_n // 2
        (n, k, e) = mB.shape
        (s_n, s_k, s_e) = mB.stride
        inter = n // 2
        layout = cute.make_layout(((half, 2, inter // half), k, e),
                                  stride=((s_n, inter * s_n, half * s_n), s_k, s_e))
        return cute.make_tensor(mB.iterator, layout)

    # -------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mA: cute.Tensor, tma_atom_b: cute.CopyAtom, mB: cute.Tensor,
               mC: cute.Tensor, mOffs: cute.Tensor, mIndex: cute.Tensor,
               tiled_mma: cute.TiledMma, cluster_layout_vmnk: cute.Layout,
               a_smem_layout: cute.ComposedLayout, b_smem_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        is_leader = cta_rank == LEADER_CTA
        sched = TileScheduler.create(self.schedule, cta_rank, bidx, grid)
        if warp_idx == Warp.LOAD_B:
            cpasync.prefetch_descriptor(tma_atom_b)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        m_rows, n_cols = mC.shape
        sched = sched.bind(storage, mOffs.shape[0], n_cols, self.out_tile_n)
        k_tiles = (mA.shape[1] + self.cfg.tile_k - 1) // self.cfg.tile_k

        a_pipe, b_pipe, acc_pipe = self.make_pipelines(storage, cluster_layout_vmnk)
        # its dealloc barrier, which the peer CTA arrives on, initialised and fenced before
        # the cluster barrier below, like the pipelines' (PTX ISA, fence.mbarrier_init)
        tmem = cutlass_utils.TmemAllocator(
            storage.tmem_address.ptr,
            barrier_for_retrieve=cp.NamedBarrier(
                barrier_id=Barrier.TMEM_ALLOC, num_threads=32 * (EPILOGUE_WARPS + 1)),
            allocator_warp_id=Warp.EPILOGUE, is_two_cta=True,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc.ptr)
        if warp_idx == Warp.SCHEDULE:
            sched.build(mOffs, m_rows)
        cute.arch.sync_threads()  # the schedule, for every role
        # the barrier inits, for both CTAs of the pair
        cp.pipeline_init_arrive(cluster_shape_mn=cluster_layout_vmnk, is_relaxed=True)
        cp.pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)
        sched = sched.with_total()

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.acc_stages))

        if warp_idx >= Warp.GATHER:
            load = self.a_load_layout()  # the same bytes as sA, as (row, k, stage)
            self.gather_tokens(mA, mIndex, storage.sA.get_tensor(load.outer, swizzle=load.inner),
                               a_pipe, tidx - 32 * Warp.GATHER, sched, k_tiles)
        elif warp_idx == Warp.LOAD_B:
            self.load_weights(tma_atom_b, mB, sB, b_pipe, tiled_mma,
                              sched, k_tiles)
        elif warp_idx == Warp.MMA:
            tmem.wait_for_alloc()
            tCtAcc = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), tCtAcc_fake.layout)
            if is_leader:
                self.mma(tiled_mma, sA, sB, tCtAcc, a_pipe, b_pipe, acc_pipe, sched, k_tiles)
        else:
            tmem.allocate(TMEM_COLUMNS)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc = cute.make_tensor(tmem_ptr, tCtAcc_fake.layout)
            self.epilogue(tCtAcc, mC, acc_pipe, tidx, sched)
            cp.NamedBarrier(barrier_id=Barrier.EPILOGUE,
                            num_threads=32 * EPILOGUE_WARPS).arrive_and_wait()
            tmem.relinquish_alloc_permit()
            tmem.free(tmem_ptr)

    def make_pipelines(self, storage, cluster_layout_vmnk):
        """The three pipelines of the class docstring (inits fenced; the caller
        syncs the cluster once for all of them and the schedule)."""
        counts = PROTOCOL
        a_pipe = ts_pipeline.TSPipelineAsyncUmma.create(
            num_stages=self.stages,
            producer_group=cp.CooperativeGroup(cp.Agent.Thread, counts.a_full),
            consumer_group=cp.CooperativeGroup(cp.Agent.Thread, counts.a_empty),
            barrier_storage=storage.a_barriers.data_ptr(),
            cta_layout_vmnk=cluster_layout_vmnk,
            producer_op=cp.PipelineOp.AsyncThread,
            defer_sync=True)
        b_pipe = cp.PipelineTmaUmma.create(
            num_stages=self.stages,
            producer_group=cp.CooperativeGroup(cp.Agent.Thread, counts.b_full),
            consumer_group=cp.CooperativeGroup(cp.Agent.Thread, counts.b_empty),
            tx_count=self.b_tx_bytes,
            barrier_storage=storage.b_barriers.data_ptr(),
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True)
        acc_pipe = cp.PipelineUmmaAsync.create(
            num_stages=self.acc_stages,
            producer_group=cp.CooperativeGroup(cp.Agent.Thread, counts.acc_full),
            consumer_group=cp.CooperativeGroup(cp.Agent.Thread, counts.acc_empty),
            barrier_storage=storage.acc_barriers.data_ptr(),
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True)
        cute.arch.mbarrier_init_fence()
        return a_pipe, b_pipe, acc_pipe

    def a_load_layout(self):
        """The A stages as (128 rows, tile_k, stages): the swizzle atom the MMA's
        layout is tiled from, tiled in (row, k, stage) order, so it addresses the
        bytes the MMA reads (tests/test_grouped_gemm_sm100_ptx.py compares the two)."""
        shape = (CTA_ROWS, self.cfg.tile_k)
        atom = sm100_utils.make_smem_layout_atom(
            sm100_utils.get_smem_layout_atom_ab(tcgen05.OperandMajorMode.K, self.a_dtype, shape),
            self.a_dtype)
        return cute.tile_to_shape(atom, (*shape, self.stages), order=(0, 1, 2))

    def make_gather_copy(self):
        """cp.async of 16 bytes; thread t of the GATHER warps copies row t."""
        chunk = 128 // self.a_dtype.width
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.a_dtype, num_bits_per_copy=128)
        return cute.make_tiled_copy_tv(
            atom, cute.make_layout((32 * GATHER_WARPS, 1)), cute.make_layout((1, chunk)))

    @cute.jit
    def token_row(self, mIndex: cute.Tensor, row, m_rows_a):
        """The row of ``a`` that output row ``row`` reads, and whether it exists
        (a gathered index outside ``[0, M)`` reads as a zero row)."""
        src = row
        ok = cutlass.Boolean(True)
        if cutlass.const_expr(self.gather):
            src = mIndex[row]
            ok = src >= 0 and src < m_rows_a
        return src, ok

    @cute.jit
    def gather_tokens(self, mA, mIndex, sA, a_pipe, t, sched: TileScheduler, k_tiles):
        """GATHER: thread ``t`` fills row ``t`` of every A stage of the CTA's tiles;
        ``sA``: the stages as (128, tile_k, stages)."""
        tile_k = self.cfg.tile_k
        chunk = 128 // self.a_dtype.width
        chunks = tile_k // chunk
        k_cols = mA.shape[1]
        thr_copy = self.make_gather_copy().get_slice(t)
        tAsA = thr_copy.partition_D(sA)                            # (CPY, 1, chunks, stages)
        zeros = cute.make_rmem_tensor(cute.make_layout(chunk), self.a_dtype)
        zeros.fill(0)
        state = cp.make_pipeline_state(cp.PipelineUserType.Producer, self.stages)
        total_tiles, lead = sched.total_tiles, sched.lead
        tile = sched.first
        while tile - lead < total_tiles:
            expert, row0, seg_end, _ = sched.work_tile(tile)
            row = row0 + t
            live = row < seg_end and expert < sched.num_experts
            src = row
            if cutlass.const_expr(self.gather):
                src, ok = self.token_row(mIndex, cutlass.min(row, mIndex.shape[0] - 1),
                                         mA.shape[0])
                live = live and ok
            if not live:
                src = cutlass.Int32(0)
            # (tile_k, k-tiles) of the token row
            gRow = cute.local_tile(mA[src, None], (tile_k,), (None,))
            for k in cutlass.range(k_tiles, unroll=1):
                a_pipe.producer_acquire(state)
                for c in cutlass.range_constexpr(chunks):
                    dst = tAsA[None, 0, c, state.index]
                    if live and k * tile_k + c * chunk < k_cols:
                        cute.copy(thr_copy, cute.local_tile(gRow[None, k], (chunk,), (c,)), dst)
                    else:  # rows past the expert and the K tail read as zeros
                        cute.autovec_copy(zeros, dst)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                # the MMA reads in the async proxy what cp.async and st.shared wrote
                cute.arch.fence_view_async_shared()
                a_pipe.producer_commit(state)
                state.advance()
            tile += sched.step
        a_pipe.producer_tail(state)

    @cute.jit
    def load_weights(self, tma_atom_b, mB, sB, b_pipe, tiled_mma, sched: TileScheduler,
                     k_tiles):
        """LOAD_B: this CTA's half of each weight k-tile, by TMA, into the leader's barrier."""
        cta_v = sched.cta_rank
        # (bN, bK, RestN, RestK, E)
        gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)),
                             (None, None, None))
        thr_mma = tiled_mma.get_slice(cta_v)
        tCgB = thr_mma.partition_B(gB)   # (MMA, MMA_N, MMA_K, RestN, RestK, E)
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1),
            cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3))
        state = cp.make_pipeline_state(cp.PipelineUserType.Producer, self.stages)
        total_tiles, lead = sched.total_tiles, sched.lead
        tile = sched.first
        while tile - lead < total_tiles:
            expert, _, _, n_tile = sched.work_tile(tile)
            if expert >= sched.num_experts:  # the zero tail still fills its stages
                expert = cutlass.Int32(0)
                n_tile = cutlass.Int32(0)
            for k in cutlass.range(k_tiles, unroll=1):
                b_pipe.producer_acquire(state)
                cute.copy(tma_atom_b, tBgB[None, n_tile, k, expert], tBsB[None, state.index],
                          tma_bar_ptr=b_pipe.producer_get_barrier(state))
                b_pipe.producer_commit(state)
                state.advance()
            tile += sched.step
        b_pipe.producer_tail(state)

    @cute.jit
    def mma(self, tiled_mma, sA, sB, tCtAcc, a_pipe, b_pipe, acc_pipe, sched: TileScheduler,
            k_tiles):
        """MMA (leader CTA): the pair's k-loop per tile into one of two accumulators."""
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        num_k_blocks = cute.size(tCrA, mode=[2])
        read = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.stages)
        acc_state = cp.make_pipeline_state(cp.PipelineUserType.Producer, self.acc_stages)
        total_tiles, lead = sched.total_tiles, sched.lead
        tile = sched.first
        while tile - lead < total_tiles:
            acc_pipe.producer_acquire(acc_state)
            acc = tCtAcc[None, None, None, acc_state.index]
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for k in cutlass.range(k_tiles, unroll=1):
                a_pipe.consumer_wait(read)
                b_pipe.consumer_wait(read)
                tcgen05_fence.after_thread_sync()  # the MMAs after the stage's waits
                for kb in cutlass.range_constexpr(num_k_blocks):
                    crd = (None, None, kb, read.index)
                    cute.gemm(tiled_mma, acc, tCrA[crd], tCrB[crd], acc)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                a_pipe.consumer_release(read)
                b_pipe.consumer_release(read)
                read.advance()
            acc_pipe.producer_commit(acc_state)
            acc_state.advance()
            tile += sched.step
        acc_pipe.producer_tail(acc_state)

    @cute.jit
    def epilogue(self, tCtAcc, mC, acc_pipe, t, sched: TileScheduler):
        """EPILOGUE: thread ``t`` stores row ``t`` of the CTA's part of each tile.

        Rows of the zero tail and gathered rows whose index is out of range
        need no special case: their A rows were written as zeros, so their
        accumulators are zero."""
        cols = self.epi_cols
        vec = 128 // self.c_dtype.width
        n_cols = mC.shape[1]
        t2r_atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32),
                                       self.acc_dtype)
        # (128, tile_n) of one accumulator stage, in chunks of (128, cols)
        acc_chunks = cute.flat_divide(tCtAcc[((None, None), 0, 0, None)], (CTA_ROWS, cols))
        t2r = tcgen05.make_tmem_copy(t2r_atom, acc_chunks[None, None, 0, 0, 0])
        thr_t2r = t2r.get_slice(t)
        tTR_tAcc = thr_t2r.partition_S(acc_chunks)   # (T2R, 1, 1, 1, chunks, stages)
        # the same thread -> (row, column) map on a (128, tile_n) identity tile
        tTR_c = thr_t2r.partition_D(cute.flat_divide(
            cute.make_identity_tensor((CTA_ROWS, self.cfg.tile_n)), (CTA_ROWS, cols)))
        # a thread's registers: its row's ``cols`` columns (the TMEM side of the
        # partition is in lane/column addresses, so the shape comes from the tile's)
        frag = cute.make_rmem_tensor(tTR_c[None, None, None, 0, 0].shape, self.acc_dtype)
        up = cute.make_rmem_tensor(frag.shape, self.acc_dtype)
        out = cute.make_rmem_tensor(cute.make_layout(cute.size(frag)), self.c_dtype)
        out_chunks = self.out_tile_n // cols
        read = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.acc_stages)
        total_tiles, lead = sched.total_tiles, sched.lead
        tile = sched.first
        while tile - lead < total_tiles:
            _, row0, seg_end, n_tile = sched.work_tile(tile)
            row = row0 + t
            store = row < seg_end
            acc_pipe.consumer_wait(read)
            tcgen05_fence.after_thread_sync()  # the TMEM reads after the MMAs' commit
            for c in cutlass.range_constexpr(out_chunks):
                cute.copy(t2r, tTR_tAcc[None, None, None, 0, c, read.index], frag)
                values = frag.load()
                if cutlass.const_expr(self.swiglu):
                    cute.copy(t2r, tTR_tAcc[None, None, None, 0, c + out_chunks, read.index], up)
                    # silu(g) * u = g / (1 + e^-g) * u, in fp32
                    values = values * cute.math.rcp(
                        1.0 + cute.math.exp2(values * (-1.4426950408889634))) * up.load()
                out.store(values.to(self.c_dtype))
                col0 = n_tile * self.out_tile_n + c * cols
                if store:
                    gOut = cute.local_tile(mC[row, None], (cols,), (col0 // cols,))
                    for v in cutlass.range_constexpr(cols // vec):
                        if col0 + v * vec < n_cols:
                            cute.autovec_copy(cute.local_tile(out, (vec,), (v,)),
                                              cute.local_tile(gOut, (vec,), (v,)))
            # TMEM reads done (tcgen05.wait::ld) and ordered before the release, so the
            # MMA may overwrite the stage; one arrival per warp (8 epilogue warps a pair)
            cute.arch.fence_view_async_tmem_load()
            tcgen05_fence.before_thread_sync()
            with cute.arch.elect_one():
                acc_pipe.consumer_release(read)
            read.advance()
            tile += sched.step
