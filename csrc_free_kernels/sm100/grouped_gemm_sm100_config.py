"""Tile configurations of the Blackwell grouped GEMM and the heuristic that picks
one (:class:`csrc_free_kernels.sm100.grouped_gemm_sm100.GroupedGemmSm100`; never run
on hardware here)."""

from dataclasses import dataclass

from ..common.kernel_config import Declined, KernelConfig

MAX_EXPERTS = 512


@dataclass(frozen=True)
class TileConfigSm100(KernelConfig):
    """One compiled configuration: ``tile_n`` output columns of the pair's 256-row
    MMA tile (each CTA holds ``tile_n / 2`` of the weight tile), ``tile_k`` per
    stage, ``stages`` (as many as fit, up to this), ``band_m`` as on Hopper."""

    tile_n: int
    tile_k: int = 64
    stages: int = 6
    band_m: int = 8


WIDE = TileConfigSm100("n256", tile_n=256)
NARROW = TileConfigSm100("n128", tile_n=128)
CONFIGS = {c.name: c for c in (WIDE, NARROW)}


def choose_config(num_experts: int, n: int, k: int, m: int, num_sms: int = 148) -> TileConfigSm100:
    """256 columns, unless that leaves under two waves of pair tiles (then 128).

    A first rule, from tile counts alone: never measured, as nothing here has
    run on a Blackwell GPU."""
    # at least one 256-row tile per expert holding rows, and at most M experts do
    pair_tiles = max(-(-m // 256), min(num_experts, m), 1)
    waves = -(-n // WIDE.tile_n) * pair_tiles / (num_sms // 2)
    return WIDE if waves >= 2 else NARROW


def swiglu_config(num_experts: int, two_inter: int, k: int, m: int) -> TileConfigSm100 | Declined:
    """The fused SwiGLU tiles for these shapes, or the reason where I is not a multiple
    of ``tile_n / 2`` (the caller then runs the GEMM and the activation apart)."""
    cfg = choose_config(num_experts, two_inter, k, m)
    if (two_inter // 2) % (cfg.tile_n // 2):
        return Declined(f"I = {two_inter // 2}: the fused sm_100 kernel's {cfg.name} tiles "
                        f"need a multiple of {cfg.tile_n // 2}")
    return cfg
