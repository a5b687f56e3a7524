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
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

import ts_pipeline

from ..common import pdl
from .grouped_gemm_sm90_config import MAX_EXPERTS, SMEM_CAPACITY, TileConfig
from .sm90_mma import RaggedTileMma
from ..common.tile_schedule import RaggedTileSchedule, TileScheduler


class Warp(enum.IntEnum):
    """Warp roles of a CTA (``128 * (1 + mma_warpgroups)`` threads)."""

    LOAD_A = 0     # TMA of the token tile; the task warp leader (arms each full barrier)
    LOAD_B = 1     # warps 1 .. b_warps: TMA of one weight part each
    SCHEDULE = 3   # builds the tile schedule in shared memory, then idles
    MMA = 4        # warps 4..: the WGMMA warpgroups, then the epilogue


class Barrier(enum.IntEnum):
    """Named barriers among the MMA threads (id 0 is the CTA-wide one)."""

    EPILOGUE = 1   # an epilogue sub-tile is in shared memory


class GroupedGemmSm90(RaggedTileMma):
    """Persistent ragged grouped GEMM, ``C[rows of e] = A[rows of e] @ B[e]``.

    Warp roles (:class:`Warp`; one CTA per SM, ``128 * (1 + mma_warpgroups)`` threads):

    - LOAD_A (warp 0): TMA producer of the token tile
      ``A[row0:row0+tile_m, k:k+tile_k]``; the *task warp leader*: it arms each
      stage's full barrier once, with the bytes of all the stage's loads.
    - LOAD_B (warps 1..b_warps): TMA producers of the expert-weight tile, each
      ``tile_n / b_warps`` rows of ``B[e]``.
    - SCHEDULE (warp 3): builds the tile schedule in shared memory at start,
      then idles.
    - MMA (warpgroups 1..): WGMMA consumers, 64 rows each of every tile
      (skipping the MMAs of rows all past the expert's end), then the
      epilogue (:meth:`epilogue`): registers -> stmatrix -> shared memory ->
      16-byte predicated stores, so a tile never writes a row of a
      neighbouring expert.

    Pipeline: TMA producers -> MMA warpgroups, ``TSPipelineTmaAsync``,
    ``stages`` stages of ``(tile_m + tile_n) * tile_k * 2`` bytes:
    ``tile_m * tile_k * 2`` of tokens plus ``b_warps`` parts of
    ``tile_n / b_warps * tile_k * 2`` of weights.

    Schedule: :class:`csrc_free_kernels.common.tile_schedule.RaggedTileSchedule`
    (built by the SCHEDULE warp from ``offs`` in shared memory; a ``WorkTile``
    per step for every role), with the configuration's rows, cluster, pairs
    and bands.

    PDL (:mod:`csrc_free_kernels.common.pdl`): every thread waits for the kernel
    ahead before its first global access.  With ``prefetch_weights`` the
    weight warps do not: the schedule is built from ``offs`` (read from L2)
    and the weight parts of the first ``stages`` stages are loaded while the
    kernel ahead still runs; then they wait, and the token loads (LOAD_A,
    which arms the stages) and the stores follow the wait as always.  For
    callers whose ``offs`` and ``b`` are complete when the kernel ahead lets
    its dependents launch (``ts_moe.ops``: after its own row gather, or when
    told so).  Honoured with one CTA per cluster (:meth:`prefetch_supported`);
    otherwise off.

    Hooks for variants (subclasses; the FP8 kernel's scales use them):
    :meth:`extra_params` builds the kernel's ``extra`` parameters, handed to
    every device hook; :meth:`shared_buffers` adds shared memory,
    :meth:`bind_shared` binds it; the producers' :meth:`prefetch_extra`,
    :meth:`token_tiles` and :meth:`load_a` (LOAD_A's loads of a tile and of a
    stage), :meth:`load_stage` (which warp loads what), :meth:`ring_producers` (who
    fills a stage's full barrier), :meth:`b_part_coord` (where a weight part lies), :meth:`extra_roles` (work for the producer
    warps that load nothing); the MMA warpgroups' ``bind_mma``, ``mainloop``
    and ``scale_accumulators``, inherited from
    :class:`csrc_free_kernels.hopper.sm90_mma.RaggedTileMma`; the epilogue's, from
    :class:`csrc_free_kernels.hopper.sm90_epilogue.RaggedTileEpilogue`:
    ``epilogue_fragment`` (the accumulators -> output values),
    ``make_epi_smem_layout``, ``epilogue_buffers``, ``tile_stores`` and
    ``epilogue`` (a tile's output).
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
        self.threads = 32 * Warp.MMA + self.num_mma_threads
        self.producer_regs = 40
        self.mma_regs = 232 if self.num_mma_warpgroups == 2 else 240
        # the threads of one tile's MMAs and epilogue
        self.epi_threads = self.num_mma_threads
        self.epi_barrier = cp.NamedBarrier(barrier_id=Barrier.EPILOGUE,
                                           num_threads=self.epi_threads)
        self.epi_stages = 2
        if config.b_warps not in (1, 2) or config.tile_n % config.b_warps:
            raise ValueError(f"b_warps must be 1 or 2 and divide tile_n: {config}")
        self.schedule = RaggedTileSchedule(
            cta_rows=config.rows, cluster_m=config.cluster_m, pair_tiles=config.pair_tiles,
            band_m=config.band_m, max_experts=MAX_EXPERTS)

    def tile_warpgroups(self) -> int:
        """The MMA warpgroups that share one tile, 64 rows each: all of them."""
        return self.cfg.mma_warpgroups

    @staticmethod
    def prefetch_supported(config: TileConfig) -> bool:
        """Whether ``prefetch_weights`` takes effect: PDL on, and the weight warps
        own their CTA's weight loads alone (no multicast)."""
        return pdl.ENABLED and config.cluster_m == 1

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
        tile_warpgroups = self.tile_warpgroups()
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            a_dtype, a_dtype,
            a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
            self.acc_dtype, (tile_warpgroups, 1, 1), tiler_mn=(64, cfg.tile_n),
        )
        # sub-tiles of all the tile's rows (128: a row of each warpgroup's 64)
        self.epi_tile = sm90_utils.compute_tile_shape_or_override(
            self.tile_shape_mnk, c_dtype, is_cooperative=64 * tile_warpgroups == 128)
        self.epi_smem_layout = self.make_epi_smem_layout(c_dtype, c_layout)
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
        self.launch(mA, mB_ekn, mC, mOffs, (), num_ctas, stream)

    @cute.jit
    def launch(self, mA, mB_ekn, mC, mOffs, inputs: tuple, num_ctas, stream):
        """Set up for these operands and launch :meth:`kernel`; ``inputs``: the
        tensors a subclass's ``__call__`` takes besides (for :meth:`extra_params`)."""
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
        self.storage_struct = self.shared_storage()  # sized on the host
        self.kernel(
            tma_atom_a, mA_tma, tma_atom_b, mB_tma, self.pair_params(mB, tma_atom_b, mB_tma),
            self.extra_params(tma_atom_a, *inputs), mC, mOffs, self.tiled_mma,
            self.a_smem_layout, self.b_smem_layout, self.epi_smem_layout,
        ).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1),
                 cluster=(cfg.cluster_m, 1, 1), min_blocks_per_mp=1, stream=stream,
                 use_pdl=pdl.ENABLED)

    def pair_params(self, mB, tma_atom_b, mB_tma) -> tuple:
        """The kernel's ``pair`` parameters: with ``pair_tiles``, the TMA atom and
        tensor of whole weight parts (for a pair whose tiles differ, each CTA loads
        its own); otherwise the multicast atom's again, unused (the compiled
        signature is the same for every configuration)."""
        if cutlass.const_expr(self.cfg.pair_tiles):
            tma_atom_b, mB_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mB, self.b_part_smem_layout,
                (self.b_part_n, self.cfg.tile_k))
        return tma_atom_b, mB_tma

    def extra_params(self, tma_atom_a) -> tuple:
        """The kernel's ``extra`` parameters, from the token atom and the
        ``inputs`` of :meth:`launch`: what a subclass's hooks read (none here)."""
        return ()

    def shared_buffers(self) -> dict:
        """The 1024-aligned shared-memory buffers, in order: name -> (element type,
        elements).  A subclass adds its own (the kernel binds them in
        :meth:`bind_shared`)."""
        return {"sA": (self.a_dtype, cute.cosize(self.a_smem_layout)),
                "sB": (self.b_dtype, cute.cosize(self.b_smem_layout)),
                "sC": (self.c_dtype, cute.cosize(self.epi_smem_layout))}

    def shared_storage(self):
        """The kernel's shared memory: the ring's barriers, the schedule's tables,
        then :meth:`shared_buffers`."""
        fields = {
            "ring_barriers": cute.struct.MemRange[cutlass.Int64, 2 * self.stages],
            "seg_end": cute.struct.MemRange[cutlass.Int32, self.schedule.table_words],
            "tile_end": cute.struct.MemRange[cutlass.Int32, self.schedule.table_words],
            **{name: cute.struct.Align[cute.struct.MemRange[dtype, size], 1024]
               for name, (dtype, size) in self.shared_buffers().items()}}
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # -------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA: cute.Tensor, tma_atom_b: cute.CopyAtom,
               mB: cute.Tensor, pair: tuple, extra: tuple, mC: cute.Tensor, mOffs: cute.Tensor,
               tiled_mma: cute.TiledMma, a_smem_layout: cute.ComposedLayout,
               b_smem_layout: cute.ComposedLayout, epi_smem_layout):
        """``pair``: :meth:`pair_params`; ``extra``: :meth:`extra_params`, handed to
        the hooks."""
        cfg = self.cfg
        early = self.prefetch_weights
        if cutlass.const_expr(not early):
            pdl.enter()  # before the first global access (offs, tokens, weights, out)
        else:
            pdl.reads_before_wait()  # offs and weights first (the pre-flight's record)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        sched = TileScheduler.create(self.schedule, cta_rank, bidx, grid)
        if warp_idx == Warp.LOAD_A:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            if cutlass.const_expr(cfg.pair_tiles):
                cpasync.prefetch_descriptor(pair[0])
            self.prefetch_extra(extra)

        storage = cutlass.utils.SmemAllocator().allocate(self.storage_struct)
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
        sC = self.epilogue_buffers(storage, epi_smem_layout)
        extra = self.bind_shared(storage, extra)

        last_b_warp = Warp.LOAD_B + cfg.b_warps - 1
        if warp_idx < Warp.MMA:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if cutlass.const_expr(early):
                if warp_idx == Warp.LOAD_A or warp_idx > last_b_warp:
                    pdl.enter()  # the weight warps wait in produce()
            if warp_idx <= last_b_warp:
                self.produce(tma_atom_a, mA, tma_atom_b, mB, pair, sA, sB, ring, warp_idx,
                             sched, k_tiles, n_cols, extra)
            self.extra_roles(warp_idx, mC, sC, sched)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            if cutlass.const_expr(early):
                pdl.enter()
            self.consume(tiled_mma, mC, sA, sB, sC, ring, tidx - 32 * Warp.MMA, sched, k_tiles,
                         extra)

    def prefetch_extra(self, extra):
        """LOAD_A, at start: prefetch the descriptors of the ``extra`` TMA atoms
        (none here)."""

    def bind_shared(self, storage, extra):
        """``extra`` with the subclass's shared-memory buffers of ``storage``
        bound (as tensors), for every role: ``extra`` as is here."""
        return extra

    def extra_roles(self, warp_idx, mC, sC, sched: TileScheduler):
        """Work for the producer warpgroup's warps besides the loads, traced after
        them: none here."""

    def ring_producers(self) -> tuple:
        """``(arrivals, tx_bytes, leader)`` of a stage's full barrier: the arrivals a
        phase counts, the TMA bytes the leader warp arms it with: here the leader's one
        arrival with all the stage's bytes, LOAD_A leading."""
        return 1, self.stage_bytes, Warp.LOAD_A

    def make_ring(self, barriers, warp_idx):
        cluster_m = self.cfg.cluster_m
        arrivals, tx_bytes, leader = self.ring_producers()
        # a stage is released by every consumer warp of every CTA whose
        # producer multicasts into it
        consumers = cp.CooperativeGroup(cp.Agent.Thread,
                                        4 * self.tile_warpgroups() * cluster_m)
        return ts_pipeline.TSPipelineTmaAsync.create(
            num_stages=self.stages,
            producer_group=cp.CooperativeGroup(cp.Agent.Thread, arrivals),
            consumer_group=consumers,
            tx_count=tx_bytes,
            barrier_storage=barriers,
            cta_layout_vmnk=cute.make_layout((1, cluster_m, 1, 1)) if cluster_m > 1 else None,
            is_task_warp_leader=warp_idx == leader)

    @cute.jit
    def produce(self, tma_atom_a, mA, tma_atom_b, mB, pair, sA, sB, ring, warp_idx,
                sched: TileScheduler, k_tiles, n_cols, extra):
        """LOAD_A: each stage's token box (:meth:`load_a`), arming the stage with all
        its bytes; the LOAD_B warps: a weight part each (:meth:`load_b`)."""
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
        tma_atom_b1, tBsB1, tBgB1 = tma_atom_b, tBsB, tBgB
        if cutlass.const_expr(cfg.pair_tiles):
            # the same, whole parts, loaded by this CTA alone
            tma_atom_b1, mB1 = pair
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
                a_load = (tma_atom_a, self.token_tiles(tma_atom_a, mA, sA_box, row0, extra))
                b_load = (tma_atom_b, tBgB, tBsB, tma_atom_b1, tBgB1, tBsB1, shared, n_tile,
                          n_cols, expert)
                for k in cutlass.range(k_tiles, unroll=1):
                    ring.producer_acquire(state)
                    bar = ring.producer_get_barrier(state)
                    issued = self.load_stage(warp_idx, k, state.index, bar, a_load, b_load,
                                             issued, extra)
                    state.advance()
            t += sched.step
        if cutlass.const_expr(self.prefetch_weights):
            if warp_idx >= Warp.LOAD_B and issued < self.stages:
                pdl.enter()  # fewer k-tiles than stages in the whole walk
        ring.producer_tail(state)

    @cute.jit
    def load_stage(self, warp_idx, k, stage, bar, a_load, b_load, issued, extra):
        """This warp's loads of k-tile ``k`` into ``stage``: LOAD_A's token box
        (:meth:`load_a` of ``a_load``), a LOAD_B warp's weight part (:meth:`load_b`
        of ``b_load``).  Returns ``issued``, the weight stages loaded (counted with
        ``prefetch_weights``: the ring is full after ``stages``, then the weight
        warps wait for the kernel ahead)."""
        if warp_idx == Warp.LOAD_A:
            self.load_a(*a_load, k, stage, bar, extra)
        if warp_idx >= Warp.LOAD_B:
            self.load_weights(warp_idx, k, stage, bar, b_load)
            if cutlass.const_expr(self.prefetch_weights):
                issued += 1
                if issued == self.stages:
                    pdl.enter()
        return issued

    def load_weights(self, warp_idx, k, stage, bar, b_load):
        """A LOAD_B warp's part of k-tile ``k`` (``b_load``: the atoms and
        partitions of :meth:`load_b`, ``shared``, ``n_tile``, ``n_cols``, ``expert``)."""
        tma_atom_b, tBgB, tBsB, tma_atom_b1, tBgB1, tBsB1, shared, n_tile, n_cols, expert = b_load
        self.load_b(tma_atom_b, tBgB, tBsB, tma_atom_b1, tBgB1, tBsB1, shared,
                    warp_idx - Warp.LOAD_B, n_tile, n_cols, k, expert, stage, bar)

    def token_tiles(self, tma_atom_a, mA, sA_box, row0, extra) -> tuple:
        """LOAD_A, per tile: the TMA partition of the (rows, tile_k, k-tiles) tokens
        from ``row0`` (source) and of the stages' token boxes ``sA_box``
        (destination), as ``(dst, src)``."""
        cfg = self.cfg
        gA = cute.local_tile(cute.domain_offset((row0, 0), mA), (cfg.rows, cfg.tile_k), (0, None))
        return cpasync.tma_partition(tma_atom_a, 0, cute.make_layout(1),
                                     cute.group_modes(sA_box, 0, 2), cute.group_modes(gA, 0, 2))

    @cute.jit
    def load_a(self, tma_atom_a, a_tiles, k, stage, bar, extra):
        """LOAD_A: k-tile ``k`` of the token box into ``stage`` (``a_tiles``:
        :meth:`token_tiles`), counted by the stage's full barrier ``bar``."""
        tAsA, tAgA = a_tiles
        cute.copy(tma_atom_a, tAgA[None, k], tAsA[None, stage], tma_bar_ptr=bar)

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


class GroupedGemmSwigluSm90(GroupedGemmSm90):
    """``silu(A @ gate^T) * (A @ up^T)`` per expert, in one pass over the weights.

    ``B`` is the (E, 2I, H) ``gate_up`` weight (gate rows first).  A tile's
    weight stage has two parts loaded by two producer warps under the stage's
    one full barrier: the first LOAD_B warp the ``tile_n / 2`` gate rows, the
    second the matching up rows ``I`` further on; LOAD_A loads the token tile
    and arms the barrier with the bytes of all three.  The MMA warpgroups hold
    both accumulators (gate in the first half of the tile's columns, up in the
    second), and the epilogue applies ``silu(gate) * up`` in fp32 before the
    single rounding.  Everything else (schedule, ring, ragged stores) is the
    base kernel's.
    """

    def __init__(self, config: TileConfig, acc_dtype=cutlass.Float32,
                 prefetch_weights: bool = False):
        if config.b_warps != 2:
            config = dataclasses.replace(config, b_warps=2)
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
