"""FP8 (e4m3 x e4m3) ragged grouped GEMM for Hopper (sm_90a), scaled per recipe.

``out[r] = sum_k a[r, k] * b[e][k, :] * scales`` for the rows ``r`` of expert ``e`` (``offs``
read on the device), zeros for the rows past the last expert: the Hopper grouped GEMM
(:class:`~csrc_free_kernels.hopper.grouped_gemm_sm90.GroupedGemmSm90`: persistent, warp-specialized,
several TMA producer warps per stage under one full barrier, the ragged schedule) with an
FP8 WGMMA mainloop that accumulates in two fp32 accumulators.

Scale layouts the kernel reads (``M`` token rows, ``KB = ceil(K / 128)``, ``E`` experts):

- ``blockwise``: ``sfa`` (M, KB) fp32, **M-major** (stride ``(1, Mp)``, ``Mp % 4 == 0``:
  TMA reads a k-block's column of a tile's scales as one box, from the tile's first row
  rounded down to a multiple of 4: a box's innermost start must be 16-byte aligned,
  ``bench/notes/2026-12-05-fp8-scale-box-alignment.md``); ``sfb`` (E, N/128, KB) fp32,
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
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from .grouped_gemm_fp8_sm90_config import RECIPES, SCALE_A, SCALE_BLOCK
from ..hopper.grouped_gemm_sm90 import GroupedGemmSm90, GroupedGemmSwigluSm90, Warp
from ..hopper.grouped_gemm_sm90_config import SMEM_CAPACITY, TileConfig
from ..hopper.sm90_epilogue import MmaOperands
from ..common.tile_schedule import WorkTile

# fp32 activation scales per 16 bytes: the scale box starts on a multiple of this row
# (TMA refuses a box whose innermost start is not 16-byte aligned); the format pads its
# rows to the same multiple
SFA_ALIGN = SCALE_A.row_align


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


class ScaleParams(NamedTuple):
    """The FP8 kernel's ``extra`` (the hooks' parameter of
    :class:`~csrc_free_kernels.hopper.grouped_gemm_sm90.GroupedGemmSm90`): its kernel
    parameters, then what the kernel binds to them."""

    tma_atom: object          # blockwise: TMA of a k-block's activation scales (else unused)
    sfa_tma: object           # its (M, KB) tensor (else sfa)
    sfa: object
    sfb: object
    smem_layout: object       # (tile_m, 1, stages): the stages' activation scales
    smem: object = None       # ...that buffer (bind_shared)
    part: object = None       # the MMA thread's partial accumulator (bind_mma)
    coords: object = None     # its (row, col) per accumulator element (bind_mma)
    fmap: object = None       # the static FragmentScaleMap (bind_mma)


class GroupedGemmFp8Sm90(GroupedGemmSm90):
    """Persistent ragged grouped GEMM on e4m3 tokens and weights, fp32 accumulation.

    The roles, ring, schedule and epilogue are the base kernel's (LOAD_A loads the token
    box and arms each stage, the LOAD_B warps the weight parts, SCHEDULE builds the
    schedule, one or two MMA warpgroups); weights K-major only (``MmaF8Op`` reads both operands
    K-major: the (E, K, N) transpose view of the (E, N, K) checkpoint stack).  What differs
    lives in the base kernel's hooks, with the scales as their ``extra``
    (:class:`ScaleParams`).

    ``recipe`` blockwise: LOAD_A also loads the k-block's column of activation scales
    (``rows + 4`` fp32 from the tile's first row rounded down to a multiple of 4, one TMA
    box of the M-major ``sfa``: :meth:`sfa_box_start`) into the stage, so the scales ride
    under the stage's one armed byte count (:meth:`load_a`).  Per stage, an MMA warpgroup
    issues four k32 WGMMAs into ``part`` (the first overwriting it), waits for them, reads
    its two rows' scales from the stage (``row0 % 4`` further on: :meth:`sfa_row_shift`),
    gives the stage back and promotes:
    ``acc += part * (sfa[row] * sfb[e, block, kb])`` (``sfb`` a uniform global load issued
    before the stage wait; :meth:`mainloop`).  With two warpgroups on a 128-row tile one
    promotes while the other's WGMMAs run: within one warpgroup, keeping a second partial
    in flight makes ptxas serialize the WGMMAs (C7514).  A warpgroup whose rows are all
    past the expert's end skips its WGMMAs and promotion, as in the base kernel.

    ``rowwise`` / ``tensorwise``: the same mainloop with ``acc += part``; before the
    epilogue each accumulator is multiplied by ``sfa[row] * sfb[e, col]`` (or the two
    scalars; :meth:`scale_accumulators`).

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

    @property
    def sfa_box_rows(self) -> int:
        """Blockwise: the rows of one activation-scale box, the tile's token rows and
        the up to 3 rows before them that the aligned start takes in."""
        return self.cfg.rows + SFA_ALIGN

    @property
    def sfa_stage_words(self) -> int:
        """Blockwise: fp32 words of one stage's scale column, a 128-byte multiple (a TMA
        destination's alignment) that holds the box and the tile's rows read from
        :meth:`sfa_row_shift` on."""
        rows = max(self.cfg.tile_m + SFA_ALIGN - 1, self.sfa_box_rows)
        return -(-rows // 32) * 32

    @staticmethod
    def sfa_box_start(row0):
        """The scale box's first row for a tile starting at ``row0``: a multiple of
        :data:`SFA_ALIGN` (a Python int or a DSL Int32 alike)."""
        return row0 & -SFA_ALIGN

    @staticmethod
    def sfa_row_shift(row0):
        """Where tile row 0's scale lies in the stage's box: ``row0 - sfa_box_start``."""
        return row0 & (SFA_ALIGN - 1)

    # ---------------------------------------------------------------- host
    def _setup(self, a_dtype, c_dtype, a_layout, b_layout, c_layout):
        if not b_layout.is_k_major_b():
            raise ValueError("FP8 weights are read K-major: pass the (E, N, K) stack's "
                             "transpose(-2, -1) view")
        super()._setup(a_dtype, c_dtype, a_layout, b_layout, c_layout)
        cfg = self.cfg
        # (sfa_stage_words, 1, stages) fp32: a stage's activation scales, the first
        # ``sfa_box_rows`` filled by TMA
        self.sfa_bytes = self.sfa_box_rows * 4 if self.blockwise else 0
        self.stage_bytes += self.sfa_bytes
        words = self.sfa_stage_words if self.blockwise else 32
        per_stage = words * 4 if self.blockwise else 0
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
        self.sfa_smem_layout = cute.make_layout((words, 1, self.stages), stride=(1, 0, words))

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB_ekn: cute.Tensor, mC: cute.Tensor,
                 mOffs: cute.Tensor, mSFA: cute.Tensor, mSFB: cute.Tensor,
                 num_ctas: cutlass.Int32, stream):
        """mA (M, K) e4m3, mB_ekn (E, K, N) e4m3 K-major, mC (M, N'), mOffs (E,), the
        scales in the recipe's layout (module docstring)."""
        self.launch(mA, mB_ekn, mC, mOffs, (mSFA, mSFB), num_ctas, stream)

    def pair_params(self, mB, tma_atom_b, mB_tma) -> tuple:
        """None: no pair_tiles here."""
        return ()

    def extra_params(self, tma_atom_a, mSFA, mSFB) -> ScaleParams:
        """The scales; blockwise with the TMA atom of a k-block's activation scales,
        a (sfa_box_rows, 1) box of the M-major (M, KB) ``sfa``.  The other recipes pass
        the token atom and ``sfa`` in its place, unused."""
        tma_atom_s, mSFA_tma = tma_atom_a, mSFA
        if cutlass.const_expr(self.blockwise):
            box = (self.sfa_box_rows, 1)
            tma_atom_s, mSFA_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mSFA, cute.make_layout(box), box)
        return ScaleParams(tma_atom_s, mSFA_tma, mSFA, mSFB, self.sfa_smem_layout)

    def shared_buffers(self) -> dict:
        """The stages' activation scales (``sSFA``; one 32-word block, unused, for
        the recipes without), ahead of the base kernel's buffers."""
        words = cute.cosize(self.sfa_smem_layout) if self.blockwise else 32
        return {"sSFA": (cutlass.Float32, words), **super().shared_buffers()}

    # ----------------------------------------------------- device: producers
    @cute.jit
    def prefetch_extra(self, extra: ScaleParams):
        if cutlass.const_expr(self.blockwise):
            cpasync.prefetch_descriptor(extra.tma_atom)

    def bind_shared(self, storage, extra: ScaleParams) -> ScaleParams:
        return extra._replace(smem=storage.sSFA.get_tensor(extra.smem_layout))

    @cute.jit
    def load_stage(self, warp_idx, k, stage, bar, a_load, b_load, issued, extra):
        # the loading warps are LOAD_A and the LOAD_B warps: one test tells them
        # apart (the branch these builds compile; no weight prefetch to count)
        if warp_idx == Warp.LOAD_A:
            self.load_a(*a_load, k, stage, bar, extra)
        else:
            self.load_weights(warp_idx, k, stage, bar, b_load)
        return issued

    def token_tiles(self, tma_atom_a, mA, sA_box, row0, extra: ScaleParams) -> tuple:
        """The base kernel's token partitions ``(dst, src)``, then the same of the
        stages' scale columns and, blockwise, of the (sfa_box_rows, 1, k-blocks)
        activation scales from :meth:`sfa_box_start` (else the token partitions again)."""
        tAsA, tAgA = super().token_tiles(tma_atom_a, mA, sA_box, row0, extra)
        tSsS, tSgS = tAsA, tAgA
        if cutlass.const_expr(self.blockwise):
            box = (self.sfa_box_rows, 1)
            # (sfa_box_rows, 1, stages): the filled rows of each stage's scale column
            sS_box = cute.flat_divide(extra.smem, box)[None, None, 0, 0, None]
            gS = cute.local_tile(
                cute.domain_offset((self.sfa_box_start(row0), 0), extra.sfa_tma), box,
                (0, None))
            tSsS, tSgS = cpasync.tma_partition(
                extra.tma_atom, 0, cute.make_layout(1),
                cute.group_modes(sS_box, 0, 2), cute.group_modes(gS, 0, 2))
        return tAsA, tAgA, tSsS, tSgS

    @cute.jit
    def load_a(self, tma_atom_a, a_tiles, k, stage, bar, extra: ScaleParams):
        """The token box and, blockwise, the k-block's activation scales: two TMA
        loads under the stage's one armed byte count (``stage_bytes``)."""
        tAsA, tAgA, tSsS, tSgS = a_tiles
        cute.copy(tma_atom_a, tAgA[None, k], tAsA[None, stage], tma_bar_ptr=bar)
        if cutlass.const_expr(self.blockwise):
            cute.copy(extra.tma_atom, tSgS[None, k], tSsS[None, stage], tma_bar_ptr=bar)

    # ------------------------------------------------- device: MMA warpgroups
    def bind_mma(self, tiled_mma, acc, ctid, extra: ScaleParams) -> ScaleParams:
        """With the partial accumulator, the thread's (row, col) per accumulator
        element and the static scale map."""
        return extra._replace(part=cute.make_rmem_tensor(acc.layout, self.acc_dtype),
                              coords=self.tile_coords(tiled_mma, ctid),
                              fmap=self.fragment_scale_map(tiled_mma))

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

    @cute.jit
    def mainloop(self, tiled_mma, ops: MmaOperands, ring, read, release, k_tiles, mma_rows,
                 wg_row0, tile: WorkTile, n_cols, extra: ScaleParams):
        """Per stage: four k32 WGMMAs into ``part``, waited for, the stage given
        back, then promoted into ``acc`` (blockwise times ``sfa[row] * sfb``, else
        as they are).  Each stage is released as soon as its WGMMAs are done:
        ``release`` is returned as it came."""
        acc, part, cC, fmap = ops.acc, extra.part, extra.coords, extra.fmap
        tCrA, tCrB, sSFA = ops.a, ops.b, extra.smem
        n_slots = len(fmap.row_rep)
        shift = 0
        if cutlass.const_expr(self.blockwise):
            shift = self.sfa_row_shift(tile.row0)  # tile row 0's place in the scale box
        k_blocks = cute.size(tCrA, mode=[2])
        for k in cutlass.range(k_tiles, unroll=1):
            sb = [cutlass.Float32(1.0)]
            if cutlass.const_expr(self.blockwise):
                sb = self.load_sfb(extra.sfb, tile.expert, tile.n_tile, n_cols, k)
            ring.consumer_wait(read)
            if mma_rows > wg_row0:
                warpgroup.fence()
                for kb in cutlass.range_constexpr(k_blocks):
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, kb > 0)
                    cute.gemm(tiled_mma, part, tCrA[None, None, kb, read.index],
                              tCrB[None, None, kb, read.index], part)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                if cutlass.const_expr(self.blockwise):
                    # scale_a of the thread's rows in this stage, times scale_b
                    sa = [sSFA[cC[fmap.row_rep[h]][0] + shift, 0, read.index]
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
        return read, release

    def load_sfb(self, mSFB, expert, n_tile, n_cols, k):
        """Blockwise: the tile's weight scales of k-block ``k``, one per scale part."""
        return [mSFB[expert, self.scale_block_row(n_tile, p, n_cols) // SCALE_BLOCK, k]
                for p in range(self.scale_parts)]

    @cute.jit
    def scale_accumulators(self, acc, tile: WorkTile, n_cols, extra: ScaleParams):
        """Rowwise: ``acc[i] *= sfa[row] * sfb[e, col]`` (weight column ``col`` of the
        element's part, row and column clamped in bounds: rows past M and columns past N
        are never stored); tensorwise: ``acc *= sfa[0] * sfb[e]``; blockwise: nothing
        (the mainloop applied the scales)."""
        mSFA, mSFB, cC, fmap = extra.sfa, extra.sfb, extra.coords, extra.fmap
        expert, row0, _, n_tile = tile
        if cutlass.const_expr(self.recipe == "tensorwise"):
            s = mSFA[0] * mSFB[expert]
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] * s
        elif cutlass.const_expr(self.recipe == "rowwise"):
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

