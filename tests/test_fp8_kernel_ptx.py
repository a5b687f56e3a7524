"""CPU: every FP8 grouped GEMM configuration (each recipe, plain and fused SwiGLU)
compiles for sm_90a; its PTX has the instructions the design relies on, and ptxas
assembles it without spills."""

import re

import pytest

from csrc_free_kernels.fp8.grouped_gemm_fp8_sm90_config import CONFIGS, RECIPES

from .kernels.probe_builds import ALL_BUILDS
from .ptxas import NO_SPILLS, PTXAS, assemble, assert_pdl_entry, ptx_fixture

CONFIG_NAMES = tuple(CONFIGS)

# the family's checked builds: every configuration x recipe x (plain, SwiGLU), bf16 out;
# the other output dtypes once; and (tests/kernels/probe_builds.py) register budgets: the
# SwiGLU blockwise mainloops (the widest: two weight scales per k-block, two
# accumulators) built with their MMA warpgroups capped at 168 registers (the kernel
# gives them 232 / 240) must not spill either.
# name -> (config, recipe, swiglu, out dtype name, register cap)
SPECS = {n: (b.spec["config"].name, b.spec["recipe"], b.spec["swiglu"],
             str(b.spec["out_dtype"]).split(".")[-1], b.spec.get("regs", 0))
         for n, b in ALL_BUILDS.items() if n.startswith("fp8_")}
GEMMS = sorted(SPECS)
# the activation quantizer: each recipe, each input dtype
QUANT_RECIPES = ("blockwise_1x128", "rowwise", "tensorwise")
SPECS.update({n: (b.spec["recipe"], str(b.spec["dtype"]).split(".")[-1])
              for n, b in ALL_BUILDS.items() if n.startswith("quantize_")})

ptx = ptx_fixture("sm_90a", sorted(SPECS))


def _config(name):
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_config as C

    return C.CONFIGS[SPECS[name][0]]


def test_every_configuration_is_built(ptx):
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_config as C

    assert set(ptx) == set(SPECS)
    assert set(CONFIG_NAMES) == set(C.CONFIGS)
    assert {SPECS[n][0] for n in GEMMS} == set(C.CONFIGS)


@pytest.mark.parametrize("name", GEMMS)
def test_kernel_ptx(ptx, name):
    text = ptx[name]
    config, recipe, swiglu, out_dtype, _ = SPECS[name]
    cfg = _config(name)
    blockwise = recipe == "blockwise"
    assert ".target sm_90a" in text
    # e4m3 x e4m3 WGMMAs with fp32 accumulators, 64 x tile_n per warpgroup: one stage
    # is four k32 instructions (one 128-K scale block), issued at one site
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k32)\.f32\.e4m3\.e4m3", text)
    assert mmas == [f"m64n{cfg.tile_n}k32"] * 4, mmas
    assert "wgmma.mma_async.sync.aligned.m64n" in text
    # each stage's WGMMAs are waited for in full before their partial is read
    assert re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", text) == ["0"]
    # one expect_tx site: the token box, the weight tile and (blockwise) the box of
    # activation scales, all under the stage's one armed byte count
    arms = re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64\s+\S+,\s*\[\S+\],\s*(%r\d+);",
                      text)
    assert len(arms) == 1
    (value,) = re.findall(rf"mov\.b32\s+{re.escape(arms[0])},\s*(\d+);", text)
    # (the scale box: the tile's rows and the up to 3 before them, from a multiple of 4)
    scale_box = (cfg.rows + 4) * 4 if blockwise else 0
    assert int(value) == cfg.rows * 128 + cfg.tile_n * 128 + scale_box
    # TMA: the token box (2-D), the scale box (2-D, blockwise), the weight parts (3-D)
    loads_2d = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global[^\n]*", text)
    assert len(loads_2d) == (2 if blockwise else 1)
    if blockwise:
        # the scale box starts on a row rounded down to a multiple of 4 (16 bytes)
        inner = [re.search(r"\{(%r\d+),", ld).group(1) for ld in loads_2d]
        masked = [r for r in inner
                  if re.search(rf"and\.b32\s+{re.escape(r)},\s*%r\d+,\s*-4;", text)]
        assert len(masked) == 1, inner
    assert re.search(r"cp\.async\.bulk\.tensor\.3d\.shared::\w+\.global", text)
    assert (".multicast::cluster" in text) == (cfg.cluster_m > 1)
    assert "setmaxnreg.dec" in text and "setmaxnreg.inc" in text
    assert ".local" not in text
    assert_pdl_entry(text)
    acc_per_thread = cfg.tile_n // 2  # 64 x tile_n fp32 over a warpgroup's 128 threads
    if blockwise:
        # the promotion: after the wait, the thread's two rows' activation scales
        # from the stage, the stage given back, then one FFMA per accumulator
        fmas = re.findall(r"fma\.rn\.f32", text)
        assert len(fmas) == acc_per_thread
        after = text[text.index("wgmma.wait_group.sync.aligned"):]
        sfa = [m.start() for m in re.finditer(r"ld\.shared\.b32", after)][:2]
        # (to the stage's empty barrier; in every CTA of a multicast cluster)
        release = re.search(r"mbarrier\.arrive\.shared(::cluster)?\.b64", after).start()
        first_fma = after.index("fma.rn.f32")
        assert len(sfa) == 2 and sfa[1] < release < first_fma
        if not swiglu:
            assert len(re.findall(r"\bmul\.f32", text)) == 2  # sa[row] * sb, two rows
    else:
        assert "fma.rn.f32" not in text
        # the promotion is one add per accumulator
        assert len(re.findall(r"\badd\.f32", text)) >= acc_per_thread
    if swiglu:
        assert "ex2.approx" in text  # silu in the epilogue
    if out_dtype == "float32":
        assert "st.global.v4" in text
    else:
        assert "stmatrix" in text and "st.global.v4" in text


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("name", sorted(SPECS))
def test_ptxas_no_spills(ptx, name, tmp_path):
    report = assemble(ptx[name], "sm_90a", tmp_path)
    assert NO_SPILLS in report, report
    # C7514: WGMMAs serialized (e.g. a second partial in flight); C7519/C7520: a fence
    # or warpgroup.arrive inserted by ptxas
    assert not re.search(r"C75\d\d", report), report


@pytest.mark.parametrize("name", [n for n in SPECS if n.startswith("quantize_")])
def test_quantize_ptx(ptx, name):
    """One pass: 16-byte vector loads, satfinite e4m3 conversion, true division by the
    scale; blockwise: a 16-lane butterfly (4 shuffles) per group, four groups a thread;
    rowwise: warp butterflies and a CTA barrier; tensorwise: no reduction at all.  Every
    recipe stores its scale, a true division of the amax by 448 (never a multiply by
    the rounded 1/448, 0f3B124925, which torch on CUDA does for ``amax / 448.0``):
    tensorwise too, the divisor it used."""
    text = ptx[name]
    recipe, dtype = SPECS[name]
    assert ".target sm_90a" in text and ".local" not in text
    assert_pdl_entry(text)
    assert "cvt.rn.satfinite.e4m3x2.f32" in text
    assert "div.rn.f32" in text
    scales = re.findall(r"div\.rn\.f32\s+(%r\d+),\s*%r\d+,\s*0f43E00000;", text)
    assert scales and "0f3B124925" not in text
    assert any(re.search(rf"st\.global\.b32\s+\[%rd\d+\],\s*{re.escape(r)};", text)
               for r in scales)
    assert re.search(r"ld\.global(\.nc)?\.v4\.b32", text)
    shuffles = len(re.findall(r"shfl\.sync\.bfly\.b32", text))
    if recipe == "blockwise_1x128":
        assert shuffles == 4 * 4
        assert "bar.sync" not in text
        assert re.search(r"st\.global\.v2\.b32", text)  # 8 e4m3 per thread and group
    elif recipe == "rowwise":
        assert shuffles == 2 * 5 and "bar.sync" in text
    else:
        assert shuffles == 0


@pytest.mark.parametrize("shape, name", [
    ((8, 28672, 4096, 16), "fp8_decode16"),         # Mixtral gate_up T=8
    ((8, 4096, 14336, 2), "fp8_decode16_n64"),      # Mixtral down T=1: 32 tiles of 128
    ((256, 4096, 7168, 8), "fp8_decode16"),         # DeepSeek-V3 gate_up T=1
    ((128, 1536, 2048, 4096), "fp8_decode"),        # Qwen3 gate_up T=512
    ((8, 4096, 14336, 2048), "fp8_mid"),            # Mixtral down T=1024
    ((128, 1536, 2048, 131072), "fp8_prefill"),     # Qwen3 gate_up T=16384
    ((8, 28672, 4096, 32768), "fp8_prefill_c2"),    # Mixtral gate_up T=16384
])
def test_choose_config(shape, name):
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_config as C

    for recipe in RECIPES:  # a recipe reaches the heuristic parsed (the op layer's)
        assert C.choose_config(*shape, recipe=recipe).name == name


def test_refused_configurations():
    import dataclasses

    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90 as K
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_config as C
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as g

    with pytest.raises(ValueError, match="128 deep"):
        K.GroupedGemmFp8Sm90(g.DECODE)  # bf16's tile_k 64
    with pytest.raises(ValueError, match="not pair_tiles"):
        K.GroupedGemmFp8Sm90(dataclasses.replace(C.MID, cluster_m=2, pair_tiles=True))
    with pytest.raises(ValueError, match="one 128-column"):
        K.GroupedGemmFp8Sm90(dataclasses.replace(C.MID, tile_n=256))
    with pytest.raises(ValueError, match="recipe must be one of"):
        K.GroupedGemmFp8Sm90(C.MID, "mxfp8")


def test_swiglu_supported():
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_config as C

    assert C.swiglu_supported(2 * 768, "blockwise", C.MID)       # Qwen3 I = 768
    assert not C.swiglu_supported(2 * 704, "blockwise", C.MID)   # I % 128 != 0
    assert C.swiglu_supported(2 * 704, "rowwise", C.MID)         # 704 % 64 == 0
    assert not C.swiglu_supported(2 * 720, "rowwise", C.MID)
    assert C.swiglu_supported(2 * 32, "tensorwise", C.DECODE16_N64)
    # any configuration (the op layer's question before choosing tiles): I % 64
    assert C.swiglu_supported(2 * 704, "rowwise") and not C.swiglu_supported(2 * 32, "rowwise")
    assert not C.swiglu_supported(2 * 704, "blockwise")
