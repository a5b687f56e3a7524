"""Tile configurations of the Hopper k-grouped (weight-gradient) GEMM and the
heuristic that picks one (:class:`csrc_free_kernels.hopper.grouped_gemm_dw_sm90.GroupedGemmDwSm90`).
"""

from dataclasses import dataclass

from .grouped_gemm_sm90_config import MAX_EXPERTS, SMEM_CAPACITY  # noqa: F401 (shared limits)
from ..common.kernel_config import KernelConfig


@dataclass(frozen=True)
class DwConfig(KernelConfig):
    """One compiled configuration.

    The output tile is ``tile_m`` rows of K (64 per MMA warpgroup) by ``tile_n``
    columns of N; the reduction walks an expert's token rows ``tile_k`` at a
    time.  ``dy_warps`` producer warps share the dy tile (``tile_n / dy_warps``
    columns each, whole 64-column swizzle atoms).  ``band_n``, the raster
    band: an expert's output tiles are taken ``band_n`` n-tiles at a time
    across all its m-tiles (n fastest), so that the CTAs running together
    share a few dy and a columns in L2 rather than streaming all of N for one
    m-tile (:class:`csrc_free_kernels.common.tile_schedule.KGroupedTileSchedule`).
    """

    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    stages: int = 4
    dy_warps: int = 2
    band_n: int = 8

    @property
    def mma_warpgroups(self) -> int:
        return self.tile_m // 64

    @property
    def stage_bytes(self) -> int:
        """One stage of 16-bit operands: the a^T tile and the dy tile."""
        return (self.tile_m + self.tile_n) * self.tile_k * 2


# Large problems: two MMA warpgroups on 128x256 output tiles (128 fp32
# accumulators per thread), four 48 KB stages
WIDE = DwConfig("dw_128x256")
# Few output tiles per SM (small K x N, or few experts): 128x128 tiles double
# the tiles; six 32 KB stages.  (Both store their tiles by TMA: the thread-store
# epilogue lost, bench/notes/2026-12-04-dw-thread-store-epilogue.md.)
NARROW = DwConfig("dw_128x128", tile_n=128, stages=6, dy_warps=1, band_n=16)
CONFIGS = {c.name: c for c in (WIDE, NARROW)}


def output_tiles(cfg: DwConfig, num_experts: int, k: int, n: int) -> int:
    """The output tiles of ``num_experts`` (K, N) gradients: the schedule's tile count."""
    return num_experts * -(-k // cfg.tile_m) * -(-n // cfg.tile_n)


def choose_config(num_experts: int, k: int, n: int, m: int, num_sms: int = 132) -> DwConfig:
    """Tiles from shapes only (no sync): 128x256 unless that leaves fewer than
    four waves of output tiles (the tiles of big experts are long, so a few
    tiles per SM leave SMs idle at the end), then 128x128.  Not yet tuned on
    the GPU (``scripts/dw_bench.py`` compares both)."""
    del m  # rows per expert do not change the tile count
    return WIDE if output_tiles(WIDE, num_experts, k, n) >= 4 * num_sms else NARROW
