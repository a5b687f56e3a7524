"""``ts_moe.quantize_fp8(x, recipe) -> (x_fp8, scale)``: e4m3 values and their fp32
dequantization scales, ``scale = amax / 448`` per group of ``recipe``.

Activations (a 2-D x (M, K)): ``blockwise_1x128`` (M, ceil(K/128)), ``rowwise``
(M,), ``tensorwise`` 0-d.  Weights (x (..., N, K), e.g. an (E, N, K) stack):
``blockwise_128x128`` (..., ceil(N/128), ceil(K/128)), per channel ``rowwise``
(..., N), per matrix ``tensorwise`` (...).  A group of zeros gets scale 0 and
zero values (it dequantizes to 0; nothing is NaN).  Rounding: to nearest even,
saturated at +-448 (:mod:`ts_moe.fp8.reference`).

Layouts: ``x_fp8`` contiguous; ``scale`` in the GEMM's fast layout
(:func:`ts_moe.fp8.recipes.scale_strides`: ``blockwise_1x128`` M-major, the others
contiguous), on every path, so the result feeds
:func:`ts_moe.scaled_grouped_gemm` without a copy.

``torch.ops.ts_moe.quantize_fp8``: on sm_90 an activation runs the quantize
kernel (one pass; ``csrc_free_kernels.quantize_fp8_sm90_launch``), everything
else the plain-torch reference on its device (no host sync either way).  No
backward (:mod:`ts_moe.fp8.library`).
"""

import math

import torch

from .library import define_inference_op
from .paths import kernel_input, quantize_kernel_for
from .recipes import E4M3, check_quantize_args, recipe_arg, scale_shape, scale_strides
from .reference import quantize_reference


def _in_fast_layout(scale: torch.Tensor, recipe: str, shape) -> torch.Tensor:
    strides = scale_strides(recipe, shape)
    if scale.stride() == strides or scale.numel() == 1:
        return scale
    return torch.empty_strided(scale.shape, strides, dtype=scale.dtype,
                               device=scale.device).copy_(scale)


def _reference(x: torch.Tensor, recipe: str):
    """:func:`quantize_reference` a matrix at a time where x has leading dims (an
    (E, N, K) stack: one expert's fp32 temporaries at a time).  The stack is
    counted, not inferred (``-1``), so that empty matrices (an (E, 0, K) stack)
    get the shapes the fake kernel gives."""
    if x.dim() == 2:
        return quantize_reference(x, recipe)
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    scale = torch.empty(scale_shape(recipe, x.shape), dtype=torch.float32, device=x.device)
    stack = math.prod(x.shape[:-2])
    flat_q = q.view(stack, *x.shape[-2:])
    flat_s = scale.view(stack, *scale.shape[x.dim() - 2:])
    for i, matrix in enumerate(x.reshape(stack, *x.shape[-2:])):
        flat_q[i], flat_s[i] = quantize_reference(matrix, recipe)
    return q, scale


def _quantize_impl(x, recipe):
    recipe = check_quantize_args(x, recipe)
    kernels = quantize_kernel_for(x, recipe)
    if kernels is not None:
        q, scale = kernels.quantize(kernel_input(x), recipe)
    else:
        q, scale = _reference(x, recipe)
    return q, _in_fast_layout(scale, recipe, x.shape)


def _quantize_fake(x, recipe):
    recipe = check_quantize_args(x, recipe)
    return (x.new_empty(x.shape, dtype=E4M3),
            x.new_empty_strided(scale_shape(recipe, x.shape), scale_strides(recipe, x.shape),
                                dtype=torch.float32))


_quantize_op = define_inference_op("quantize_fp8(Tensor x, str recipe) -> (Tensor, Tensor)",
                                   _quantize_impl, _quantize_fake, "ts_moe.quantize_fp8", (0,))


def quantize_fp8(x: torch.Tensor, recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scale)`` of ``x`` by ``recipe`` (a name or a
    ``torch.nn.functional.ScalingType``); see :mod:`ts_moe.fp8.quantize`."""
    recipe = recipe_arg(recipe, "recipe")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    return _quantize_op(x, recipe)
