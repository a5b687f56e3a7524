"""CPU: every grouped GEMM configuration compiles for sm_90a; its PTX has the
instructions the design relies on."""

import re

import pytest

from csrc_free_kernels import ptx_dump
from csrc_free_kernels.hopper import GEMM_SM90

from .kernels.probe_builds import ALL_BUILDS
from .ptxas import assert_pdl_entry, assert_pdl_prefetch_entry, ptx_fixture

# the family's builds and the probe without raster bands (the store-warp probe is the
# pre-flight's)
BUILDS = [*ptx_dump.builds_of(GEMM_SM90), "gemm_prefill_whole_experts"]
ptx = ptx_fixture("sm_90a", BUILDS)


def _config(name):
    """The TileConfig that build ``name`` compiles."""
    return ALL_BUILDS[name].spec["config"]


def test_every_configuration_is_built(ptx):
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as c

    assert set(BUILDS) <= set(ptx)
    built = {_config(n).name for n in BUILDS}  # the probe without bands keeps its name
    assert built == set(c.CONFIGS)
    assert any(n.startswith("swiglu") for n in BUILDS)


@pytest.mark.parametrize("name", BUILDS)
def test_waits_for_the_stream_before_global_memory(ptx, name):
    """Launched with PDL: no offs read, TMA load or store before griddepcontrol.wait;
    with ``prefetch_weights``, only the L2 reads of offs (the weight warps' loads
    follow)."""
    if _prefetches(name):
        assert_pdl_prefetch_entry(ptx[name])
    else:
        assert_pdl_entry(ptx[name])
        assert "ld.global.cg" not in ptx[name]


def _kernel_cls(name):
    """The kernel class that build ``name`` compiles."""
    from csrc_free_kernels.hopper import grouped_gemm_sm90 as g

    return g.GroupedGemmSwigluSm90 if ALL_BUILDS[name].spec["swiglu"] else g.GroupedGemmSm90


def _prefetches(name):
    """Whether build ``name`` streams weights before its wait (requested and taken)."""
    return ALL_BUILDS[name].spec["prefetch_weights"]


def test_prefetch_builds_exist():
    from csrc_free_kernels.common import pdl

    requested = [n for n in BUILDS if n.endswith("_prefetch")]
    assert len(requested) >= 4 and pdl.ENABLED
    assert all(_prefetches(n) for n in requested)
    assert not any(_prefetches(n) for n in BUILDS if n not in requested)


def test_prefetch_needs_no_cluster():
    """The weight warps stream before the wait only where they own the weight
    loads of their CTA alone (no multicast); elsewhere the flag is off (a hint)."""
    from csrc_free_kernels.hopper import grouped_gemm_sm90 as g
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as c

    assert g.GroupedGemmSm90(c.DECODE16, prefetch_weights=True).prefetch_weights
    assert g.GroupedGemmSwigluSm90(c.DECODE16_N64, prefetch_weights=True).prefetch_weights
    assert not g.GroupedGemmSm90(c.PREFILL_P2, prefetch_weights=True).prefetch_weights
    assert not g.GroupedGemmSm90(c.PREFILL_P2, prefetch_weights=True).prefetch_weights
    assert not g.GroupedGemmSm90(c.DECODE16).prefetch_weights


@pytest.mark.parametrize("name", BUILDS)
def test_kernel_ptx(ptx, name):
    text = ptx[name]
    cfg = _config(name)
    n_per_wg = cfg.tile_n  # each MMA warpgroup: 64 x tile_n
    dtype = "f16" if "fp16" in name else "bf16"
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n_per_wg}k16\.f32\.{dtype}\.{dtype}",
                     text), "WGMMA 64 x tile_n x 16 with fp32 accumulators"
    assert "cp.async.bulk.tensor" in text
    assert "setmaxnreg.dec" in text and "setmaxnreg.inc" in text
    # one expect_tx site: the stage's bytes, token box plus weight tile
    arms = re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64\s+\S+,\s*\[\S+\],\s*(%r\d+);", text)
    assert len(arms) == 1
    (value,) = re.findall(rf"mov\.b32\s+{re.escape(arms[0])},\s*(\d+);", text)
    assert int(value) == (cfg.rows + cfg.tile_n) * cfg.tile_k * 2
    body = text[text.index("setmaxnreg.dec"):]
    before_arm = body[:body.index("expect_tx")]
    # one token-box site (2-D); weight parts (3-D: E is a mode), one site run
    # by each weight warp (an N-major part of 128 columns takes two
    # 128-byte-wide boxes), behind the branch on the warp's role
    token_loads = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", text)
    weight_loads = re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::\w+\.global", text)
    assert len(token_loads) == 1
    assert len(weight_loads) >= 1
    assert re.search(r"@%p\d+ bra", before_arm)
    if cfg.cluster_m > 1:
        assert ".multicast::cluster" in text
        assert "barrier.cluster.arrive" in text
    else:
        assert ".multicast::cluster" not in text
    if name.startswith("swiglu"):
        assert "ex2.approx" in text  # silu in the epilogue
    barriers = set(re.findall(r"bar\.(?:sync|arrive)\s+(\d+), \d+;", text))
    from csrc_free_kernels.hopper.grouped_gemm_sm90 import Barrier

    assert "st.global.v4" in text  # 16-byte predicated stores from shared memory
    assert "stmatrix" in text or "f32_out" in name
    # the epilogue's barrier, among the tile's MMA threads, and no other
    assert barriers == {str(int(Barrier.EPILOGUE))}
    assert re.search(rf"bar\.sync\s+{int(Barrier.EPILOGUE)}, {128 * cfg.mma_warpgroups};", text)


@pytest.mark.parametrize("shape, name", [
    ((8, 28672, 4096, 32), "decode16"),          # Mixtral gate_up T=16
    ((8, 28672, 4096, 2), "decode16_n64"),       # Mixtral gate_up T=1: 3.4 waves of 128 columns
    ((8, 4096, 14336, 2), "decode16_n64"),       # Mixtral down T=1: 64 tiles of 128 columns
    ((256, 7168, 2048, 8), "decode16_n64"),      # DeepSeek-V3 down T=1
    ((128, 1536, 2048, 8), "decode16"),          # Qwen3 gate_up T=1: either fills 73 %
    ((256, 4096, 7168, 8), "decode16"),          # DeepSeek-V3 gate_up T=1: 256 tiles
    ((8, 4096, 14336, 32), "decode16"),          # Mixtral down T=16: 256 tiles
    ((128, 1536, 2048, 4096), "decode"),         # Qwen3 gate_up T=512: 6 MB per expert
    ((256, 4096, 7168, 8192), "decode_p2"),      # DeepSeek gate_up T=1024: 56 MB per expert
    ((8, 28672, 4096, 256), "decode_p2"),        # Mixtral gate_up T=128: 7 waves of 64x256
    ((8, 4096, 14336, 256), "decode"),           # Mixtral down T=128: one wave of 64x256
    ((8, 4096, 14336, 512), "mid"),              # Mixtral down T=256: one m-tile, one wave
    ((8, 4096, 14336, 2048), "prefill_p2"),      # Mixtral down T=1024: two m-tiles an expert
    ((128, 1536, 2048, 8192), "prefill"),        # Qwen3 gate_up T=1024: one m-tile an expert
    ((256, 4096, 7168, 16384), "prefill_p2"),    # DeepSeek gate_up T=2048: 56 MB per expert
    ((128, 1536, 2048, 131072), "prefill_p2"),   # Qwen3 gate_up T=16384: 6 MB per expert
    ((256, 4096, 7168, 131072), "prefill_p2"),   # DeepSeek gate_up T=16384: 56 MB per expert
    ((8, 28672, 4096, 32768), "prefill_p2"),     # Mixtral gate_up T=16384
])
def test_choose_config(shape, name):
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as c

    assert c.choose_config(*shape).name == name


def test_pair_tiles_need_a_cluster_pair():
    import dataclasses

    from csrc_free_kernels.hopper import grouped_gemm_sm90 as g
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as c

    with pytest.raises(ValueError, match="pair_tiles needs cluster_m 2"):
        g.GroupedGemmSm90(dataclasses.replace(c.PREFILL, pair_tiles=True))


def test_unsplittable_weight_tile_is_refused():
    import dataclasses

    import cutlass
    from cutlass.tensor_utils import LayoutEnum

    from csrc_free_kernels.hopper import grouped_gemm_sm90 as g
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as c

    # 64x128 pairs: each CTA would multicast a 32-column share of a 64-column
    # N-major weight part, less than one 64-column swizzle atom
    kernel = g.GroupedGemmSm90(dataclasses.replace(c.DECODE, cluster_m=2, pair_tiles=True))
    with pytest.raises(ValueError, match="32 columns, must be a multiple of 64"):
        kernel._setup(cutlass.BFloat16, cutlass.BFloat16, LayoutEnum.ROW_MAJOR,
                      LayoutEnum.COL_MAJOR, LayoutEnum.ROW_MAJOR)
