"""``ts_moe.quantize_fp8(x, recipe) -> (x_fp8, scale)``: e4m3 values and their fp32
dequantization scales, ``scale = amax / 448`` per group of ``recipe``.

Activations (a 2-D x (M, K)): ``blockwise_1x128`` (M, ceil(K/128)), ``rowwise``
(M,), ``tensorwise`` 0-d.  Weights (x (..., N, K), e.g. an (E, N, K) stack):
``blockwise_128x128`` (..., ceil(N/128), ceil(K/128)), per channel ``rowwise``
(..., N), per matrix ``tensorwise`` (...).  A group of zeros gets scale 0 and
zero values (it dequantizes to 0; nothing is NaN).  Rounding: to nearest even,
saturated at +-448 (:mod:`ts_moe.fp8.reference`).

Layouts: ``x_fp8`` contiguous; ``scale`` in the GEMM's fast layout
(:meth:`ts_moe.fp8.recipes.Recipe.scale_strides`: ``blockwise_1x128`` M-major, the
others contiguous), on every path, so the result feeds
:func:`ts_moe.scaled_grouped_gemm` without a copy.

``torch.ops.ts_moe.quantize_fp8``: on sm_90 (unless ``ts_moe.use_fp8_kernels(False)``)
an activation runs the quantize kernel (one pass; ``csrc_free_kernels.fp8.quantize_fp8_sm90_launch``),
everything else the plain-torch reference on its device (no host sync either way): the
paths' quantizers (:mod:`ts_moe.ops.paths`).  No backward
(:func:`ts_moe.ops.library.define_inference_op`).
"""

import torch

from ..fp8.recipes import E4M3, Recipe, check_quantize_args, schema_recipe
from . import paths
from .backend import Op, run_first
from .library import define_inference_op


def _in_fast_layout(scale: torch.Tensor, recipe: Recipe, shape) -> torch.Tensor:
    strides = recipe.scale_strides(shape)
    if scale.stride() == strides or scale.numel() == 1:
        return scale
    return torch.empty_strided(scale.shape, strides, dtype=scale.dtype,
                               device=scale.device).copy_(scale)


def _quantize_impl(x, recipe):
    recipe = check_quantize_args(x, recipe)
    q, scale = run_first(paths.device_backends(Op.QUANTIZE_FP8, x), x, recipe)
    return q, _in_fast_layout(scale, recipe, x.shape)


def _quantize_fake(x, recipe):
    recipe = check_quantize_args(x, recipe)
    return (x.new_empty(x.shape, dtype=E4M3),
            x.new_empty_strided(recipe.scale_shape(x.shape), recipe.scale_strides(x.shape),
                                dtype=recipe.scale_dtype))


_quantize_op = define_inference_op("quantize_fp8(Tensor x, str recipe) -> (Tensor, Tensor)",
                                   _quantize_impl, _quantize_fake, "ts_moe.quantize_fp8", (0,))


def quantize_fp8(x: torch.Tensor, recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scale)`` of ``x`` by ``recipe`` (a ``torch.nn.functional.ScalingType``
    member, a :class:`ts_moe.fp8.recipes.Recipe`, or either's name); see
    :mod:`ts_moe.ops.quantize`."""
    recipe = schema_recipe(recipe, "recipe")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    return _quantize_op(x, recipe)
