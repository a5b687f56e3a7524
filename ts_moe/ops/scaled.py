"""``torch.ops.ts_moe.scaled_grouped_gemm`` and its SwiGLU form: FP8 grouped GEMMs.

``scaled_grouped_gemm(a, b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs, *,
out_dtype=torch.bfloat16, a_index=None)`` follows
``torch.nn.functional.scaled_grouped_mm`` (2-D ``a``, 3-D ``b``):

- ``a`` (M, K) e4m3, ``b`` (E, K, N) e4m3: the ``.transpose(-2, -1)`` view of the
  (E, N, K) checkpoint stack; ``offs`` int32 (E,) cumulative row ends, read on the
  device only: any values work as in :func:`ts_moe.grouped_gemm` (segment ends
  ``cummax(clamp(offs, 0, M))``, rows past the last one are zeros);
- recipes (names, or ``torch.nn.functional.ScalingType`` members) and scale
  shapes (:mod:`ts_moe.fp8.recipes`): ``blockwise_1x128`` ``scale_a`` (M, K/128)
  with ``blockwise_128x128`` ``scale_b`` (E, ceil(N/128), K/128) (K a multiple of
  128); ``rowwise`` (M,) with (E, N); ``tensorwise`` a one-element ``scale_a`` with
  (E,).  Scales multiply: out = sum_k (a x scale_a) (b x scale_b);
- ``a_index`` int32 (M',): the rows are ``a[a_index]`` with their scales (an index
  outside [0, M) reads as a zero row), output (M', N); ``scale_a`` stays per row of
  ``a``, so token rows quantized once serve every slot that gathers them.

Layouts: any strides are accepted.  The fast ones, which the sm_90 kernels read
in place: ``a`` row-major with a 16-byte row stride; ``b`` K-major (the
transposed view of a contiguous (E, N, K) stack); ``scale_a`` of
``blockwise_1x128`` M-major, stride (1, Mp) with Mp the rows rounded up to 4
(what :func:`ts_moe.quantize_fp8` returns), other scales contiguous.  Other
layouts are copied into these on every call (a weight copy per call: convert
the weights once instead).

Bad input (types, shapes, recipe pairs, K for blockwise, e5m2) is a TypeError or
ValueError naming the argument before any kernel, on every path and under
``torch.compile`` (the fake kernel runs the same checks).  No backward
(:func:`ts_moe.ops.library.define_inference_op`).  Paths: :mod:`ts_moe.ops.paths`.
"""

import torch

from ..fp8.recipes import Pair, check_scaled_args, remember_ready, scaled_call_ready, \
    schema_recipe
from ..reference import swiglu
from . import paths
from .backend import Op, OutputSpec, fused_or_split, take
from .layout import empty_output
from .library import define_inference_op


_ARGS = ("Tensor a, Tensor {b}, Tensor scale_a, str scale_recipe_a, Tensor scale_b, "
         "str scale_recipe_b, Tensor offs, ScalarType? out_dtype=None, Tensor? a_index=None")
# (out_dtype and a_index are not keyword-only in the schema, so that every kernel,
# the Autograd one included, takes the arguments positionally; the Python functions
# below keep them keyword-only)


def run_gemm(backends: tuple, a, b, scale_a, scale_b, offs, out_dtype, pair: Pair,
             a_index=None) -> torch.Tensor:
    """A validated ``scaled_grouped_gemm`` on the first of ``backends`` (its paths', or
    one a caller names) that takes it, the degenerate sizes answered here."""
    m = (a if a_index is None else a_index).shape[0]
    num_experts, k, n = b.shape
    if 0 in (m, n, k, num_experts):
        return empty_output(a, m, n, out_dtype).zero_()

    def run_on(backend, config):
        # a backend that returns its own tensor (torch's) is given none to leave unused
        out = None if backend.allocates else empty_output(a, m, n, out_dtype)
        return backend.run(a, b, scale_a, scale_b, offs, out, config, pair, a_index=a_index)

    return take(backends, (a, b, scale_a, scale_b, offs, OutputSpec((m, n), out_dtype), a_index,
                           pair), run_on)


def run_swiglu(pairs: tuple, a, gate_up, scale_a, scale_b, offs, out_dtype, pair: Pair,
               a_index=None) -> torch.Tensor:
    """A validated ``scaled_grouped_gemm_swiglu``: per ``(fused, GEMM)`` pair of backends
    (a path's), in order, the fused one where it takes the call, else the GEMM to fp32
    and the activation apart (one rounding) where that takes it
    (:func:`ts_moe.ops.backend.fused_or_split`)."""
    m = (a if a_index is None else a_index).shape[0]
    num_experts, two_i, k = gate_up.shape
    out = empty_output(a, m, two_i // 2, out_dtype)
    if 0 in (m, two_i, k, num_experts):
        return out.zero_()
    b = gate_up.transpose(-2, -1)

    def run_on(backend, config, fused):
        if fused:
            return backend.run(a, gate_up, scale_a, scale_b, offs, out, config, pair,
                               a_index=a_index)
        wide = None if backend.allocates else empty_output(a, m, two_i, torch.float32)
        h = backend.run(a, b, scale_a, scale_b, offs, wide, config, pair, a_index=a_index)
        return out.copy_(swiglu(h, out_dtype))

    return fused_or_split(
        pairs, (a, gate_up, scale_a, scale_b, offs, out, a_index, pair),
        (a, b, scale_a, scale_b, offs, OutputSpec((m, two_i), torch.float32), a_index, pair),
        run_on)


# --------------------------------------------------------------- the ops
def _validated(a, b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs, out_dtype,
               a_index, swiglu=False) -> Pair:
    """The call's recipes: from the hot path where its metadata pass, else from the full
    check (which raises, naming the argument), remembered for the next call."""
    args = (a, b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs, out_dtype)
    pair = scaled_call_ready(*args, a_index=a_index, swiglu=swiglu)
    if pair is None:
        pair = check_scaled_args(*args, a_index=a_index, swiglu=swiglu)
        remember_ready(scale_recipe_a, scale_recipe_b, pair)
    return pair


def _gemm_impl(a, b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs,
               out_dtype=None, a_index=None):
    pair = _validated(a, b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs, out_dtype,
                      a_index)
    return run_gemm(paths.backends(Op.SCALED_GROUPED_GEMM, paths.device_capability(a)),
                    a, b, scale_a, scale_b, offs, out_dtype or torch.bfloat16, pair, a_index)


def _swiglu_impl(a, gate_up, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs,
                 out_dtype=None, a_index=None):
    pair = _validated(a, gate_up, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs,
                      out_dtype, a_index, swiglu=True)
    return run_swiglu(paths.pairs(Op.SCALED_GROUPED_GEMM_SWIGLU, Op.SCALED_GROUPED_GEMM,
                                  paths.device_capability(a)),
                      a, gate_up, scale_a, scale_b, offs, out_dtype or torch.bfloat16, pair,
                      a_index)


def _gemm_fake(a, b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs,
               out_dtype=None, a_index=None):
    check_scaled_args(a, b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs, out_dtype,
                      a_index=a_index)
    m = (a if a_index is None else a_index).shape[0]
    return empty_output(a, m, b.shape[2], out_dtype or torch.bfloat16)


def _swiglu_fake(a, gate_up, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs,
                 out_dtype=None, a_index=None):
    check_scaled_args(a, gate_up, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs,
                      out_dtype, a_index=a_index, swiglu=True)
    m = (a if a_index is None else a_index).shape[0]
    return empty_output(a, m, gate_up.shape[1] // 2, out_dtype or torch.bfloat16)


_gemm_op = define_inference_op("scaled_grouped_gemm(" + _ARGS.format(b="b") + ") -> Tensor",
                               _gemm_impl, _gemm_fake, "ts_moe.scaled_grouped_gemm",
                               (0, 1, 2, 4))
_swiglu_op = define_inference_op(
    "scaled_grouped_gemm_swiglu(" + _ARGS.format(b="gate_up") + ") -> Tensor",
    _swiglu_impl, _swiglu_fake, "ts_moe.scaled_grouped_gemm_swiglu", (0, 1, 2, 4))


def _call(op, a, b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs, out_dtype,
          a_index, b_name):
    """The op with the recipes as names (what its schema takes); arguments that the
    dispatcher would reject with a generic message are named here first (under
    ``torch.compile(fullgraph=True)`` dynamo reports these as an "observed exception"
    that carries the same TypeError; everything else is the op's to judge, alike on
    every path)."""
    recipe_a = schema_recipe(scale_recipe_a, "scale_recipe_a")
    recipe_b = schema_recipe(scale_recipe_b, "scale_recipe_b")
    for name, t in (("a", a), (b_name, b), ("scale_a", scale_a), ("scale_b", scale_b),
                    ("offs", offs), ("a_index", a_index)):
        if not isinstance(t, torch.Tensor) and not (name == "a_index" and t is None):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype, got {type(out_dtype).__name__}")
    return op(a, b, scale_a, recipe_a, scale_b, recipe_b, offs, out_dtype=out_dtype,
              a_index=a_index)


def scaled_grouped_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                        scale_recipe_a, scale_b: torch.Tensor, scale_recipe_b,
                        offs: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                        a_index: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.ops.ts_moe.scaled_grouped_gemm``: ``out[r] = (a[r] x scale_a) @ (b[e] x
    scale_b)`` for the rows of expert ``e``, e4m3 operands, fp32 accumulation;
    (M, N) (or (M', N) with ``a_index``) in ``out_dtype`` (bf16, fp16 or fp32).
    Conventions, recipes, layouts and paths: :mod:`ts_moe.ops.scaled`."""
    return _call(_gemm_op, a, b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs,
                 out_dtype, a_index, "b")


def scaled_grouped_gemm_swiglu(a: torch.Tensor, gate_up: torch.Tensor, scale_a: torch.Tensor,
                               scale_recipe_a, scale_b: torch.Tensor, scale_recipe_b,
                               offs: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                               a_index: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(a @ gate^T) * (a @ up^T)`` per expert of FP8 operands:
    ``torch.ops.ts_moe.scaled_grouped_gemm_swiglu``.  ``gate_up`` (E, 2I, K) e4m3 as
    stored (gate rows first; not transposed, as :func:`ts_moe.grouped_gemm_swiglu`
    takes it), ``scale_b`` of its recipe over (E, 2I, K).  Returns (M, I) in
    ``out_dtype``: fp32 GEMM and activation, one rounding - except on sm_90's rowwise
    path with the FP8 kernels switched off, ``torch._scaled_grouped_mm``, whose output is
    bf16 only: there the GEMM's output is rounded to bf16, then the activation
    (two roundings).  Otherwise as :func:`scaled_grouped_gemm`."""
    return _call(_swiglu_op, a, gate_up, scale_a, scale_recipe_a, scale_b, scale_recipe_b,
                 offs, out_dtype, a_index, "gate_up")
