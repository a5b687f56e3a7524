"""FP8 (e4m3) experts: the scaled grouped GEMM ops and quantization, variants of the op
families of :mod:`ts_moe.ops` (the same registration, Protocols and kernel imports).

* :mod:`.recipes`: :class:`~.recipes.Recipe` and :class:`~.recipes.Pair`, the one value a
  scaling recipe is, and the ops' argument checks, which parse it;
* :mod:`.reference`: plain-torch quantization, dequantization and GEMM references;
* :mod:`.backends`: the families' backends besides the kernels (torch's FP8 GEMM, the
  dequantize fallback of :mod:`.dequantize_path`, the reference);
* :mod:`.paths`: which backends a call tries on each device;
* :mod:`.scaled_ops`: ``torch.ops.ts_moe.scaled_grouped_gemm`` (and its SwiGLU form);
* :mod:`.quantize`: ``torch.ops.ts_moe.quantize_fp8``.
"""

from ..loaders import load_fp8_experts
from .paths import fp8_kernels_enabled, use_fp8_kernels
from .quantize import quantize_fp8
from .recipes import RECIPES, Pair, Recipe
from .scaled_ops import scaled_grouped_gemm, scaled_grouped_gemm_swiglu
from ..tiny import make_tiny_fp8_checkpoint

__all__ = ["quantize_fp8", "scaled_grouped_gemm", "scaled_grouped_gemm_swiglu",
           "load_fp8_experts", "make_tiny_fp8_checkpoint", "RECIPES", "Recipe", "Pair",
           "use_fp8_kernels", "fp8_kernels_enabled"]
