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
(:mod:`ts_moe.fp8.library`).  Paths: :mod:`ts_moe.fp8.paths`.
"""

import torch

from ..reference import segment_ends, swiglu
from ..ops.layout import empty_output
from . import dequantize_path
from .library import define_inference_op
from .paths import ALIGN, Fp8Path, gemm_kernels, scaled_path
from .recipes import ROWWISE, check_scaled_args, recipe_arg
from .reference import (gather_fp8_rows, gather_scale_rows, scaled_grouped_gemm_reference,
                        scaled_grouped_gemm_swiglu_reference)

_ARGS = ("Tensor a, Tensor {b}, Tensor scale_a, str scale_recipe_a, Tensor scale_b, "
         "str scale_recipe_b, Tensor offs, ScalarType? out_dtype=None, Tensor? a_index=None")
# (out_dtype and a_index are not keyword-only in the schema, so that every kernel,
# the Autograd one included, takes the arguments positionally; the Python functions
# below keep them keyword-only)


# ------------------------------------------------------------------ layouts
def _aligned(t: torch.Tensor) -> bool:
    return t.numel() == 0 or t.data_ptr() % ALIGN == 0


def kernel_rows(a: torch.Tensor) -> torch.Tensor:
    """``a`` (M, K) e4m3 as the kernels read it: row-major, 16-byte row stride and
    pointer; a copy otherwise."""
    if a.stride(-1) == 1 and (a.shape[0] <= 1 or a.stride(0) % ALIGN == 0) and _aligned(a):
        return a
    return a.contiguous() if a.shape[1] % ALIGN == 0 else _padded_rows(a)


def _padded_rows(a: torch.Tensor) -> torch.Tensor:
    m, k = a.shape
    pad = -(-k // ALIGN) * ALIGN
    return a.new_empty_strided((m, k), (pad, 1)).copy_(a)


def kernel_weights(b: torch.Tensor) -> torch.Tensor:
    """``b`` (E, K, N) e4m3 as the kernels read it: K-major (the transposed view of an
    (E, N, K) stack) with 16-byte strides; a copy of the stack otherwise."""
    e, k, n = b.shape
    if (b.stride(1) == 1 and (n <= 1 or b.stride(2) % ALIGN == 0)
            and (e <= 1 or b.stride(0) % ALIGN == 0) and _aligned(b)):
        return b
    return b.transpose(-2, -1).contiguous().transpose(-2, -1)


def torch_rows(a: torch.Tensor) -> torch.Tensor:
    """``a`` (M, K) e4m3 as ``torch._scaled_grouped_mm`` takes it: row-major with a row
    stride of at least K and a multiple of 16 bytes, whatever M (a one-row view of
    stride (1, 1) is refused there); a copy otherwise."""
    if (a.stride(-1) == 1 and a.stride(0) % ALIGN == 0 and a.stride(0) >= a.shape[1]
            and _aligned(a)):
        return a
    return _padded_rows(a)


def torch_weights(b: torch.Tensor) -> torch.Tensor:
    """``b`` (E, K, N) e4m3 as ``torch._scaled_grouped_mm`` takes it: column-major
    matrices, the column stride at least K and a multiple of 16 bytes; a copy otherwise."""
    e, k, n = b.shape
    if (b.stride(1) == 1 and b.stride(2) % ALIGN == 0 and b.stride(2) >= k
            and b.stride(0) % ALIGN == 0 and _aligned(b)):
        return b
    pad = -(-k // ALIGN) * ALIGN
    return b.new_empty_strided((e, k, n), (n * pad, 1, pad)).copy_(b)


# --------------------------------------------------------------------- paths
def _kernel_gemm(a, b, scale_a, scale_b, offs, pair, out_dtype, a_index, out):
    return gemm_kernels().scaled_grouped_gemm(
        kernel_rows(a), kernel_weights(b), scale_a, scale_b, offs, recipe=pair,
        out_dtype=out_dtype, a_index=a_index, out=out)


def _torch_scaled(a, b, scale_a, scale_b, offs, a_index):
    """Torch's rowwise FP8 grouped GEMM (bf16 out, its only output type) with this op's
    semantics: the rows gathered first, ``offs`` read as segment ends, rows past the last
    zeroed.  ``torch.nn.functional.scaled_grouped_mm`` gets the recipes named, where the
    installed torch has it (a newer torch infers them from the scales' shapes otherwise,
    and M == E or M == 1 reads as another recipe)."""
    if a_index is not None:
        scale_a = gather_scale_rows(scale_a, ROWWISE, a_index)
        a = gather_fp8_rows(a, a_index)
    ends = segment_ends(offs, a.shape[0]).to(torch.int32)
    a, b = torch_rows(a), torch_weights(b)
    scale_a, scale_b = scale_a.contiguous(), scale_b.contiguous()
    explicit = getattr(torch.nn.functional, "scaled_grouped_mm", None)
    scaling = getattr(torch.nn.functional, "ScalingType", None)
    if explicit is not None and scaling is not None:
        out = explicit(a, b, scale_a, scaling.RowWise, scale_b, scaling.RowWise, offs=ends,
                       output_dtype=torch.bfloat16)
    else:
        out = torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=ends,
                                       out_dtype=torch.bfloat16)
    past = torch.arange(a.shape[0], device=a.device) >= ends[-1]
    return out.masked_fill_(past.unsqueeze(1), 0)


def run_gemm(path: Fp8Path, pair, a, b, scale_a, recipe_a, scale_b, recipe_b, offs,
             out_dtype, a_index=None) -> torch.Tensor:
    """A validated ``scaled_grouped_gemm`` on ``path``, the degenerate sizes included."""
    m = (a if a_index is None else a_index).shape[0]
    num_experts, k, n = b.shape
    if path is Fp8Path.TORCH_SCALED and 0 not in (m, n, k, num_experts):
        # torch allocates the output itself, in the same layout (N % 16 == 0 on this path)
        return _torch_scaled(a, b, scale_a, scale_b, offs, a_index)
    out = empty_output(a, m, n, out_dtype)
    if 0 in (m, n, k, num_experts):
        return out.zero_()
    if path is Fp8Path.KERNEL_SM90:
        return _kernel_gemm(a, b, scale_a, scale_b, offs, pair, out_dtype, a_index, out)
    if path is Fp8Path.DEQUANTIZE:
        return dequantize_path.gemm(a, scale_a, recipe_a, b.transpose(-2, -1), scale_b,
                                    recipe_b, offs, out, a_index)
    return out.copy_(scaled_grouped_gemm_reference(a, b, scale_a, recipe_a, scale_b, recipe_b,
                                                   offs, out_dtype, a_index))


def run_swiglu(path: Fp8Path, pair, a, gate_up, scale_a, recipe_a, scale_b, recipe_b, offs,
               out_dtype, a_index=None) -> torch.Tensor:
    """A validated ``scaled_grouped_gemm_swiglu`` on ``path``: the fused kernel where it
    takes I, else the GEMM to fp32 (on the same path) and the activation apart."""
    m = (a if a_index is None else a_index).shape[0]
    num_experts, two_i, k = gate_up.shape
    out = empty_output(a, m, two_i // 2, out_dtype)
    if 0 in (m, two_i, k, num_experts):
        return out.zero_()
    b = gate_up.transpose(-2, -1)
    if path is Fp8Path.KERNEL_SM90 and gemm_kernels().swiglu_supported(two_i, pair):
        return gemm_kernels().scaled_grouped_gemm_swiglu(
            kernel_rows(a), kernel_weights(b), scale_a, scale_b, offs, recipe=pair,
            out_dtype=out_dtype, a_index=a_index, out=out)
    if path is Fp8Path.DEQUANTIZE:
        return dequantize_path.gemm_swiglu(a, scale_a, recipe_a, gate_up, scale_b, recipe_b,
                                           offs, out, a_index)
    if path is Fp8Path.REFERENCE:
        return out.copy_(scaled_grouped_gemm_swiglu_reference(
            a, gate_up, scale_a, recipe_a, scale_b, recipe_b, offs, out_dtype, a_index))
    # the kernel path where the fused kernel does not take I: the GEMM to fp32; torch's
    # FP8 GEMM has bf16 output only, so that path rounds twice (the docstring says so)
    wide = torch.float32 if path is not Fp8Path.TORCH_SCALED else torch.bfloat16
    h = run_gemm(path, pair, a, b, scale_a, recipe_a, scale_b, recipe_b, offs, wide, a_index)
    return out.copy_(swiglu(h.float(), out_dtype))


# --------------------------------------------------------------- the ops
def _gemm_impl(a, b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs,
               out_dtype=None, a_index=None):
    pair, recipe_a, recipe_b = check_scaled_args(a, b, scale_a, scale_recipe_a, scale_b,
                                                 scale_recipe_b, offs, out_dtype, a_index=a_index)
    out_dtype = out_dtype or torch.bfloat16
    path = scaled_path(a, pair, a.shape[1], b.shape[2], out_dtype, b.shape[0])
    return run_gemm(path, pair, a, b, scale_a, recipe_a, scale_b, recipe_b, offs, out_dtype,
                    a_index)


def _swiglu_impl(a, gate_up, scale_a, scale_recipe_a, scale_b, scale_recipe_b, offs,
                 out_dtype=None, a_index=None):
    pair, recipe_a, recipe_b = check_scaled_args(a, gate_up, scale_a, scale_recipe_a, scale_b,
                                                 scale_recipe_b, offs, out_dtype,
                                                 a_index=a_index, swiglu=True)
    out_dtype = out_dtype or torch.bfloat16
    path = scaled_path(a, pair, a.shape[1], gate_up.shape[1], out_dtype, gate_up.shape[0])
    return run_swiglu(path, pair, a, gate_up, scale_a, recipe_a, scale_b, recipe_b, offs,
                      out_dtype, a_index)


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
    recipe_a = recipe_arg(scale_recipe_a, "scale_recipe_a")
    recipe_b = recipe_arg(scale_recipe_b, "scale_recipe_b")
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
    Conventions, recipes, layouts and paths: :mod:`ts_moe.fp8.scaled_ops`."""
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
    ``out_dtype``: fp32 GEMM and activation, one rounding - except on sm_90's default
    rowwise path, ``torch._scaled_grouped_mm``, whose output is bf16 only: there the
    GEMM's output is rounded to bf16, then the activation (two roundings).  Otherwise as
    :func:`scaled_grouped_gemm`."""
    return _call(_swiglu_op, a, gate_up, scale_a, scale_recipe_a, scale_b, scale_recipe_b,
                 offs, out_dtype, a_index, "gate_up")
