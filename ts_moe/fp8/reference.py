"""Plain-torch references of the FP8 ops: the CPU kernels, the fallback's dequantization,
and the tests' yardstick (any accumulation dtype: fp32 for the op, float64 for checks).

Quantization (:func:`quantize_reference`): per group of the recipe's format
(:mod:`ts_moe.fp8.recipes`) ``scale = amax / 448`` in fp32 (MX: a power of two) and
``x_fp8 = satfinite(x / scale)`` (round to nearest even), as the sm_90 quantize kernel
does; a group whose scale is 0 (all
zeros, or an amax so small that amax / 448 underflows) gets scale 0 and zero
elements, so that it dequantizes to exactly 0 and nothing is NaN.  Both are true
divisions on every device: the divisor 448 is a tensor on x's device, since torch on
CUDA turns a division by a Python number into a multiply by its rounded reciprocal
(one ulp off for about half the amaxes;
``bench/notes/2026-12-06-fp8-first-gpu-pass.md``).
"""

import torch

from ..reference import gather_rows, segment_ends, swiglu
from .recipes import E4M3, Recipe


def expand_scale(scale: torch.Tensor, recipe: str, shape) -> torch.Tensor:
    """``scale`` of ``recipe`` broadcast to every element of a tensor of ``shape``
    (..., R, C), from its format's block (a view where it can be one)."""
    *lead, rows, cols = shape
    recipe = Recipe(recipe)
    br, bc = recipe.format.block
    full = scale.reshape(recipe.scale_shape(shape))  # a one-element tensorwise scale too
    full = full.unsqueeze(-1) if bc is None else full  # the column dim
    full = full.unsqueeze(-2) if br is None else full  # the row dim
    if br not in (None, 1):
        full = full.repeat_interleave(br, dim=-2)[..., :rows, :]
    if bc not in (None, 1):
        full = full.repeat_interleave(bc, dim=-1)[..., :cols]
    return full.expand(shape)


def dequantize(x: torch.Tensor, scale: torch.Tensor, recipe: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x`` (..., R, C) e4m3 times its ``scale`` of ``recipe``, in ``dtype`` (the product
    formed in fp32, or float64 for float64)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return (x.to(acc) * expand_scale(scale.to(acc), recipe, x.shape)).to(dtype)


def _amax(x: torch.Tensor, recipe: str) -> torch.Tensor:
    """Largest magnitude per group of ``recipe`` (its format's block) over x (..., R, C),
    in x's dtype; 0 for an empty group."""
    mag = x.abs()
    br, bc = Recipe(recipe).format.block
    *lead, rows, cols = mag.shape
    mag = torch.nn.functional.pad(mag, (0, 0 if bc is None else -cols % bc,
                                        0, 0 if br is None else -rows % br))
    mag = mag.unflatten(-1, (1, -1) if bc is None else (-1, bc))  # (..., R, Cb, bc)
    mag = mag.unflatten(-3, (1, -1) if br is None else (-1, br))  # (..., Rb, br, Cb, bc)
    amax = (mag.amax(dim=(-3, -1)) if mag.numel()
            else mag.new_zeros(*mag.shape[:-3], mag.shape[-2]))  # (..., Rb, Cb)
    if bc is None:  # a whole row is one group: no column dim
        amax = amax.squeeze(-1)
    if br is None:  # the whole column: no row dim
        amax = amax.squeeze(-1 if bc is None else -2)
    return amax


def _scale_of(amax: torch.Tensor, fmt) -> torch.Tensor:
    """The scale of a group of largest magnitude ``amax``: ``amax / element_max`` in fp32
    (a true division: torch on CUDA would multiply by a rounded reciprocal of a Python
    number), or, for power-of-two scales, ``2 ** (floor(log2 amax) - floor(log2
    element_max))`` (OCP Microscaling v1.0; an all-zero group the smallest scale)."""
    if not fmt.power_of_two:
        return (amax / amax.new_full((), fmt.element_max)).to(torch.float32)
    emax = float(torch.tensor(fmt.element_max).log2().floor())
    exponent = torch.where(amax > 0, amax.log2().floor() - emax, amax.new_full((), -127.0))
    return torch.exp2(exponent.clamp(-127, 127)).to(getattr(torch, fmt.scale))


def quantize_reference(x: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scale)`` of ``x`` (..., R, C) by ``recipe``: x_fp8 e4m3 of x's shape
    (contiguous), scale of the recipe's scale type and :meth:`Recipe.scale_shape`
    (contiguous)."""
    fmt = Recipe(recipe).format
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    scale = _scale_of(_amax(xf, recipe), fmt)
    full = expand_scale(scale.to(acc), recipe, x.shape)
    q = torch.where(full > 0, xf / torch.where(full > 0, full, 1), 0)
    return (q.clamp_(-fmt.element_max, fmt.element_max).to(getattr(torch, fmt.element))
            .contiguous(), scale.contiguous())


def gather_fp8_rows(a: torch.Tensor, a_index: torch.Tensor) -> torch.Tensor:
    """``a[a_index]`` of an e4m3 ``a`` (M, K); an index outside [0, M) reads as a zero row
    (:func:`ts_moe.reference.gather_rows` on the bytes: +0 is the byte 0x00)."""
    return gather_rows(a.view(torch.uint8), a_index).view(E4M3)


def gather_scale_rows(scale: torch.Tensor, recipe: str, a_index: torch.Tensor) -> torch.Tensor:
    """The activation scale of the rows ``a[a_index]`` (0 for an index out of range; a
    tensorwise scale as it is)."""
    if recipe == Recipe.TENSORWISE:
        return scale
    if recipe == Recipe.ROWWISE:
        return gather_rows(scale.unsqueeze(1), a_index).squeeze(1)
    return gather_rows(scale, a_index)


def scaled_grouped_gemm_reference(a, b, scale_a, recipe_a, scale_b, recipe_b, offs,
                                  out_dtype=torch.bfloat16, a_index=None,
                                  acc: torch.dtype = torch.float32) -> torch.Tensor:
    """``out[r] = dequant(a)[r] @ dequant(b[e])`` for the rows of expert ``e``, zeros
    past the last one, accumulated in ``acc`` (fp32: the op's CPU kernel; float64:
    the tests' yardstick).  ``b`` (E, K, N) is dequantized as stored, (E, N, K).
    Reads ``offs`` on the host (a sync on a GPU)."""
    if a_index is not None:
        scale_a = gather_scale_rows(scale_a, recipe_a, a_index)
        a = gather_fp8_rows(a, a_index)
    m, n = a.shape[0], b.shape[2]
    out = torch.zeros(m, n, dtype=out_dtype, device=a.device)
    if out.numel() == 0 or b.shape[0] == 0:
        return out
    x = dequantize(a, scale_a, recipe_a, acc)
    start = 0
    for e, end in enumerate(segment_ends(offs, m).tolist()):
        if end > start:
            w = dequantize(b[e].transpose(0, 1), scale_b[e], recipe_b, acc)  # (N, K)
            out[start:end] = (x[start:end] @ w.t()).to(out_dtype)
        start = end
    return out


def scaled_grouped_gemm_swiglu_reference(a, gate_up, scale_a, recipe_a, scale_b, recipe_b,
                                         offs, out_dtype=torch.bfloat16, a_index=None,
                                         acc: torch.dtype = torch.float32) -> torch.Tensor:
    """``silu(a @ gate^T) * (a @ up^T)`` per expert of the dequantized operands, ``gate_up``
    (E, 2I, K) e4m3, gate rows first: the GEMM in ``acc``, the activation in ``acc``,
    one rounding to ``out_dtype``."""
    h = scaled_grouped_gemm_reference(a, gate_up.transpose(-2, -1), scale_a, recipe_a, scale_b,
                                      recipe_b, offs, acc, a_index, acc)
    return swiglu(h, out_dtype)
