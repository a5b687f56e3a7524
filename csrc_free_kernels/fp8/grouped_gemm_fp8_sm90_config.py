"""Tile configurations of the FP8 grouped GEMM (sm_90a) and the heuristic that picks one.

Every configuration is a :class:`~csrc_free_kernels.hopper.grouped_gemm_sm90_config.TileConfig` with
``tile_k = 128``: an e4m3 row of 128 elements is one 128-byte swizzle atom (as a bf16
``tile_k = 64`` row is), so the weight-part split rules of the bf16 family hold, and one
ring stage is exactly one 128-K scale block of the blockwise recipe.

The tiles follow the register budget of two accumulators per thread (the fp32 sum and the
WGMMA's partial; ``bench/notes/2026-12-05-fp8-sm90-register-budget.md``): 64 x 128 per MMA
warpgroup at most (64 x 256 needs 255 registers and spills), so 128 x 128 with two
warpgroups for many rows, and no ping-pong (a whole 128 x 128 tile per warpgroup is 256
accumulator registers).
A tile's columns lie in one 128-column scale block of the weights (``tile_n <= 128``).

The heuristic repeats the bf16 kernel's rules on the FP8 tiles; it has not been measured
on a GPU (no FP8 run yet).
"""

import dataclasses

from ..common.formats import FORMATS
from ..hopper.grouped_gemm_sm90_config import TileConfig

# the scale pairs, by the plain names the kernels take (ts_moe's parsed pair is a str enum
# of these names: the kernels do not import ts_moe)
RECIPES = ("blockwise", "rowwise", "tensorwise")
# the blockwise recipe's scale block (its weights' format): 128 K (a ring stage) by 128
# weight rows
SCALE_BLOCK = FORMATS["blockwise_128x128"].block[1]
# the blockwise tokens' scales: M-major, the rows padded to this many (one 16-byte column)
SCALE_A = FORMATS["blockwise_1x128"]

# Decode: a 16-row token box on a 64 x 128 tile (one MMA warpgroup), eight 24 KB stages;
# the same ring bytes as the bf16 decode16, so the weights stream as deep
DECODE16 = TileConfig("fp8_decode16", tile_m=64, tile_n=128, tile_k=128, stages=8, b_warps=2,
                      a_rows=16)
# ...on 64-column tiles (one weight warp), twelve 16 KB stages: twice the tiles where
# 128-column ones leave SMs idle (a few touched experts)
DECODE16_N64 = TileConfig("fp8_decode16_n64", tile_m=64, tile_n=64, tile_k=128, stages=12,
                          b_warps=1, a_rows=16)
# Few rows per expert (6..48): the whole 64-row token tile
DECODE = TileConfig("fp8_decode", tile_m=64, tile_n=128, tile_k=128, stages=8, b_warps=2)
# 48..~100 rows per expert: one 128-row tile holds an expert's rows, two MMA warpgroups
# (one promotes while the other's WGMMAs run), six 32 KB stages
MID = TileConfig("fp8_mid", tile_m=128, tile_n=128, tile_k=128, stages=6, b_warps=2)
# Prefill: the same tile in raster bands of 8 m-tiles (token rows stay in L2)
PREFILL = dataclasses.replace(MID, name="fp8_prefill", band_m=8)
# ...with CTA pairs multicasting each weight tile: a 128 x 128 FP8 tile moves 0.67x the
# operand bytes per FLOP of the bf16 128 x 256 one, at twice the FLOP rate
PREFILL_C2 = dataclasses.replace(PREFILL, name="fp8_prefill_c2", cluster_m=2)

CONFIGS = {c.name: c for c in (DECODE16, DECODE16_N64, DECODE, MID, PREFILL, PREFILL_C2)}


def _slot_fill(tiles: int, num_sms: int) -> float:
    """The share of the SMs' tile slots that ``tiles`` tiles keep busy over their waves."""
    return tiles / max(-(-tiles // num_sms) * num_sms, 1)


def choose_config(num_experts: int, n: int, k: int, m: int, *, recipe: str = "blockwise",
                  swiglu: bool = False, num_sms: int = 132) -> TileConfig:
    """Tiles from shapes only (no sync): rows per expert ``m / num_experts``, ``n`` the
    weight's columns (``2I`` for the fused SwiGLU), ``k``.

    The bf16 kernel's measured rules (``grouped_gemm_sm90_config.choose_config``) on the FP8
    tiles: a 16-row token box for a few rows per expert (64 columns where 128-column
    tiles fill the SMs' slots markedly worse), the 64-row tile below 48 rows, 128-row
    tiles above (one per expert while that leaves under four waves), CTA pairs sharing
    weight tiles once experts hold thousands of rows.  ``recipe`` and ``swiglu`` do not
    change the tiles (every configuration serves every recipe); they are arguments so
    that a measured rule can depend on them without changing the callers.
    """
    del recipe, swiglu

    def tiles(cfg, experts=num_experts, m_tiles=1):
        return -(-n // cfg.tile_n) * experts * m_tiles

    rows = m / max(num_experts, 1)
    if rows < 6:
        touched = min(num_experts, m)
        fill = [_slot_fill(tiles(cfg, touched), num_sms) for cfg in (DECODE16, DECODE16_N64)]
        return DECODE16_N64 if fill[1] > fill[0] + 0.05 else DECODE16
    if rows < 48:
        return DECODE
    if tiles(PREFILL, m_tiles=max(round(rows / PREFILL.tile_m), 1)) / num_sms < 4:
        return MID
    if rows >= 2048 or (rows >= 1024 and k >= 8192):
        return PREFILL_C2
    return PREFILL


def swiglu_supported(two_i: int, recipe: str, config: TileConfig | None = None) -> bool:
    """Whether the fused SwiGLU kernel runs with ``config`` (None: with every
    configuration :func:`choose_config` may pick): a tile's gate and up parts must be
    whole (``I`` a multiple of ``tile_n / 2``) and, blockwise, each part must lie in one
    128-row scale block of ``gate_up`` (``I`` a multiple of 128)."""
    inter = two_i // 2
    half = max(c.tile_n for c in CONFIGS.values()) // 2 if config is None else config.tile_n // 2
    if two_i % 2 or inter % half:
        return False
    return recipe != "blockwise" or inter % SCALE_BLOCK == 0
