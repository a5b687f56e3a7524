"""Ragged grouped GEMM for Hopper (sm_90a): WGMMA + TMA, persistent, warp-specialized.

``out[r] = a[r] @ b[e]`` for the rows ``r`` of expert ``e`` (``offs`` read on
the device), zeros for the rows past the last expert.  See
:class:`GroupedGemmSm90` for the design and :func:`grouped_gemm` for the
torch entry point.
"""

import functools
import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cp
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass.cute.nvgpu import cpasync, warpgroup

import ts_pipeline

from . import compile as kcompile

MAX_EXPERTS = 512
SMEM_CAPACITY = 227 * 1024


@dataclass(frozen=True)
class TileConfig:
    """One compiled configuration of the kernel.

    ``tile_m`` is 64 per MMA warpgroup; ``b_warps`` producer warps share the
    weight tile (each loads ``tile_n / b_warps`` rows of it); ``multi_warp``
    False issues the same loads from one warp through the base
    ``PipelineTmaAsync`` (kept to measure what the multi-warp design earns).
    """

    name: str
    tile_m: int
    tile_n: int
    tile_k: int = 64
    stages: int = 4
    b_warps: int = 2
    multi_warp: bool = True

    @property
    def mma_warpgroups(self) -> int:
        return self.tile_m // 64


# Decode: few rows per expert, the op streams expert weights from HBM; one MMA
# warpgroup and a deep ring keep ~190 KB of weights in flight per SM.
DECODE = TileConfig("decode", tile_m=64, tile_n=128, tile_k=64, stages=8, b_warps=2)
# Prefill: many rows per expert, tensor-core bound; two MMA warpgroups on a
# 128x256 tile (128 fp32 accumulators per thread), four 48 KB stages.
PREFILL = TileConfig("prefill", tile_m=128, tile_n=256, tile_k=64, stages=4, b_warps=2)
CONFIGS = {c.name: c for c in (DECODE, PREFILL)}


def choose_config(num_experts: int, n: int, k: int, m: int) -> TileConfig:
    """Decode tiles when an expert averages under 128 rows, else prefill tiles.

    Below ~128 rows per expert a 128-row tile is mostly padding and the op is
    bound by reading the weights (E*N*K*2 bytes), which the deep 64-row ring
    streams best; above it, the 128x256 tile halves the operand traffic per
    flop.  Uses shapes only (M, E, N, K): no device values, no sync.
    """
    del n, k  # both configurations serve every N and K; kept for future tiles
    return PREFILL if m >= 128 * max(num_experts, 1) else DECODE


class GroupedGemmSm90:
    """Persistent ragged grouped GEMM, ``C[rows of e] = A[rows of e] @ B[e]``.

    Warp roles (one CTA per SM, ``128 * (1 + mma_warpgroups)`` threads):

    - warp 0: TMA producer of the token tile ``A[row0:row0+tile_m, k:k+tile_k]``;
      the *task warp leader*: it arms each stage's full barrier once, with the
      bytes of all the stage's loads.
    - warps 1..b_warps: TMA producers of the expert-weight tile, each
      ``tile_n / b_warps`` rows of ``B[e]`` (``multi_warp=False``: warp 0
      issues these loads too).
    - warp 3: builds the tile schedule in shared memory at start, then idles.
    - warpgroups 1..: WGMMA consumers (64 rows each), then the epilogue:
      registers -> stmatrix -> shared memory -> 16-byte predicated stores, so
      a tile never writes a row of a neighbouring expert.

    Pipeline: TMA producers -> MMA warpgroups, ``TSPipelineTmaAsync``
    (``PipelineTmaAsync`` for ``multi_warp=False``), ``stages`` stages of
    ``(tile_m + tile_n) * tile_k * 2`` bytes: ``tile_m * tile_k * 2`` of tokens
    plus ``b_warps`` parts of ``tile_n / b_warps * tile_k * 2`` of weights.

    Schedule: tiles are numbered expert by expert (the rows past the last
    expert form a final zero-filled pseudo-expert), and within an expert with
    the m-tile fastest, so CTAs running at the same time share the weight
    tile in L2; CTA ``b`` takes tiles ``b, b + grid, ...``.  The per-expert row
    ends (``cummax(clamp(offs, 0, M))``) and tile counts are prefix-scanned by
    one warp into shared memory; each role maps a tile index to its expert by
    binary search.
    """

    def __init__(self, config: TileConfig, acc_dtype=cutlass.Float32):
        self.cfg = config
        self.acc_dtype = acc_dtype
        self.tile_shape_mnk = (config.tile_m, config.tile_n, config.tile_k)
        self.b_part_n = config.tile_n // config.b_warps
        self.num_mma_warpgroups = config.mma_warpgroups
        self.num_mma_threads = 128 * self.num_mma_warpgroups
        self.threads = 128 + self.num_mma_threads
        self.sched_warp = 3
        self.producer_regs = 40
        self.mma_regs = 232 if self.num_mma_warpgroups == 2 else 240
        self.epi_barrier = cp.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)
        self.epi_stages = 2
        if config.b_warps not in (1, 2) or config.tile_n % config.b_warps:
            raise ValueError(f"b_warps must be 1 or 2 and divide tile_n: {config}")

    # ---------------------------------------------------------------- host
    def _setup(self, a_dtype, c_dtype, a_layout, b_layout, c_layout):
        cfg = self.cfg
        self.a_dtype, self.b_dtype, self.c_dtype = a_dtype, a_dtype, c_dtype
        self.a_layout, self.b_layout, self.c_layout = a_layout, b_layout, c_layout
        if b_layout.is_k_major_b():
            # a part must be whole 128-byte swizzle rows of the tile
            assert cfg.tile_k * a_dtype.width == 1024 or cfg.b_warps == 1
        else:
            assert self.b_part_n % 64 == 0
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            a_dtype, a_dtype,
            a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
            self.acc_dtype, (self.num_mma_warpgroups, 1, 1), tiler_mn=(64, cfg.tile_n),
        )
        self.epi_tile = sm90_utils.compute_tile_shape_or_override(
            self.tile_shape_mnk, c_dtype, is_cooperative=self.num_mma_warpgroups == 2
        )
        self.epi_smem_layout = sm90_utils.make_smem_layout_epi(
            c_dtype, c_layout, self.epi_tile, self.epi_stages)
        self.a_bytes = cfg.tile_m * cfg.tile_k * a_dtype.width // 8
        self.b_part_bytes = self.b_part_n * cfg.tile_k * a_dtype.width // 8
        self.stage_bytes = self.a_bytes + cfg.b_warps * self.b_part_bytes
        # as many stages as fit, up to the config's: an fp32 epilogue buffer
        # costs the 128x256 tile one of its four
        fixed = (cute.cosize(self.epi_smem_layout) * c_dtype.width // 8
                 + 8 * (MAX_EXPERTS + 1) + 3 * 1024)
        self.stages = min(cfg.stages, (SMEM_CAPACITY - fixed) // self.stage_bytes)
        if self.stages < 2:
            raise ValueError(f"{cfg} leaves room for {self.stages} stages")
        # (tile_m, tile_k, stages), (tile_n, tile_k, stages)
        self.a_smem_layout = sm90_utils.make_smem_layout_a(
            a_layout, self.tile_shape_mnk, a_dtype, self.stages)
        self.b_smem_layout = sm90_utils.make_smem_layout_b(
            b_layout, self.tile_shape_mnk, a_dtype, self.stages)
        # one weight part of one stage: (b_part_n, tile_k)
        self.b_part_smem_layout = cute.slice_(sm90_utils.make_smem_layout_b(
            b_layout, (cfg.tile_m, self.b_part_n, cfg.tile_k), a_dtype, 1), (None, None, 0))

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB_ekn: cute.Tensor, mC: cute.Tensor,
                 mOffs: cute.Tensor, num_ctas: cutlass.Int32, stream):
        """mA (M, K), mB_ekn (E, K, N) as torch lays it out, mC (M, N), mOffs (E,)."""
        # (N, K, E): CuTe's B convention
        mB = cute.make_tensor(mB_ekn.iterator, cute.select(mB_ekn.layout, mode=[2, 1, 0]))
        self._setup(mA.element_type, mC.element_type, utils.LayoutEnum.from_tensor(mA),
                    utils.LayoutEnum.from_tensor(mB), utils.LayoutEnum.from_tensor(mC))
        cfg = self.cfg
        tma_atom_a, mA_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mA,
            cute.slice_(self.a_smem_layout, (None, None, 0)), (cfg.tile_m, cfg.tile_k))
        tma_atom_b, mB_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mB,
            self.b_part_smem_layout, (self.b_part_n, cfg.tile_k))

        @cute.struct
        class SharedStorage:
            ring_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            seg_end: cute.struct.MemRange[cutlass.Int32, MAX_EXPERTS + 1]
            tile_end: cute.struct.MemRange[cutlass.Int32, MAX_EXPERTS + 1]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_layout)], 1024]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_layout)], 1024]
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_atom_a, mA_tma, tma_atom_b, mB_tma, mC, mOffs, self.tiled_mma,
            self.a_smem_layout, self.b_smem_layout, self.epi_smem_layout,
        ).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1),
                 min_blocks_per_mp=1, stream=stream)

    # -------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA: cute.Tensor, tma_atom_b: cute.CopyAtom,
               mB: cute.Tensor, mC: cute.Tensor, mOffs: cute.Tensor, tiled_mma: cute.TiledMma,
               a_smem_layout: cute.ComposedLayout, b_smem_layout: cute.ComposedLayout,
               epi_smem_layout: cute.ComposedLayout):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        sSegEnd = storage.seg_end.get_tensor(cute.make_layout(MAX_EXPERTS + 1))
        sTileEnd = storage.tile_end.get_tensor(cute.make_layout(MAX_EXPERTS + 1))
        num_experts = mOffs.shape[0]
        m_rows, n_cols = mC.shape
        n_tiles = (n_cols + cfg.tile_n - 1) // cfg.tile_n
        k_tiles = (mA.shape[1] + cfg.tile_k - 1) // cfg.tile_k
        if warp_idx == self.sched_warp:
            self.build_schedule(mOffs, sSegEnd, sTileEnd, num_experts, m_rows, n_tiles)

        ring = self.make_ring(storage.ring_barriers.data_ptr(), warp_idx)  # syncs the CTA
        total_tiles = sTileEnd[num_experts]

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sC = storage.sC.get_tensor(epi_smem_layout.outer, swizzle=epi_smem_layout.inner)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx <= (cfg.b_warps if cutlass.const_expr(cfg.multi_warp) else 0):
                self.produce(tma_atom_a, mA, tma_atom_b, mB, sA, sB, ring, warp_idx,
                             sSegEnd, sTileEnd, num_experts, k_tiles, bidx, grid, total_tiles)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume(tiled_mma, mC, sA, sB, sC, ring, tidx - 128, sSegEnd, sTileEnd,
                         num_experts, k_tiles, bidx, grid, total_tiles)

    def make_ring(self, barriers, warp_idx):
        consumers = cp.CooperativeGroup(cp.Agent.Thread, 4 * self.num_mma_warpgroups)
        if cutlass.const_expr(self.cfg.multi_warp):
            return ts_pipeline.TSPipelineTmaAsync.create(
                num_stages=self.stages,
                producer_group=cp.CooperativeGroup(cp.Agent.Thread),
                consumer_group=consumers,
                tx_count=self.stage_bytes,
                barrier_storage=barriers,
                is_task_warp_leader=warp_idx == 0,
            )
        return cp.PipelineTmaAsync.create(
            num_stages=self.stages,
            producer_group=cp.CooperativeGroup(cp.Agent.Thread),
            consumer_group=consumers,
            tx_count=self.stage_bytes,
            barrier_storage=barriers,
        )

    @cute.jit
    def build_schedule(self, mOffs: cute.Tensor, sSegEnd: cute.Tensor, sTileEnd: cute.Tensor,
                       num_experts: cutlass.Int32, m_rows: cutlass.Int32, n_tiles: cutlass.Int32):
        """One warp: ``seg_end = cummax(clamp(offs, 0, M))`` and the inclusive
        prefix sum of each expert's tile count, 32 experts per step; entry
        ``num_experts`` is the zero-filled tail ``[seg_end[-1], M)``."""
        tile_m = self.cfg.tile_m
        lane = cute.arch.lane_idx()
        carry_end = cutlass.Int32(0)
        carry_tiles = cutlass.Int32(0)
        for base in cutlass.range(0, num_experts, 32, unroll=1):
            e = base + lane
            end = cutlass.Int32(0)
            if e < num_experts:
                end = mOffs[e]
            end = cutlass.max(cutlass.min(end, m_rows), carry_end)
            for d in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_up(end, 1 << d)
                if lane >= (1 << d):
                    end = cutlass.max(end, other)
            start = cute.arch.shuffle_sync_up(end, 1)
            if lane == 0:
                start = carry_end
            tiles = (end - start + tile_m - 1) // tile_m * n_tiles
            for d in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_up(tiles, 1 << d)
                if lane >= (1 << d):
                    tiles = tiles + other
            tiles = tiles + carry_tiles
            if e < num_experts:
                sSegEnd[e] = end
                sTileEnd[e] = tiles
            carry_end = cute.arch.shuffle_sync(end, 31)
            carry_tiles = cute.arch.shuffle_sync(tiles, 31)
        if lane == 0:
            sSegEnd[num_experts] = m_rows
            sTileEnd[num_experts] = carry_tiles + (m_rows - carry_end + tile_m - 1) // tile_m * n_tiles

    @cute.jit
    def tile_info(self, t: cutlass.Int32, sSegEnd: cute.Tensor, sTileEnd: cute.Tensor,
                  num_experts: cutlass.Int32):
        """Tile ``t`` -> (expert, first row, expert's row end, n-tile)."""
        lo = cutlass.Int32(0)
        hi = num_experts
        for _ in cutlass.range_constexpr(math.ceil(math.log2(MAX_EXPERTS + 1))):
            mid = (lo + hi) // 2
            if sTileEnd[mid] > t:
                hi = mid
            else:
                lo = cutlass.min(mid + 1, hi)
        expert = lo
        tiles_before = cutlass.Int32(0)
        seg_start = cutlass.Int32(0)
        if expert > 0:
            tiles_before = sTileEnd[expert - 1]
            seg_start = sSegEnd[expert - 1]
        seg_end = sSegEnd[expert]
        m_tiles = (seg_end - seg_start + self.cfg.tile_m - 1) // self.cfg.tile_m
        local = t - tiles_before
        n_tile = local // m_tiles
        row0 = seg_start + (local - n_tile * m_tiles) * self.cfg.tile_m
        return expert, row0, seg_end, n_tile

    @cute.jit
    def produce(self, tma_atom_a, mA, tma_atom_b, mB, sA, sB, ring, warp_idx,
                sSegEnd, sTileEnd, num_experts, k_tiles, bidx, grid, total_tiles):
        cfg = self.cfg
        # (b_part_n, tile_k, b_warps, 1, stages): the weight parts of each stage
        sB_parts = cute.flat_divide(sB, (self.b_part_n, cfg.tile_k))
        # gB: (b_part_n, tile_k, N parts, k-tiles, E)
        gB = cute.local_tile(mB, (self.b_part_n, cfg.tile_k), (None, None, None))
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1),
            cute.group_modes(sB_parts, 0, 2), cute.group_modes(gB, 0, 2))
        state = cp.make_pipeline_state(cp.PipelineUserType.Producer, self.stages)
        t = bidx
        while t < total_tiles:
            expert, row0, _, n_tile = self.tile_info(t, sSegEnd, sTileEnd, num_experts)
            if expert < num_experts:
                # (tile_m, tile_k, k-tiles) of tokens starting at row0
                gA = cute.local_tile(cute.domain_offset((row0, 0), mA),
                                     (cfg.tile_m, cfg.tile_k), (0, None))
                tAsA, tAgA = cpasync.tma_partition(
                    tma_atom_a, 0, cute.make_layout(1),
                    cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
                for k in cutlass.range(k_tiles, unroll=1):
                    ring.producer_acquire(state)
                    bar = ring.producer_get_barrier(state)
                    if warp_idx == 0:
                        cute.copy(tma_atom_a, tAgA[None, k], tAsA[None, state.index],
                                  tma_bar_ptr=bar)
                    if cutlass.const_expr(cfg.multi_warp):
                        if warp_idx > 0:
                            part = warp_idx - 1
                            cute.copy(tma_atom_b,
                                      tBgB[None, self.b_part_coord(n_tile, part), k, expert],
                                      tBsB[None, part, 0, state.index], tma_bar_ptr=bar)
                    else:
                        for part in cutlass.range_constexpr(cfg.b_warps):
                            cute.copy(tma_atom_b,
                                      tBgB[None, self.b_part_coord(n_tile, part), k, expert],
                                      tBsB[None, part, 0, state.index], tma_bar_ptr=bar)
                    state.advance()
            t += grid
        ring.producer_tail(state)

    def b_part_coord(self, n_tile, part):
        """Index (in ``b_part_n`` rows) of weight part ``part`` of n-tile ``n_tile``."""
        return n_tile * self.cfg.b_warps + part

    @cute.jit
    def consume(self, tiled_mma, mC, sA, sB, sC, ring, ctid, sSegEnd, sTileEnd,
                num_experts, k_tiles, bidx, grid, total_tiles):
        cfg = self.cfg
        thr_mma = tiled_mma.get_slice(ctid)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(
            thr_mma.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))).shape,
            self.acc_dtype)
        num_k_blocks = cute.size(tCrA, mode=[2])

        # epilogue: registers -> shared (stmatrix) -> global (16-byte predicated)
        r2s = cute.make_tiled_copy_S(
            sm90_utils.sm90_get_smem_store_op(self.c_layout, self.c_dtype, self.acc_dtype),
            cute.make_tiled_copy_C_atom(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.c_dtype),
                tiled_mma))
        thr_r2s = r2s.get_slice(ctid)
        tRS_sC = thr_r2s.partition_D(sC)
        tRS_rAcc = r2s.retile(acc)
        tRS_rD = cute.make_rmem_tensor(cute.shape(thr_r2s.partition_S(sC))[:3], self.acc_dtype)
        tRS_rOut = cute.make_rmem_tensor(tRS_rD.shape, self.c_dtype)
        s2g = self.make_store_copy()
        thr_s2g = s2g.get_slice(ctid)
        tSsC = thr_s2g.partition_S(sC)
        epi_n = self.epi_tile[1]
        num_epi = cfg.tile_n // epi_n

        read = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.stages)
        release = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.stages)
        t = bidx
        epi_count = cutlass.Int32(0)
        while t < total_tiles:
            expert, row0, seg_end, n_tile = self.tile_info(t, sSegEnd, sTileEnd, num_experts)
            acc.fill(0.0)
            if expert < num_experts:
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.fence()
                for k in cutlass.range(k_tiles, unroll=1):
                    ring.consumer_wait(read)
                    for kb in cutlass.range_constexpr(num_k_blocks):
                        cute.gemm(tiled_mma, acc, tCrA[None, None, kb, read.index],
                                  tCrB[None, None, kb, read.index], acc)
                    warpgroup.commit_group()
                    # keep one k-tile of WGMMA in flight; free the one before it
                    if k > 0:
                        warpgroup.wait_group(1)
                        ring.consumer_release(release)
                        release.advance()
                    read.advance()
                warpgroup.wait_group(0)
                ring.consumer_release(release)
                release.advance()

            # (tile_m, tile_n) of C at (row0, n_tile); its coordinates (tile row, column)
            gC = cute.local_tile(cute.domain_offset((row0, 0), mC),
                                 (cfg.tile_m, cfg.tile_n), (0, n_tile))
            cC = cute.local_tile(cute.make_identity_tensor(mC.shape),
                                 (cfg.tile_m, cfg.tile_n), (0, n_tile))
            rows_valid = seg_end - row0  # rows of this expert in the tile
            for epi in cutlass.range_constexpr(num_epi):
                buf = epi_count % self.epi_stages
                for v in cutlass.range_constexpr(cute.size(tRS_rD)):
                    tRS_rD[v] = tRS_rAcc[epi * cute.size(tRS_rD) + v]
                self.epilogue_transform(tRS_rD, tRS_rOut)
                cute.copy(r2s, tRS_rOut, tRS_sC[None, None, None, buf])
                self.epi_barrier.arrive_and_wait()
                # (epi_m, epi_n) sub-tile of C and of its coordinates
                tSgC = thr_s2g.partition_D(cute.local_tile(gC, self.epi_tile, (0, epi)))
                tScC = thr_s2g.partition_D(cute.local_tile(cC, self.epi_tile, (0, epi)))
                for i in cutlass.range_constexpr(cute.size(tSgC, mode=[1])):
                    for j in cutlass.range_constexpr(cute.size(tSgC, mode=[2])):
                        crd = tScC[0, i, j]
                        if crd[0] < rows_valid and crd[1] < mC.shape[1]:
                            cute.autovec_copy(tSsC[None, i, j, buf], tSgC[None, i, j])
                epi_count += 1
            t += grid

    def epilogue_transform(self, tRS_rD, tRS_rOut):
        """fp32 accumulators -> output dtype (subclasses fuse an activation here)."""
        tRS_rOut.store(tRS_rD.load().to(self.c_dtype))

    def make_store_copy(self):
        """16-byte vectors, rows of the epilogue tile spread over the MMA threads."""
        vec = 128 // self.c_dtype.width
        per_row = self.epi_tile[1] // vec
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.c_dtype,
                                   num_bits_per_copy=128)
        return cute.make_tiled_copy_tv(
            atom,
            cute.make_layout((self.num_mma_threads // per_row, per_row), stride=(per_row, 1)),
            cute.make_layout((1, vec)))


# ------------------------------------------------------------------ torch side
_TORCH_TO_CUTE = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
                  torch.float32: cutlass.Float32}


def _fake_args(a_dtype, c_dtype, a_k_major: bool, b_n_major: bool):
    """Symbolic (M, K), (E, K, N), (M, N), (E,) tensors with 16-byte strides."""
    m, k, n, e = kcompile.sym_dims(4)
    div = 8
    s = lambda: cute.sym_int64(divisibility=div)  # noqa: E731
    f = cute.runtime.make_fake_tensor
    a = f(a_dtype, (m, k), (s(), 1) if a_k_major else (1, s()), assumed_align=16)
    b = f(a_dtype, (e, k, n), (s(), s(), 1) if b_n_major else (s(), 1, s()), assumed_align=16)
    c = f(c_dtype, (m, n), (s(), 1), assumed_align=16)
    offs = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (e,), assumed_align=4)
    return a, b, c, offs


def _is_k_major(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 or t.shape[-1] == 1


@torch.compiler.disable
def compiled_kernel(config: TileConfig, a_dtype, c_dtype, a_k_major: bool, b_n_major: bool,
                    kernel_cls=GroupedGemmSm90):
    key = (kernel_cls.__name__, config, str(a_dtype), str(c_dtype), a_k_major, b_n_major, "sm_90a")

    def build():
        ca, cc = _TORCH_TO_CUTE[a_dtype], _TORCH_TO_CUTE[c_dtype]
        return kernel_cls(config), (*_fake_args(ca, cc, a_k_major, b_n_major),
                                    cutlass.Int32(1), kcompile.fake_stream())

    return kcompile.get_compiled(key, build)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                 out_dtype: torch.dtype | None = None, config: TileConfig | None = None,
                 kernel_cls=GroupedGemmSm90) -> torch.Tensor:
    """Launch the kernel on the current stream; arguments already validated.

    ``config`` overrides :func:`choose_config` (benchmarks, tests).
    """
    m, k = a.shape
    num_experts, _, n = b.shape
    out = torch.empty(m, n, dtype=out_dtype or a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0 or num_experts == 0:
        return out.zero_()
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"the sm_90 kernel supports up to {MAX_EXPERTS} experts, got {num_experts}")
    cfg = config or choose_config(num_experts, n, k, m)
    fn = compiled_kernel(cfg, a.dtype, out.dtype, _is_k_major(a), _is_k_major(b), kernel_cls)
    fn(a, b, out, offs, _num_sms(a.device.index))
    return out
