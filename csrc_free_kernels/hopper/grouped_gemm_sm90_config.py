"""Tile configurations of the Hopper grouped GEMM and the heuristic that picks one.

:class:`TileConfig` is one compiled configuration of
:class:`csrc_free_kernels.hopper.grouped_gemm_sm90.GroupedGemmSm90`; :func:`choose_config`
picks one from the shapes alone (no sync), :func:`swiglu_config` for the
fused SwiGLU kernel.
"""

import dataclasses
from dataclasses import dataclass

from ..common.kernel_config import Declined, KernelConfig

MAX_EXPERTS = 512
SMEM_CAPACITY = 227 * 1024


@dataclass(frozen=True)
class TileConfig(KernelConfig):
    """One compiled configuration of the kernel.

    ``tile_m`` is the MMA tile's rows, 64 per MMA warpgroup; ``a_rows`` (<=
    ``tile_m``, default ``tile_m``) the token rows a CTA loads and owns per
    tile: with few rows per expert, a 16-row token box spares L2 the 48 rows
    the tile would only discard (the MMA still runs 64 rows; the rows past
    ``a_rows`` are never stored).  ``b_warps`` producer warps share the weight
    tile, each loading ``tile_n / b_warps`` rows of it.  ``cluster_m`` 2 pairs
    CTAs on adjacent token tiles of one expert and n-tile, each loading half of
    every weight part and multicasting it to both.

    ``band_m`` (0: the whole expert) is the raster band: an expert's tiles
    are taken ``band_m`` (cluster) m-tiles at a time across all its n-tiles,
    so that the band's token rows stay in L2 while its weights stream past;
    with whole experts, an expert holding more token rows than L2 re-reads
    them from HBM for every wave.

    ``pair_tiles`` (with ``cluster_m`` 2): the CTA pair takes two consecutive
    ``tile_m``-row tiles of the schedule instead of one 2 x ``tile_m``-row
    cluster tile, multicasting the weight tile when both tiles are of one
    expert and n-tile and loading its own otherwise: the pair's weight sharing
    without the idle spare half of a cluster tile when an expert's m-tiles
    are odd.
    """

    tile_m: int
    tile_n: int
    tile_k: int = 64
    stages: int = 4
    b_warps: int = 2
    a_rows: int = 0
    cluster_m: int = 1
    band_m: int = 0
    pair_tiles: bool = False

    @property
    def mma_warpgroups(self) -> int:
        """MMA warpgroups, 64 rows of every tile each."""
        return self.tile_m // 64

    @property
    def rows(self) -> int:
        """Token rows per CTA tile."""
        return self.a_rows or self.tile_m


# Decode: few rows per expert, the op streams expert weights from HBM; one MMA
# warpgroup and a deep ring keep ~190 KB of weights in flight per SM.  The
# 16-row variant loads only that many token rows per tile.
DECODE = TileConfig("decode", tile_m=64, tile_n=128, tile_k=64, stages=8, b_warps=2)
DECODE16 = dataclasses.replace(DECODE, name="decode16", a_rows=16)
# ...on 64-column tiles (one weight warp; the SwiGLU kernel's two 32-row
# parts), twelve 10 KB stages (16 KB of shared memory each): twice the
# tiles, for decode GEMMs whose 128-column tiles leave SMs idle (Mixtral T=1
# down: 64 tiles on 132 SMs, each streaming at its own limit; choose_config)
DECODE16_N64 = TileConfig("decode16_n64", tile_m=64, tile_n=64, tile_k=64, stages=12,
                          b_warps=1, a_rows=16)
# ...on 64x256 tiles (five 40 KB stages) with CTA pairs on consecutive tiles,
# for large experts: an expert holding more than 64 rows (skewed routing)
# streams its weights once for the pair instead of once per m-tile
DECODE_P2 = TileConfig("decode_p2", tile_m=64, tile_n=256, tile_k=64, stages=5, b_warps=2,
                       cluster_m=2, pair_tiles=True)
# Mid: 48 to 128 rows per expert, still weight-streaming: one 128-row tile
# holds an expert's rows, so its weights stream once; 128 columns keep the
# tile count up (six 32 KB stages)
MID = TileConfig("mid", tile_m=128, tile_n=128, tile_k=64, stages=6, b_warps=2)
# Prefill: many rows per expert, tensor-core bound; two MMA warpgroups on a
# 128x256 tile (128 fp32 accumulators per thread), four 48 KB stages.  Raster
# bands of 8 m-tiles: an expert's token rows can outgrow L2 (Mixtral T=16384:
# 4096 rows, 32 MB; skewed, up to 9000), re-read from HBM for every wave
# without bands: ncu, Mixtral gate_up T=16384 skewed, 18.0 GB of HBM reads against 14.7
# with bands; DeepSeek-V3 gate_up T=16384 skewed 53.9 against 45.2 GB and
# 15.7 against 14.2 ms.
PREFILL = TileConfig("prefill", tile_m=128, tile_n=256, tile_k=64, stages=4, b_warps=2,
                     band_m=8)
# ...with CTA pairs on consecutive 128-row tiles, sharing a weight tile through TMA
# multicast where both are of one expert and n-tile (2x1 cluster tiles, a pair on one
# 256-row tile, lost to them: bench/notes/2026-12-07-gemm-core-h100.md)
PREFILL_P2 = dataclasses.replace(PREFILL, name="prefill_p2", cluster_m=2, pair_tiles=True)
# (Ping-pong warpgroups on 128x128 tiles lost to these: bench/notes/2026-12-04-pingpong-128x128.md.)
CONFIGS = {c.name: c for c in (DECODE16, DECODE16_N64, DECODE, DECODE_P2, MID, PREFILL,
                               PREFILL_P2)}


def _slot_fill(tiles: int, num_sms: int) -> float:
    """The share of the SMs' tile slots that ``tiles`` tiles keep busy over their waves."""
    return tiles / max(-(-tiles // num_sms) * num_sms, 1)


def choose_config(num_experts: int, n: int, k: int, m: int, num_sms: int = 132) -> TileConfig:
    """Pick tiles from shapes only (no sync): rows per expert ``r = M / E``, N, K.

    Measured on the H200 over the three models' GEMMs at T = 16..16384
    (bench/notes/2026-12-02-tile-config-sweep.md has the sweep):

    - ``r < 6``: the op streams weights; a 16-row token box spares L2 the 48
      rows a 64-row tile would discard (Mixtral gate_up T=16: 0.470 ms
      against 0.511).  A box smaller than an expert's rows would stream its
      weights twice, hence only for a few rows per expert.  64-column tiles
      where 128-column ones fill the SMs poorly (a few touched experts: T = 1).
    - ``r < 48``: the 64x128 tile, one token tile per expert; 64x256 with
      CTA pairs (``decode_p2``) where an expert's weights are large (>= 24
      MB, half of L2) and its n-tiles make four waves: skewed routing gives
      hot experts several m-tiles, and a pair streams their weights once.
      Against ``decode`` (harness, 2026-12-03, ms): DeepSeek-V3 T=1024
      gate_up 3.554/3.886 against 3.638/4.233 (uniform/skewed), down
      1.796/1.913 against 1.835/2.058; Mixtral gate_up T=128 0.434/0.444
      against 0.451/0.484; Mixtral down T=128 (one wave of 64x256 tiles)
      skewed 0.299 against 0.278, hence the wave rule.
    - above: 128-row tiles.  With one m-tile per expert (``r <= 128``): under
      four waves of 128x256 tiles, 128x128 tiles (``mid``), more tiles keeping
      the SMs busy while the op still streams weights; else 128x256 tiles, with
      CTA pairs (below) only where an expert's weights are large (a skewed
      expert's several m-tiles), since a pair of one m-tile's consecutive tiles
      shares nothing and its CTAs wait on each other's stages (and the weights no
      longer stream ahead of the kernel, ``prefetch_weights``): the layer at
      Qwen3 T=1024 took 0.749 ms with pairs against 0.645 without (moe_layer
      runs at 3defe77 and 1a4410d).  With more rows, 128x256 tiles with CTA
      pairs on consecutive tiles (``prefill_p2``), multicasting the weight
      tile where both are of one expert and n-tile: an expert's m-tiles then
      read its weights from L2 once a pair, not once a tile.  Against plain
      128x256 tiles and 2x1 cluster tiles (harness, H100, 2026-12-07, both
      weight layouts, ms; bench/notes/2026-12-07-gemm-core-h100.md): Qwen3
      gate_up T=4096 0.471/0.458 against 0.612/0.616 and 0.608/0.588, Mixtral
      down T=1024 (two m-tiles, under two waves) 0.552/0.553 against ``mid``'s
      0.612/0.612, Mixtral gate_up T=16384 11.51/11.62 against 12.99/12.84
      (cluster tiles 11.84/12.35); level (within the run's 3 % noise) elsewhere.
    """
    def tiles(cfg, experts=num_experts, m_tiles=1):
        return -(-n // cfg.tile_n) * experts * m_tiles

    def waves(cfg, m_tiles=1):
        return tiles(cfg, m_tiles=m_tiles) / num_sms

    rows = m / max(num_experts, 1)
    if rows < 6:
        # the touched experts' weights stream through the SMs, each at most
        # ~60 GB/s: tiles that leave SMs idle (one short wave, or a short last
        # one) leave HBM idle too.  64-column tiles where they fill the SMs'
        # slots markedly better (Mixtral T=1: gate_up 3.4 waves of 128-column
        # tiles, down half a wave; bench/notes/2026-12-04-decode16-n64.md)
        touched = min(num_experts, m)
        fill = [_slot_fill(tiles(cfg, touched), num_sms) for cfg in (DECODE16, DECODE16_N64)]
        return DECODE16_N64 if fill[1] > fill[0] + 0.05 else DECODE16
    large_experts = n * k * 2 >= 24 << 20

    if rows < 48:
        return DECODE_P2 if large_experts and waves(DECODE_P2) >= 4 else DECODE
    if rows <= PREFILL.tile_m:  # one m-tile an expert: nothing for a pair to share
        if waves(PREFILL) < 4:
            return MID
        return PREFILL_P2 if large_experts else PREFILL
    return PREFILL_P2


def swiglu_takes(cfg: TileConfig, n_major: bool) -> bool:
    """Whether the fused SwiGLU kernel builds ``cfg`` for weights of that layout: N-major,
    each weight warp's part is whole 64-column swizzle atoms, and decode16_n64's 32-column
    gate and up parts are not."""
    return not (n_major and cfg is DECODE16_N64)


def swiglu_config(num_experts: int, two_inter: int, k: int, m: int,
                  n_major: bool = False) -> TileConfig | Declined:
    """The fused SwiGLU kernel's tiles for these shapes, or the reason it cannot
    run: a tile's gate and up parts must be whole, so I must be a multiple of
    ``tile_n / 2`` (the caller then runs a plain GEMM and the activation apart).
    With N-major weights (``n_major``) the shapes :func:`swiglu_takes` refuses take the
    128-column decode tiles."""
    cfg = choose_config(num_experts, two_inter, k, m)
    if not swiglu_takes(cfg, n_major):
        cfg = DECODE16
    if (two_inter // 2) % (cfg.tile_n // 2):
        return Declined(f"I = {two_inter // 2}: the fused SwiGLU kernel's {cfg.name} tiles "
                        f"need a multiple of {cfg.tile_n // 2}")
    return cfg
