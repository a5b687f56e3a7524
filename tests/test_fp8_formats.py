"""CPU: scaled formats are data.  Each recipe is a descriptor
(``csrc_free_kernels.common.formats``) that the recipes, checks, references, the
dequantize fallback and the kernels' scale layouts read; every kernel-side use of the
blockwise token scales' layout is pinned to it here; and MXFP8 (e4m3 with an e8m0 scale
per 32) is a descriptor and a recipe pair that the references and the fallback serve."""

import pathlib

import pytest
import torch

import ts_moe
from csrc_free_kernels.common.formats import FORMATS, ScaleFormat
from ts_moe.fp8.recipes import Pair, Recipe
from ts_moe.fp8.reference import dequantize, scaled_grouped_gemm_reference
from ts_moe.ops import Op, paths
from ts_moe.ops.backend import first_taker

from .helpers import rel_err

ROOT = pathlib.Path(__file__).resolve().parent.parent
L = pytest.importorskip("csrc_free_kernels.fp8.grouped_gemm_fp8_sm90_launch")
QL = pytest.importorskip("csrc_free_kernels.fp8.quantize_fp8_sm90_launch")


def test_every_recipe_is_a_format():
    assert {r.value for r in Recipe} == set(FORMATS)
    for r in Recipe:
        assert r.format is FORMATS[r.value] and r.scale_dtype == getattr(torch, r.format.scale)
    shape = (3, 300, 260)
    assert Recipe.TENSORWISE.scale_shape(shape) == (3,)
    assert Recipe.ROWWISE.scale_shape(shape) == (3, 300)
    assert Recipe.BLOCKWISE_1X128.scale_shape(shape) == (3, 300, 3)
    assert Recipe.BLOCKWISE_128X128.scale_shape(shape) == (3, 3, 3)
    assert Recipe.MX_1X32.scale_shape(shape) == (3, 300, 9)
    # M-major token scales: the rows contiguous and padded to 16 bytes of fp32
    assert Recipe.BLOCKWISE_1X128.scale_strides((30, 256)) == (1, 32)
    assert Recipe.MX_1X32.scale_strides((30, 256)) == (8, 1)


def test_a_new_format_is_a_descriptor():
    """A format's shapes and layouts follow from its block and layout alone (here an
    NVFP4-like 1 x 16 block, M-major, rows padded to 8)."""
    nvfp4 = ScaleFormat("nvfp4_like", "float4_e2m1fn_x2", 6.0, "float8_e4m3fn", (1, 16),
                        "m_major", 8)
    assert nvfp4.scale_shape((2, 13, 64)) == (2, 13, 4)
    assert nvfp4.scale_strides((2, 13, 64)) == (64, 1, 16)
    assert nvfp4.padded_rows(13) == 16 and not nvfp4.power_of_two


def test_the_kernels_token_scale_layout_is_the_descriptors():
    """Every place the FP8 kernels lay out blockwise token scales (the GEMM's fast layout,
    its gather, the quantizer's output, the compiled signatures) reads the format."""
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_config as C
    from csrc_free_kernels.fp8 import quantize_fp8_sm90 as Q

    fmt = FORMATS["blockwise_1x128"]
    for m in (1, 5, 30, 33):
        want = Recipe.BLOCKWISE_1X128.scale_strides((m, 512))
        rowmajor = torch.rand(m, 4)
        assert L.fast_scale_a(rowmajor).stride() == want
        a = torch.zeros(m, 512, dtype=torch.float8_e4m3fn)
        index = torch.arange(m, dtype=torch.int32)
        assert L._gather(a, rowmajor, index, "blockwise")[1].stride() == want
    assert L.SCALE_A is fmt and QL.SCALE_A is fmt and C.SCALE_A is fmt
    assert C.SCALE_BLOCK == FORMATS["blockwise_128x128"].block[0] == \
        FORMATS["blockwise_128x128"].block[1]
    assert Q.GROUP == fmt.block[1] and Q.FP8_MAX == fmt.element_max
    for module in ("fp8/grouped_gemm_fp8_sm90_launch.py", "fp8/quantize_fp8_sm90_launch.py"):
        text = (ROOT / "csrc_free_kernels" / module).read_text()
        assert "// 4) * 4" not in text and "divisibility=4" not in text, module


def test_the_quantizer_allocates_the_descriptors_layout(monkeypatch):
    """The quantize kernel's output scale (its compiled function faked on the CPU) has the
    layout the recipe's format gives."""
    seen = {}

    def fake(recipe, dtype):
        def fn(x, q, scale, amax, ctas):
            seen[recipe] = scale
        return fn

    monkeypatch.setattr(QL, "compiled_kernel", fake)
    monkeypatch.setattr(QL, "_max_ctas", lambda index: 1)
    monkeypatch.setattr(QL, "_unused", lambda index: torch.zeros(1))
    x = torch.randn(30, 256, dtype=torch.bfloat16)
    QL.quantize(x, "blockwise_1x128")
    assert seen["blockwise_1x128"].stride() == Recipe.BLOCKWISE_1X128.scale_strides(x.shape)


# ------------------------------------------------------------------ MXFP8
def test_mxfp8_quantizes_to_power_of_two_scales():
    """An e8m0 scale per row per 32 columns, ``2 ** (floor(log2 amax) - 8)`` (OCP MX
    v1.0), the elements saturated at 448; a zero block gets the smallest scale and zeros."""
    x = torch.randn(5, 96) * torch.logspace(-3, 3, 5).unsqueeze(1)
    x[2, 32:64] = 0
    q, s = ts_moe.quantize_fp8(x, "mx_1x32")
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert s.shape == (5, 3)
    sf = s.float()
    assert torch.equal(sf, torch.exp2(sf.log2().round()))  # powers of two
    amax = x.abs().unflatten(-1, (3, 32)).amax(-1)
    live = amax > 0
    assert torch.equal(sf[live], torch.exp2(amax[live].log2().floor() - 8))
    assert sf[2, 1] == 2.0**-127 and (q[2, 32:64].float() == 0).all()
    assert q.float().abs().max() <= 448
    assert rel_err(dequantize(q, s, "mx_1x32"), x) < 6e-2


def test_mxfp8_grouped_gemm_runs_on_the_references_and_the_fallback():
    """The MX pair on the CPU (the reference) and, on an H100's paths, past the sm_90
    kernel (which declines it, saying why) and torch's rowwise GEMM to the dequantize
    fallback; both within float64 of the dequantized product, per row."""
    torch.manual_seed(3)
    a, w = torch.randn(40, 128), torch.randn(4, 96, 128) * 128**-0.5
    qa, sa = ts_moe.quantize_fp8(a, Recipe.MX_1X32)
    qw, sw = ts_moe.quantize_fp8(w, Recipe.MX_1X32)
    offs = torch.tensor([9, 9, 30, 38], dtype=torch.int32)
    want = scaled_grouped_gemm_reference(qa, qw.mT, sa, "mx_1x32", sw, "mx_1x32", offs,
                                         torch.float64, acc=torch.float64)
    got = ts_moe.scaled_grouped_gemm(qa, qw.mT, sa, "mx_1x32", sw, "mx_1x32", offs)
    rows = (got.double()[:38] - want[:38]).norm(dim=1) / want[:38].norm(dim=1)
    assert rows.max() < 1e-2 and (got[38:] == 0).all()
    out = torch.empty(40, 96, dtype=torch.bfloat16)
    with ts_moe.settings.override(fp8_kernels=True):
        backends = paths.backends(Op.SCALED_GROUPED_GEMM, (9, 0))
        declined = backends[0].choose_config(qa, qw.mT, sa, sw, offs, out, None, Pair.MX)
        assert not declined and "mx" in declined.reason
        taken, _ = first_taker(backends, qa, qw.mT, sa, sw, offs, out, None, Pair.MX)
    assert taken is paths.TABLE[paths.Path.DEQUANTIZE][Op.SCALED_GROUPED_GEMM]
    fallback = taken.run(qa, qw.mT, sa, sw, offs, out, taken.choose_config(
        qa, qw.mT, sa, sw, offs, out, None, Pair.MX), Pair.MX)
    rows = (fallback.double()[:38] - want[:38]).norm(dim=1) / want[:38].norm(dim=1)
    assert rows.max() < 1e-2


def test_mxfp8_checks_name_what_is_wrong():
    qa, sa = ts_moe.quantize_fp8(torch.randn(8, 64), "mx_1x32")
    qw, sw = ts_moe.quantize_fp8(torch.randn(2, 32, 64), "mx_1x32")
    offs = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="scale_a must be float8_e8m0fnu for the mx_1x32"):
        ts_moe.scaled_grouped_gemm(qa, qw.mT, sa.float(), "mx_1x32", sw, "mx_1x32", offs)
    with pytest.raises(ValueError, match="K = 48 must be a multiple of 32 for the mx recipes"):
        q48, s48 = ts_moe.quantize_fp8(torch.randn(8, 48), "mx_1x32")
        w48, t48 = ts_moe.quantize_fp8(torch.randn(2, 32, 48), "mx_1x32")
        ts_moe.scaled_grouped_gemm(q48, w48.mT, s48, "mx_1x32", t48, "mx_1x32", offs)
