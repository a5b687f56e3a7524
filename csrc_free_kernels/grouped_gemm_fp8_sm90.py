"""FP8 (e4m3 x e4m3) ragged grouped GEMM for Hopper (sm_90a), scaled per recipe.

``out[r] = sum_k a[r, k] * b[e][k, :] * scales`` for the rows ``r`` of expert ``e`` (``offs``
read on the device), zeros for the rows past the last expert: the Hopper grouped GEMM
(:class:`~csrc_free_kernels.grouped_gemm_sm90.GroupedGemmSm90`: persistent, warp-specialized,
several TMA producer warps per stage under one full barrier, the ragged schedule) with an
FP8 WGMMA mainloop that accumulates in two fp32 accumulators.

Scale layouts the kernel reads (``M`` token rows, ``KB = ceil(K / 128)``, ``E`` experts):

- ``blockwise``: ``sfa`` (M, KB) fp32, **M-major** (stride ``(1, Mp)``, ``Mp % 4 == 0``:
  TMA reads a k-block's column of ``rows`` scales as one box); ``sfb`` (E, N/128, KB) fp32,
  any strides.  Every 128 K (one ring stage) the partial accumulator is promoted into the
  fp32 one with ``sfa[row, kb] * sfb[e, n // 128, kb]``.
- ``rowwise``: ``sfa`` (M,), ``sfb`` (E, N); ``tensorwise``: ``sfa`` (1,), ``sfb`` (E,).
  The partial accumulator is added every 128 K unscaled; the scales multiply the sum before
  the epilogue.

The reason for two accumulators: the WGMMA's FP8 accumulation keeps about 14 bits
(DeepSeek-V3 report, section 3.3), so the partial sums are moved into fp32 FFMAs every four
k32 WGMMAs.  Register budgets and tile limits:
``bench/notes/2026-12-05-fp8-sm90-register-budget.md``.
"""

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cp
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from . import pdl
from .grouped_gemm_fp8_sm90_config import RECIPES, SCALE_BLOCK
from .grouped_gemm_sm90 import GroupedGemmSm90, GroupedGemmSwigluSm90, Warp
from .grouped_gemm_sm90_config import SMEM_CAPACITY, TileConfig
from .sm90_epilogue import mma_operands, stage_to_shared
from .tile_schedule import TileScheduler


@dataclasses.dataclass(frozen=True)
class FragmentScaleMap:
    """Which scale an MMA thread's accumulator element takes, the same for every thread
    (thread offsets only move rows and columns inside these classes).

    ``row_slot[i]``: the index, among the thread's distinct tile rows, of element ``i``'s
    row; ``row_rep[h]``: the first element on row slot ``h`` (whose coordinate gives the
    row); ``part[i]``: the weight scale block (of the tile's ``scale_parts``) of element
    ``i``'s column.  Built from the MMA's partition of the tile by :meth:`from_coords`.
    """

    row_slot: tuple
    row_rep: tuple
    part: tuple

    @staticmethod
    def from_coords(coords: list, part_cols: int) -> "FragmentScaleMap":
        """From one thread's ``(row, col)`` per accumulator element; ``part_cols``
        tile columns per weight scale block."""
        rows = []
        for r, _ in coords:
            if r not in rows:
                rows.append(r)
        slot = tuple(rows.index(r) for r, _ in coords)
        rep = tuple(slot.index(h) for h in range(len(rows)))
        return FragmentScaleMap(slot, rep, tuple(c // part_cols for _, c in coords))


class GroupedGemmFp8Sm90(GroupedGemmSm90):
    """Persistent ragged grouped GEMM on e4m3 tokens and weights, fp32 accumulation.

    The roles, ring, schedule and epilogue are the base kernel's (LOAD_A loads the token
    box and arms each stage, the LOAD_B warps the weight parts, SCHEDULE builds the
    schedule, one or two MMA warpgroups); weights K-major only (``MmaF8Op`` reads both operands
    K-major: the (E, K, N) transpose view of the (E, N, K) checkpoint stack).

    ``recipe`` blockwise: LOAD_A also loads the k-block's column of activation scales
    (``rows`` fp32, one TMA box of the M-major ``sfa``) into the stage, so the scales ride
    under the stage's one armed byte count.  Per stage, an MMA warpgroup issues four k32
    WGMMAs into ``part`` (the first overwriting it), waits for them, reads its two rows'
    scales from the stage, gives the stage back and promotes:
    ``acc += part * (sfa[row] * sfb[e, block, kb])`` (``sfb`` a uniform global load issued
    before the stage wait).  With two warpgroups on a 128-row tile one promotes while the
    other's WGMMAs run: within one warpgroup, keeping a second partial in flight makes
    ptxas serialize the WGMMAs (C7514).  A warpgroup whose rows are all past the expert's
    end skips its WGMMAs and promotion, as in the base kernel.

    ``rowwise`` / ``tensorwise``: the same mainloop with ``acc += part``; before the
    epilogue each accumulator is multiplied by ``sfa[row] * sfb[e, col]`` (or the two
    scalars).

    Not supported here: ``pair_tiles`` (refused) and the weight prefetch under PDL.
    """

    def __init__(self, config: TileConfig, recipe: str = "blockwise", acc_dtype=cutlass.Float32):
        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
        if config.tile_k != SCALE_BLOCK:
            raise ValueError(f"FP8 tiles are {SCALE_BLOCK} deep (one scale block): {config}")
        if config.pair_tiles:
            raise ValueError(f"the FP8 kernel runs cluster tiles, not pair_tiles: {config}")
        if config.tile_n > SCALE_BLOCK or SCALE_BLOCK % config.tile_n:
            raise ValueError(f"an FP8 tile's columns must lie in one {SCALE_BLOCK}-column "
                             f"scale block: {config}")
        super().__init__(config, acc_dtype)
        self.recipe = recipe
        self.blockwise = recipe == "blockwise"

    @property
    def scale_parts(self) -> int:
        """Weight scale blocks per tile: one (the tile's columns lie in one block)."""
        return 1

    def scale_block_row(self, n_tile, part, n_cols):
        """First weight row of the tile's scale part ``part`` (its block is ``// 128``)."""
        return n_tile * self.cfg.tile_n

    # ---------------------------------------------------------------- host
    def _setup(self, a_dtype, c_dtype, a_layout, b_layout, c_layout):
        if not b_layout.is_k_major_b():
            raise ValueError("FP8 weights are read K-major: pass the (E, N, K) stack's "
                             "transpose(-2, -1) view")
        super()._setup(a_dtype, c_dtype, a_layout, b_layout, c_layout)
        cfg = self.cfg
        # (tile_m, 1, stages) fp32: a stage's activation scales, the first ``rows``
        # filled by TMA (a 128-byte multiple per stage: a TMA destination's alignment)
        self.sfa_bytes = cfg.rows * 4 if self.blockwise else 0
        self.stage_bytes += self.sfa_bytes
        per_stage = max(cfg.tile_m, 32) * 4 if self.blockwise else 0
        stage_smem = (cfg.tile_m + cfg.tile_n) * cfg.tile_k * a_dtype.width // 8 + per_stage
        fixed = (cute.cosize(self.epi_smem_layout) * c_dtype.width // 8
                 + 8 * self.schedule.table_words + 4 * 1024)
        stages = min(self.stages, (SMEM_CAPACITY - fixed) // stage_smem)
        if stages != self.stages:
            if stages < 2:
                raise ValueError(f"{cfg} leaves room for {stages} stages")
            self.stages = stages
            self.a_smem_layout = sm90_utils.make_smem_layout_a(
                a_layout, self.tile_shape_mnk, a_dtype, stages)
            self.b_smem_layout = sm90_utils.make_smem_layout_b(
                b_layout, self.tile_shape_mnk, a_dtype, stages)
        self.sfa_smem_layout = cute.make_layout(
            (max(cfg.tile_m, 32), 1, self.stages), stride=(1, 0, max(cfg.tile_m, 32)))

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB_ekn: cute.Tensor, mC: cute.Tensor,
                 mOffs: cute.Tensor, mSFA: cute.Tensor, mSFB: cute.Tensor,
                 num_ctas: cutlass.Int32, stream):
        """mA (M, K) e4m3, mB_ekn (E, K, N) e4m3 K-major, mC (M, N'), mOffs (E,), the
        scales in the recipe's layout (module docstring)."""
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
        # blockwise: a k-block's activation scales, (rows, 1) of the M-major (M, KB) sfa
        tma_atom_s, mSFA_tma = tma_atom_a, mSFA
        if cutlass.const_expr(self.blockwise):
            tma_atom_s, mSFA_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mSFA,
                cute.make_layout((cfg.rows, 1)), (cfg.rows, 1))
        sfa_words = cute.cosize(self.sfa_smem_layout) if self.blockwise else 32

        @cute.struct
        class SharedStorage:
            ring_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            seg_end: cute.struct.MemRange[cutlass.Int32, self.schedule.table_words]
            tile_end: cute.struct.MemRange[cutlass.Int32, self.schedule.table_words]
            sSFA: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, sfa_words], 1024]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_layout)], 1024]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_layout)], 1024]
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_atom_a, mA_tma, tma_atom_b, mB_tma, tma_atom_s, mSFA_tma, mSFA, mSFB, mC, mOffs,
            self.tiled_mma, self.a_smem_layout, self.b_smem_layout, self.epi_smem_layout,
            self.sfa_smem_layout,
        ).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1),
                 cluster=(cfg.cluster_m, 1, 1), min_blocks_per_mp=1, stream=stream,
                 use_pdl=pdl.ENABLED)

    # -------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA: cute.Tensor, tma_atom_b: cute.CopyAtom,
               mB: cute.Tensor, tma_atom_s: cute.CopyAtom, mSFA_tma: cute.Tensor,
               mSFA: cute.Tensor, mSFB: cute.Tensor, mC: cute.Tensor, mOffs: cute.Tensor,
               tiled_mma: cute.TiledMma, a_smem_layout: cute.ComposedLayout,
               b_smem_layout: cute.ComposedLayout, epi_smem_layout, sfa_smem_layout):
        cfg = self.cfg
        pdl.enter()  # before the first global access (offs, tokens, weights, scales, out)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        sched = TileScheduler.create(self.schedule, cta_rank, bidx, grid)
        if warp_idx == Warp.LOAD_A:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            if cutlass.const_expr(self.blockwise):
                cpasync.prefetch_descriptor(tma_atom_s)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        m_rows, n_cols = mC.shape
        sched = sched.bind(storage, mOffs.shape[0], n_cols, self.out_tile_n)
        k_tiles = (mA.shape[1] + cfg.tile_k - 1) // cfg.tile_k
        if warp_idx == Warp.SCHEDULE:
            sched.build(mOffs, m_rows)
        cute.arch.sync_threads()  # the schedule, for every role

        ring = self.make_ring(storage.ring_barriers.data_ptr(), warp_idx)  # syncs the cluster
        sched = sched.with_total()

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sC = self.epilogue_buffers(storage, epi_smem_layout)
        sSFA = storage.sSFA.get_tensor(sfa_smem_layout)

        if warp_idx < Warp.MMA:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx <= Warp.LOAD_B + cfg.b_warps - 1:
                self.produce(tma_atom_a, mA, tma_atom_b, mB, tma_atom_s, mSFA_tma, sA, sB, sSFA,
                             ring, warp_idx, sched, k_tiles, n_cols)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume(tiled_mma, mC, mSFA, mSFB, sA, sB, sC, sSFA, ring,
                         tidx - 32 * Warp.MMA, sched, k_tiles)

    @cute.jit
    def produce(self, tma_atom_a, mA, tma_atom_b, mB, tma_atom_s, mSFA, sA, sB, sSFA, ring,
                warp_idx, sched: TileScheduler, k_tiles, n_cols):
        """LOAD_A: each stage's token box (and, blockwise, its k-block of activation
        scales), arming the stage with all its bytes; the LOAD_B warps: a weight part
        each (:meth:`GroupedGemmSm90.load_b`)."""
        cfg = self.cfg
        cta_rank, lead, total_tiles = sched.cta_rank, sched.lead, sched.total_tiles
        sA_box = cute.flat_divide(sA, (cfg.rows, cfg.tile_k))[None, None, 0, 0, None]
        # (rows, 1, stages): the filled rows of each stage's scale column
        sS_box = cute.flat_divide(sSFA, (cfg.rows, 1))[None, None, 0, 0, None]
        sB_parts = cute.flat_divide(sB, (self.b_part_n, cfg.tile_k))
        gB = cute.local_tile(mB, (self.b_part_n, cfg.tile_k), (None, None, None))
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, cta_rank, cute.make_layout(cfg.cluster_m),
            cute.group_modes(sB_parts, 0, 2), cute.group_modes(gB, 0, 2))
        state = cp.make_pipeline_state(cp.PipelineUserType.Producer, self.stages)
        t = sched.first
        while t - lead < total_tiles:
            expert, row0, _, n_tile = sched.work_tile(cutlass.min(t, total_tiles - 1))
            if expert < sched.num_experts:
                gA = cute.local_tile(cute.domain_offset((row0, 0), mA),
                                     (cfg.rows, cfg.tile_k), (0, None))
                tAsA, tAgA = cpasync.tma_partition(
                    tma_atom_a, 0, cute.make_layout(1),
                    cute.group_modes(sA_box, 0, 2), cute.group_modes(gA, 0, 2))
                tSsS, tSgS = tAsA, tAgA
                if cutlass.const_expr(self.blockwise):
                    # (rows, 1, k-blocks) of scales starting at row0
                    gS = cute.local_tile(cute.domain_offset((row0, 0), mSFA), (cfg.rows, 1),
                                         (0, None))
                    tSsS, tSgS = cpasync.tma_partition(
                        tma_atom_s, 0, cute.make_layout(1),
                        cute.group_modes(sS_box, 0, 2), cute.group_modes(gS, 0, 2))
                for k in cutlass.range(k_tiles, unroll=1):
                    ring.producer_acquire(state)
                    bar = ring.producer_get_barrier(state)
                    if warp_idx == Warp.LOAD_A:
                        cute.copy(tma_atom_a, tAgA[None, k], tAsA[None, state.index],
                                  tma_bar_ptr=bar)
                        if cutlass.const_expr(self.blockwise):
                            cute.copy(tma_atom_s, tSgS[None, k], tSsS[None, state.index],
                                      tma_bar_ptr=bar)
                    else:
                        self.load_b(tma_atom_b, tBgB, tBsB, tma_atom_b, tBgB, tBsB,
                                    cutlass.Int32(1), warp_idx - Warp.LOAD_B, n_tile, n_cols, k,
                                    expert, state.index, bar)
                    state.advance()
            t += sched.step
        ring.producer_tail(state)

    def tile_coords(self, tiled_mma, ctid):
        """MMA thread ``ctid``'s ``(row, col)`` in the tile of each accumulator element
        (compile-time integers for a Python ``ctid``: the CPU tests evaluate it so)."""
        return tiled_mma.get_slice(ctid).partition_C(
            cute.make_identity_tensor((self.cfg.tile_m, self.cfg.tile_n)))

    def fragment_scale_map(self, tiled_mma) -> FragmentScaleMap:
        """The static map of :class:`FragmentScaleMap`, from MMA thread 0's coordinates."""
        coords = self.tile_coords(tiled_mma, 0)
        return FragmentScaleMap.from_coords(
            [tuple(coords[i]) for i in range(cute.size(coords))],
            self.cfg.tile_n // self.scale_parts)

    def load_sfb(self, mSFB, expert, n_tile, n_cols, k):
        """Blockwise: the tile's weight scales of k-block ``k``, one per scale part."""
        return [mSFB[expert, self.scale_block_row(n_tile, p, n_cols) // SCALE_BLOCK, k]
                for p in range(self.scale_parts)]

    @cute.jit
    def consume(self, tiled_mma, mC, mSFA, mSFB, sA, sB, sC, sSFA, ring, ctid,
                sched: TileScheduler, k_tiles):
        """Each tile of the CTA's walk: the promoting mainloop, the recipe's epilogue
        scales, then the base kernel's epilogue (registers -> ``stmatrix`` -> 16-byte
        predicated stores of the expert's rows)."""
        cfg = self.cfg
        tCrA, tCrB, acc = mma_operands(tiled_mma, sA, sB, ctid, (cfg.tile_m, cfg.tile_n),
                                       self.acc_dtype)
        part = cute.make_rmem_tensor(acc.layout, self.acc_dtype)
        # this thread's (row, col) per accumulator element, and the static scale map
        cC = self.tile_coords(tiled_mma, ctid)
        fmap = self.fragment_scale_map(tiled_mma)
        n_slots = len(fmap.row_rep)
        k_blocks = cute.size(tCrA, mode=[2])

        staged = stage_to_shared(
            tiled_mma, acc, sC, ctid, self.c_layout, self.c_dtype, self.acc_dtype)
        stores = self.tile_stores(sC, ctid)
        wg_row0 = 0
        if cutlass.const_expr(cfg.mma_warpgroups > 1):
            wg_row0 = cute.arch.make_warp_uniform(ctid // 128) * 64

        read = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.stages)
        lead, total_tiles = sched.lead, sched.total_tiles
        n_cols = mC.shape[1]
        t = sched.first
        epi_count = cutlass.Int32(0)
        while t - lead < total_tiles:
            expert, row0, seg_end, n_tile = sched.work_tile(cutlass.min(t, total_tiles - 1))
            rows_valid = self.stored_rows(row0, seg_end, t, total_tiles)
            acc.fill(0.0)
            if expert < sched.num_experts:
                for k in cutlass.range(k_tiles, unroll=1):
                    sb = [cutlass.Float32(1.0)]
                    if cutlass.const_expr(self.blockwise):
                        sb = self.load_sfb(mSFB, expert, n_tile, n_cols, k)
                    ring.consumer_wait(read)
                    if rows_valid > wg_row0:
                        warpgroup.fence()
                        for kb in cutlass.range_constexpr(k_blocks):
                            tiled_mma.set(warpgroup.Field.ACCUMULATE, kb > 0)
                            cute.gemm(tiled_mma, part, tCrA[None, None, kb, read.index],
                                      tCrB[None, None, kb, read.index], part)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)
                        if cutlass.const_expr(self.blockwise):
                            # scale_a of the thread's rows in this stage, times scale_b
                            sa = [sSFA[cC[fmap.row_rep[h]][0], 0, read.index]
                                  for h in range(n_slots)]
                            ring.consumer_release(read)
                            scale = [[sa[h] * sb[p] for p in range(self.scale_parts)]
                                     for h in range(n_slots)]
                            for i in cutlass.range_constexpr(cute.size(acc)):
                                acc[i] = acc[i] + part[i] * scale[fmap.row_slot[i]][fmap.part[i]]
                        else:
                            ring.consumer_release(read)
                            for i in cutlass.range_constexpr(cute.size(acc)):
                                acc[i] = acc[i] + part[i]
                    else:
                        ring.consumer_release(read)
                    read.advance()
                if cutlass.const_expr(not self.blockwise):
                    self.scale_accumulators(acc, cC, fmap, mSFA, mSFB, expert, row0, n_tile,
                                            n_cols)

            epi_count = self.epilogue(staged, stores, mC, row0, n_tile, rows_valid, epi_count)
            t += sched.step

    @cute.jit
    def scale_accumulators(self, acc, cC, fmap: FragmentScaleMap, mSFA, mSFB, expert, row0,
                           n_tile, n_cols):
        """Rowwise: ``acc[i] *= sfa[row] * sfb[e, col]`` (weight column ``col`` of the
        element's part, row and column clamped in bounds: rows past M and columns past N
        are never stored); tensorwise: ``acc *= sfa[0] * sfb[e]``."""
        if cutlass.const_expr(self.recipe == "tensorwise"):
            s = mSFA[0] * mSFB[expert]
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] * s
        else:
            last_row = mSFA.shape[0] - 1
            last_col = mSFB.shape[1] - 1
            sa = [mSFA[cutlass.min(row0 + cC[fmap.row_rep[h]][0], last_row)]
                  for h in range(len(fmap.row_rep))]
            for i in cutlass.range_constexpr(cute.size(acc)):
                col = self.weight_column(cC[i][1], n_tile, n_cols)
                acc[i] = acc[i] * (sa[fmap.row_slot[i]] * mSFB[expert, cutlass.min(col, last_col)])

    def weight_column(self, col, n_tile, n_cols):
        """The weight column (row of the (E, N, K) stack) of tile column ``col``."""
        part = col // self.b_part_n
        return self.b_part_coord(n_tile, part, n_cols) * self.b_part_n + col % self.b_part_n


class GroupedGemmFp8SwigluSm90(GroupedGemmFp8Sm90, GroupedGemmSwigluSm90):
    """``silu(A @ gate^T) * (A @ up^T)`` per expert on FP8 operands: the FP8 mainloop and
    scales, the SwiGLU kernel's two weight parts (gate rows, the up rows ``I`` further on)
    and its epilogue (fp32 ``silu(gate) * up``, one rounding).  Blockwise, each part lies
    in one 128-row scale block of ``gate_up`` (``I % 128 == 0``, checked by the caller),
    so a tile takes two weight scales per k-block."""

    @property
    def scale_parts(self) -> int:
        return 2

    def scale_block_row(self, n_tile, part, n_cols):
        return self.b_part_coord(n_tile, part, n_cols) * self.b_part_n

