"""FP8 (e4m3) formats: what the FP8 ops (:mod:`ts_moe.ops.scaled`,
:mod:`ts_moe.ops.quantize`) and the loaders build on.

* :mod:`.recipes`: :class:`~.recipes.Recipe` and :class:`~.recipes.Pair`, the one value a
  scaling recipe is, and the ops' argument checks, which parse it;
* :mod:`.reference`: plain-torch quantization, dequantization and GEMM references;
* :mod:`.backends`: the FP8 families' backends besides the kernels (torch's FP8 GEMM, the
  dequantize fallback of :mod:`.dequantize_path`, the reference).
"""

from .recipes import RECIPES, Pair, Recipe

__all__ = ["RECIPES", "Pair", "Recipe"]
