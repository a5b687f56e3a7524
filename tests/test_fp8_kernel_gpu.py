"""The sm_90a FP8 kernels on an H200: the grouped GEMM of every configuration, recipe and
output form against a float64 reference on the same quantized inputs, and the activation
quantizer against torch.

Per output row and overall, relative error <= 1e-2 (bf16 output); outputs poisoned with
NaN first (every element must be written); ragged and empty experts, unaligned ``offs``,
rows past ``offs[-1]`` (exact zeros), ``a_index`` with out-of-range entries, the models'
shapes, the largest case, CUDA-graph capture (no host sync)."""

import pytest
import torch

import ts_moe

from .fp8_accumulation_model import FP32_OUT_ROW_TOL
from .helpers import counts_to_offs, random_counts

pytestmark = pytest.mark.gpu

RECIPES = ("blockwise", "rowwise", "tensorwise")
CONFIG_NAMES = ("fp8_decode16", "fp8_decode16_n64", "fp8_decode", "fp8_mid", "fp8_prefill",
                "fp8_prefill_c2")
MODELS = {  # E, H, I, top-k
    "mixtral": (8, 4096, 14336, 2),
    "qwen3": (128, 2048, 768, 8),
    "deepseek": (256, 7168, 2048, 8),
}
FP8 = torch.float8_e4m3fn


def L():
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_launch
    return grouped_gemm_fp8_sm90_launch


def C():
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_config
    return grouped_gemm_fp8_sm90_config


def QL():
    from csrc_free_kernels.fp8 import quantize_fp8_sm90_launch
    return quantize_fp8_sm90_launch


# ------------------------------------------------------------------ inputs
def fp8_randn(*shape):
    """e4m3 values of a unit normal (within range: no saturation)."""
    return torch.randn(*shape, device="cuda").to(FP8)


def scales(recipe, m, k, num_experts, n):
    """Random positive dequantization scales in the recipe's shapes (row-major)."""
    kb, nb = -(-k // 128), -(-n // 128)
    r = lambda *s: (torch.rand(*s, device="cuda") + 0.5) * 0.1  # noqa: E731
    if recipe == "blockwise":
        return r(m, kb), r(num_experts, nb, kb)
    if recipe == "rowwise":
        return r(m), r(num_experts, n)
    return r(()), r(num_experts)


def dequant_a(a, sa, recipe):
    """float64 (M, K) of e4m3 ``a`` and its scales."""
    x = a.double()
    if recipe == "blockwise":
        return x * sa.double().repeat_interleave(128, 1)[:, :x.shape[1]]
    if recipe == "rowwise":
        return x * sa.double().unsqueeze(1)
    return x * sa.double()


def dequant_w(w_e, sw, e, recipe):
    """float64 (N, K) of expert ``e``'s e4m3 weight (N, K)."""
    x = w_e.double()
    n, k = x.shape
    if recipe == "blockwise":
        return x * sw[e].double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    if recipe == "rowwise":
        return x * sw[e].double().unsqueeze(1)
    return x * sw[e].double()


def reference(a, w, sa, sw, offs, recipe, swiglu=False):
    """float64 dequantize-then-multiply, expert by expert (reads offs on the host), zeros
    past the last expert; ``w`` the (E, N, K) e4m3 stack."""
    m = a.shape[0]
    num_experts, n, _ = w.shape
    a64 = dequant_a(a, sa, recipe)
    out = torch.zeros(m, n, dtype=torch.float64, device="cuda")
    ends = torch.cummax(offs.long().clamp(0, m), 0).values.tolist()
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            out[start:end] = a64[start:end] @ dequant_w(w[e], sw, e, recipe).T
        start = end
    if swiglu:
        g, u = out[:, :n // 2], out[:, n // 2:]
        out = g * torch.sigmoid(g) * u
    return out


def check(out, ref, offs, tol=1e-2):
    """Every element written; rows past offs[-1] exact zeros; relative error per row
    (rows with a nonzero reference) and overall within ``tol``."""
    assert torch.isfinite(out).all(), "unwritten (NaN) output elements"
    m = out.shape[0]
    end = int(torch.cummax(offs.long().clamp(0, m), 0).values[-1]) if offs.numel() else 0
    assert (out[end:] == 0).all()
    out64 = out.double()
    diff = (out64 - ref).norm(dim=1)
    norm = ref.norm(dim=1)
    rows = norm > 0
    if rows.any():
        per_row = (diff[rows] / norm[rows]).max().item()
        assert per_row <= tol, f"worst row rel err {per_row}"
    overall = ((out64 - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert overall <= tol, f"rel err {overall}"


def run(a, w, sa, sw, offs, recipe, *, swiglu=False, config=None, out_dtype=torch.bfloat16,
        a_index=None):
    """The launch module's entry point on poisoned output, ``w`` (E, N, K) passed as its
    (E, K, N) view; ``config`` None: the one the backend's choose_config takes."""
    rows = a.shape[0] if a_index is None else a_index.shape[0]
    n = w.shape[1] // 2 if swiglu else w.shape[1]
    out = torch.full((rows, n), float("nan"), device="cuda", dtype=out_dtype)
    if config is None:
        backend = L().GROUPED_GEMM_SWIGLU if swiglu else L().GROUPED_GEMM
        config = backend.choose_config(a, w if swiglu else w.transpose(-2, -1), sa, sw, offs,
                                       out, a_index, recipe)
        assert config, config
    got = L().launch(a, w.transpose(-2, -1), sa, sw, offs, out, config, recipe, swiglu=swiglu,
                     a_index=a_index)
    torch.cuda.synchronize()
    assert got is out
    return out


def make(m, k, n, num_experts, recipe, counts=None):
    a, w = fp8_randn(m, k), fp8_randn(num_experts, n, k)
    sa, sw = scales(recipe, m, k, num_experts, n)
    offs = counts_to_offs(random_counts(m, num_experts) if counts is None else counts)
    return a, w, sa, sw, offs


# ------------------------------------------------------------------ GEMM
@pytest.mark.parametrize("name", CONFIG_NAMES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("swiglu", [False, True])
def test_every_configuration(name, recipe, swiglu):
    """Ragged experts (an empty one, odd sizes over several tiles, one row), unaligned
    offs, 19 rows past offs[-1]; a K tail (rowwise/tensorwise) and an N tail (plain)."""
    torch.manual_seed(0)
    k = 512 if recipe == "blockwise" else 528
    n = 512 if swiglu else 400
    counts = [37, 0, 1, 150, 93]
    m = sum(counts) + 19
    a, w, sa, sw, offs = make(m, k, n, 5, recipe, counts)
    out = run(a, w, sa, sw, offs, recipe, swiglu=swiglu, config=C().CONFIGS[name])
    check(out, reference(a, w, sa, sw, offs, recipe, swiglu), offs)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("gemm", ["gate_up", "gate_up_swiglu", "down"])
@pytest.mark.parametrize("tokens", [1, 16, 1024])
@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_model_shapes(model, gemm, tokens, recipe):
    """The three models' expert GEMMs at decode and prefill sizes, tiles from
    choose_config, uniform random routing."""
    torch.manual_seed(1)
    num_experts, h, inter, top_k = MODELS[model]
    n, k = (2 * inter, h) if gemm.startswith("gate_up") else (h, inter)
    a, w, sa, sw, offs = make(tokens * top_k, k, n, num_experts, recipe)
    swiglu = gemm == "gate_up_swiglu"
    out = run(a, w, sa, sw, offs, recipe, swiglu=swiglu)
    check(out, reference(a, w, sa, sw, offs, recipe, swiglu), offs)


@pytest.mark.parametrize("recipe", RECIPES)
def test_skewed_routing(recipe):
    """Zipf-skewed routing (hot experts over many 128-row tiles, many empty ones)."""
    torch.manual_seed(2)
    counts = random_counts(4096, 64, skew=1.2)
    a, w, sa, sw, offs = make(4096, 1024, 768, 64, recipe, counts)
    check(run(a, w, sa, sw, offs, recipe), reference(a, w, sa, sw, offs, recipe), offs)


@pytest.mark.parametrize("name", ["fp8_decode16", "fp8_decode", "fp8_mid", "fp8_prefill_c2"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("swiglu", [False, True])
def test_a_index(name, recipe, swiglu):
    """Rows gathered through ``a_index`` (repeats, out-of-range entries: zero rows) with
    their scales; the output has the index's rows."""
    torch.manual_seed(3)
    m, k, n = 70, 256, 256
    a, w, sa, sw, _ = make(m, k, n, 4, recipe)
    index = torch.randint(-3, m + 3, (200,), device="cuda", dtype=torch.int32)
    index[:2] = torch.tensor([-1, m], device="cuda")
    offs = counts_to_offs([60, 0, 77, 50])  # 13 rows past offs[-1]
    out = run(a, w, sa, sw, offs, recipe, swiglu=swiglu, config=C().CONFIGS[name],
              a_index=index)
    valid = (index >= 0) & (index < m)
    safe = index.long().clamp(0, m - 1)
    ga = torch.where(valid.unsqueeze(1), a.view(torch.uint8)[safe], 0).view(FP8)
    gsa = sa
    if recipe != "tensorwise":
        gsa = torch.where(valid.view(-1, *([1] * (sa.dim() - 1))), sa[safe], 0.0)
    check(out, reference(ga, w, gsa, sw, offs, recipe, swiglu), offs)


def test_degenerate_offs():
    """All rows past the experts (offs all 0): zeros; offs past M and decreasing (the
    kernel segments by cummax(clamp(offs, 0, M))); M = 0; E with no rows at all."""
    torch.manual_seed(4)
    for recipe in RECIPES:
        a, w, sa, sw, _ = make(100, 256, 128, 3, recipe)
        zero = torch.zeros(3, dtype=torch.int32, device="cuda")
        check(run(a, w, sa, sw, zero, recipe), torch.zeros(100, 128, dtype=torch.float64,
                                                           device="cuda"), zero)
        odd = torch.tensor([40, 20, 500], dtype=torch.int32, device="cuda")
        check(run(a, w, sa, sw, odd, recipe), reference(a, w, sa, sw, odd, recipe), odd)
        a0, sa0 = a[:0], (sa[:0] if recipe != "tensorwise" else sa)
        pair = {"blockwise": ("blockwise_1x128", "blockwise_128x128")}.get(recipe,
                                                                          (recipe, recipe))
        with ts_moe.settings.override(fp8_kernels=True):  # M = 0: the op answers it
            out = ts_moe.scaled_grouped_gemm(a0, w.transpose(-2, -1), sa0, pair[0], sw, pair[1],
                                             zero)
        assert out.shape == (0, 128)


def test_output_dtypes():
    """fp32 output: the accumulator, within the WGMMA's 14-bit accumulation of float64
    (FP32_OUT_ROW_TOL: tests/fp8_accumulation_model.py), not rounded to 16 bits;
    fp16 and bf16 outputs: that accumulator rounded once (to nearest even), bit for bit."""
    torch.manual_seed(5)
    a, w, sa, sw, offs = make(300, 512, 256, 4, "blockwise")
    out32 = run(a, w, sa, sw, offs, "blockwise", out_dtype=torch.float32, config=C().MID)
    check(out32, reference(a, w, sa, sw, offs, "blockwise"), offs, tol=FP32_OUT_ROW_TOL)
    live = out32[:int(offs[-1])]
    assert (live != live.bfloat16().float()).float().mean() > 0.9
    for dtype in (torch.float16, torch.bfloat16):
        out = run(a, w, sa, sw, offs, "blockwise", out_dtype=dtype, config=C().MID)
        assert torch.equal(out, out32.to(dtype))


def test_scale_layouts_accepted():
    """Blockwise ``scale_a`` row-major (re-strided by the glue) and already M-major give
    the same result; a non-contiguous ``scale_b`` too."""
    torch.manual_seed(6)
    a, w, sa, sw, offs = make(257, 384, 256, 3, "blockwise")
    fast = L().fast_scale_a(sa)
    assert fast.stride(0) == 1 and fast is L().fast_scale_a(fast)
    out1 = run(a, w, sa, sw, offs, "blockwise")
    out2 = run(a, w, fast, sw.transpose(1, 2).contiguous().transpose(1, 2), offs, "blockwise")
    assert torch.equal(out1, out2)


def test_cuda_graph_capture():
    """Captured once, replayed with new offs written in place: the routing is read on
    the device (no host sync inside the launch)."""
    torch.manual_seed(7)
    a, w, sa, sw, offs = make(512, 512, 384, 8, "blockwise")
    b = w.transpose(-2, -1)
    fast = L().fast_scale_a(sa)
    out = torch.empty(512, 384, dtype=torch.bfloat16, device="cuda")
    config = L().GROUPED_GEMM.choose_config(a, b, fast, sw, offs, out, None, "blockwise")
    L().launch(a, b, fast, sw, offs, out, config, "blockwise")  # compile, warm up
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        L().launch(a, b, fast, sw, offs, out, config, "blockwise")
    for counts in ([64] * 8, [0, 300, 0, 0, 100, 0, 0, 50], [1] * 8):
        offs.copy_(counts_to_offs(counts))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, reference(a, w, sa, sw, offs, "blockwise"), offs)


def test_largest():
    """DeepSeek-V3 gate_up at T = 16384 (131072 slot rows, 256 experts, K = 7168),
    blockwise, skewed routing."""
    torch.manual_seed(8)
    num_experts, h, inter, top_k = MODELS["deepseek"]
    m = 16384 * top_k
    counts = random_counts(m, num_experts, skew=0.8)
    a, w, sa, sw, offs = make(m, h, 2 * inter, num_experts, "blockwise", counts)
    out = run(a, w, sa, sw, offs, "blockwise")
    check(out, reference(a, w, sa, sw, offs, "blockwise"), offs)


# ------------------------------------------------------------------ quantizer
def quantize_ref(x, recipe):
    """torch: scale = amax / 448 per group (fp32), q = (x / scale).to(e4m3), zeros where
    the group is all zeros.  Both true divisions: 448 is a device tensor (torch on CUDA
    multiplies by the rounded reciprocal of a Python number divisor,
    aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu: one ulp off for about half the
    amaxes)."""
    xf = x.float()
    m, k = x.shape
    if recipe == "blockwise_1x128":
        amax = xf.view(m, k // 128, 128).abs().amax(-1)
    elif recipe == "rowwise":
        amax = xf.abs().amax(1)
    else:
        amax = xf.abs().amax()
    scale = amax / torch.full_like(amax, 448.0)
    if recipe == "blockwise_1x128":
        per = scale.repeat_interleave(128, 1)
    elif recipe == "rowwise":
        per = scale.unsqueeze(1)
    else:
        per = scale
    q = torch.where(per > 0, xf / torch.where(per > 0, per, 1.0), 0.0).to(FP8)
    return q, scale


@pytest.mark.parametrize("recipe", ["blockwise_1x128", "rowwise", "tensorwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 128), (7, 256), (1000, 7168), (4099, 2048)])
def test_quantize(recipe, dtype, shape):
    """Bit-identical to torch's division and cast; zero rows give scale 0 and zeros;
    the blockwise scales in the GEMM's M-major layout."""
    torch.manual_seed(9)
    x = (torch.randn(*shape, device="cuda") * 3).to(dtype)
    x[1::5] = 0  # zero rows (and, blockwise, zero groups); (1, 128) keeps its one row
    q, scale = QL().quantize(x, recipe)
    torch.cuda.synchronize()
    ref_q, ref_scale = quantize_ref(x, recipe)
    assert q.dtype == FP8 and q.shape == x.shape
    assert torch.isfinite(q.float()).all() and torch.isfinite(scale).all()
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    if recipe == "blockwise_1x128":
        assert scale.stride(0) == 1 and scale.stride(1) % 4 == 0
        assert scale.stride(1) >= shape[0]
    if recipe == "tensorwise":
        assert scale.dim() == 0


def test_quantize_then_gemm():
    """The quantizer's blockwise output straight into the GEMM: within FP8's error of
    the unquantized bf16 product."""
    torch.manual_seed(10)
    m, k, n, num_experts = 2048, 2048, 1536, 8
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(num_experts, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    q, sa = QL().quantize(x, "blockwise_1x128")
    amax = w.float().view(num_experts, n // 128, 128, k // 128, 128).abs().amax((2, 4))
    sw = amax / 448.0
    wq = (w.float() / sw.repeat_interleave(128, 1).repeat_interleave(128, 2)).to(FP8)
    offs = counts_to_offs(random_counts(m, num_experts))
    out = run(q, wq, sa, sw, offs, "blockwise")
    check(out, reference(q, wq, sa, sw, offs, "blockwise"), offs)
    exact = torch.zeros(m, n, dtype=torch.float64, device="cuda")
    start = 0
    for e, end in enumerate(offs.tolist()):
        exact[start:end] = x[start:end].double() @ w[e].double().T
        start = end
    err = ((out.double() - exact).norm() / exact.norm()).item()
    assert err < 6e-2, err  # two e4m3 roundings (3 mantissa bits) per product
