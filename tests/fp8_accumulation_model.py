"""A CPU model of the sm_90 FP8 kernels' arithmetic, for the tolerances of the GPU tests
that compare them with float64.

Hopper's e4m3 WGMMA does not accumulate in fp32.  The DeepSeek-V3 report (arXiv
2412.19437, section 3.5.2): "After aligning 32 mantissa products by right-shifting based
on the maximum exponent, the Tensor Core only uses the highest 14 bits of each mantissa
product for addition, and truncates bits exceeding this range.  The accumulation of
addition results into registers also employs 14-bit precision."  SageAttention2 (arXiv
2411.10958) measured the accumulator as 1 sign, 8 exponent and 13 mantissa bits,
truncated.  :func:`wgmma_k128` is that, one k32 WGMMA per 32 products, with the
truncation toward zero (``"rz"``) or toward -inf (``"floor"``, a sign-filled shift of a
two's complement mantissa): the report does not say which, so the tolerances cover both.
``"exact"`` is fp32-faithful accumulation, for comparison.

The kernel (``csrc_free_kernels.fp8.grouped_gemm_fp8_sm90``) promotes each 128-K stage's
partial into fp32 (blockwise: one FFMA with ``sa * sb``; else an add, the scales
multiplying the sum before the epilogue): :func:`fp8_gemm`.  :func:`fp8_layer_rows`
runs the FP8 MoE layer's two GEMMs so (``ts_moe.experts``): the SwiGLU output, rounded to
bf16, is quantized again, and a value the truncations move across an e4m3 rounding
boundary moves by a whole e4m3 step, which the float64 reference (on the intermediate it
computes itself) cannot follow.  ``bench/notes/2026-12-06-fp8-first-gpu-pass.md``.
"""

import torch
import torch.nn.functional as F

import ts_moe
from ts_moe.fp8.recipes import BLOCK, Recipe

GROUP = 32   # products aligned together: one k32 WGMMA
BITS = 14    # kept of each aligned product, and of the accumulator
STAGE_K = 128
MODES = ("exact", "rz", "floor")

# float64 comparisons of the kernels' results, derived from the model
# (tests/test_fp8_accumulation_model.py checks the model stays inside them):
FP32_OUT_ROW_TOL = 2e-3   # the GEMM's fp32 output, per row (the model: <= 8.5e-4)
LAYER_ROW_TOL = 3e-2      # the FP8 layer on the GPU, per row (the model: <= 2.2e-2)
LAYER_TOL = 1.5e-2        # and overall (the model: <= 1.1e-2)


def _exponent(v: torch.Tensor) -> torch.Tensor:
    """floor(log2 |v|), exact (frexp); 0 reads as -1 (its quantum is never used)."""
    return torch.frexp(v)[1] - 1


def _cut(v: torch.Tensor, quantum: torch.Tensor, mode: str) -> torch.Tensor:
    q = v / quantum  # a power of 2: exact
    return (torch.trunc(q) if mode == "rz" else torch.floor(q)) * quantum


def _quantum(exponent: torch.Tensor) -> torch.Tensor:
    """The last kept bit's value below a leading bit of ``exponent``."""
    return torch.ldexp(torch.ones(exponent.shape), exponent - (BITS - 1))


def wgmma_k128(a: torch.Tensor, w: torch.Tensor, mode: str) -> torch.Tensor:
    """The partial of one ring stage, (R, N) float64: ``a`` (R, 128) and ``w`` (N, 128)
    e4m3 values in float64, four k32 WGMMAs, the first not accumulating.  The
    truncating modes work in fp32, exactly: e4m3 products have 8 bits, an aligned sum
    of 32 of them and the accumulator 19."""
    if mode == "exact":
        return a @ w.T
    a, w = a.float(), w.float()
    d = a.new_zeros(a.shape[0], w.shape[0])
    for g in range(0, a.shape[1], GROUP):
        p = a[:, None, g:g + GROUP] * w[None, :, g:g + GROUP]  # exact products
        top = torch.maximum(_exponent(p.abs().amax(-1)), _exponent(d))
        s = d + _cut(p, _quantum(top)[..., None], mode).sum(-1)  # exact
        d = _cut(s, _quantum(_exponent(s)), mode)
    return d.double()


def fp8_gemm(a, w, sa, sw, blockwise: bool, mode: str) -> torch.Tensor:
    """One expert's rows as the kernel computes them, fp32 (R, N): ``a`` (R, K) and ``w``
    (N, K) e4m3; blockwise ``sa`` (R, K/128) and ``sw`` (N, K/128) (one weight scale per
    column, its block's), else ``sa`` (R,) and ``sw`` (N,)."""
    a64, w64 = a.double(), w.double()
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32)
    for kb in range(a.shape[1] // STAGE_K):
        k = slice(kb * STAGE_K, (kb + 1) * STAGE_K)
        part = wgmma_k128(a64[:, k], w64[:, k], mode).float()
        if blockwise:  # fma.rn.f32: one rounding
            s = sa[:, kb, None].float() * sw[None, :, kb].float()
            acc = (acc.double() + part.double() * s.double()).float()
        else:
            acc = acc + part
    if not blockwise:
        acc = acc * (sa.float()[:, None] * sw.float()[None, :])
    return acc


def _weight_scales(scale, recipe, e, n):
    """Expert ``e``'s weight scales as :func:`fp8_gemm` takes them, for ``n`` rows."""
    if recipe == Recipe.BLOCKWISE_128X128:
        return scale[e].repeat_interleave(BLOCK, 0)[:n]
    if recipe == Recipe.TENSORWISE:  # served as per-channel scales
        return scale[e].expand(n)
    return scale[e]


def fp8_layer_rows(x, router, gq, gs, dq, ds, top_k, recipe, mode) -> torch.Tensor:
    """``ts_moe.moe_forward`` on FP8 experts (one weight recipe) as the sm_90 kernels
    compute it, (T, H) in x's dtype: the activations quantized as ts_moe does (the
    quantize kernel is bit-identical to it), each GEMM by :func:`fp8_gemm`, SwiGLU in
    fp32 rounded to x's dtype, the down output in x's dtype, the combine in fp32."""
    recipe = Recipe.parse(recipe)
    act = recipe.activation
    blockwise = act == Recipe.BLOCKWISE_1X128
    inter = gq.shape[1] // 2
    weights, experts = ts_moe.route(F.linear(x, router), top_k)
    xq, sx = ts_moe.quantize_fp8(x, act)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(gq.shape[0]):
        tokens, slots = (experts == e).nonzero(as_tuple=True)
        if not tokens.numel():
            continue
        h = fp8_gemm(xq[tokens], gq[e], sx[tokens], _weight_scales(gs, recipe, e, 2 * inter),
                     blockwise, mode)
        a = (F.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype)
        aq, sa = ts_moe.quantize_fp8(a, act)
        y = fp8_gemm(aq, dq[e], sa, _weight_scales(ds, recipe, e, dq.shape[1]), blockwise,
                     mode).to(x.dtype)
        out.index_add_(0, tokens, weights[tokens, slots, None] * y.float())
    return out.to(x.dtype)
