"""The FP8 families' backends besides ts_moe's kernels (the families of
:mod:`ts_moe.ops.backend`: ``ScaledGroupedGemm``, ``ScaledGroupedGemmSwiglu``,
``QuantizeFp8``); :mod:`ts_moe.ops.paths` orders them per device.

- torch's FP8 grouped GEMM (:data:`TORCH_SCALED_GEMM`): ``torch._scaled_grouped_mm``,
  or ``torch.nn.functional.scaled_grouped_mm`` with the recipes named where this torch
  has it (a newer torch infers them from the scales' shapes otherwise, and M == E or
  M == 1 reads as another recipe).  It runs rowwise with bf16 output, K and N
  multiples of 16 and fewer than 1024 experts on sm_90 (its sm_100 grouped path is MX
  formats only; torch 2.13's ``_meta_registrations.py`` and
  ``aten/src/ATen/native/cuda/GroupedBlas.cpp``), and declines the rest, saying which.
  Its SwiGLU form rounds the GEMM's output to bf16 before the activation (two
  roundings: torch has no other output type);
- the dequantize fallback (:data:`DEQUANTIZE_GEMM`, :mod:`ts_moe.fp8.dequantize_path`):
  the weights of the experts the rows use, dequantized to bf16 in chunks, then
  ``ts_moe.grouped_gemm``; it takes every call;
- the plain-torch reference (:data:`REFERENCE_GEMM`, :mod:`ts_moe.fp8.reference`): the
  CPU's; it reads ``offs`` on the host and takes every call, as does the reference
  quantizer, every device's quantizer where the quantize kernel declines.
"""

import math

import torch

from ..ops.kernels import Declined
from ..reference import segment_ends, swiglu
from . import dequantize_path
from .recipes import E4M3, Pair, Recipe
from .reference import (gather_fp8_rows, gather_scale_rows, quantize_reference,
                        scaled_grouped_gemm_reference, scaled_grouped_gemm_swiglu_reference)

ALIGN = 16  # bytes: the row strides and pointers torch's FP8 GEMM takes
TORCH_CONFIG = "torch._scaled_grouped_mm"
TORCH_SCALED_MAX_EXPERTS = 1023  # torch._scaled_grouped_mm: group_count < 1024


# ------------------------------------------------------------ torch's FP8 GEMM
def torch_rows(a: torch.Tensor) -> torch.Tensor:
    """``a`` (M, K) e4m3 as ``torch._scaled_grouped_mm`` takes it: row-major with a row
    stride of at least K and a multiple of 16 bytes, whatever M (a one-row view of
    stride (1, 1) is refused there); a copy otherwise."""
    if (a.stride(-1) == 1 and a.stride(0) % ALIGN == 0 and a.stride(0) >= a.shape[1]
            and a.data_ptr() % ALIGN == 0):
        return a
    m, k = a.shape
    return a.new_empty_strided((m, k), (-(-k // ALIGN) * ALIGN, 1)).copy_(a)


def torch_weights(b: torch.Tensor) -> torch.Tensor:
    """``b`` (E, K, N) e4m3 as ``torch._scaled_grouped_mm`` takes it: column-major
    matrices, the column stride at least K and a multiple of 16 bytes; a copy otherwise."""
    e, k, n = b.shape
    if (b.stride(1) == 1 and b.stride(2) % ALIGN == 0 and b.stride(2) >= k
            and b.stride(0) % ALIGN == 0 and b.data_ptr() % ALIGN == 0):
        return b
    pad = -(-k // ALIGN) * ALIGN
    return b.new_empty_strided((e, k, n), (n * pad, 1, pad)).copy_(b)


def torch_scaled(a, b, scale_a, scale_b, offs, a_index):
    """Torch's rowwise FP8 grouped GEMM (bf16 out) with the op's semantics: the rows
    gathered first, ``offs`` read as segment ends, rows past the last zeroed."""
    if a_index is not None:
        scale_a = gather_scale_rows(scale_a, Recipe.ROWWISE, a_index)
        a = gather_fp8_rows(a, a_index)
    ends = segment_ends(offs, a.shape[0]).to(torch.int32)
    a, b = torch_rows(a), torch_weights(b)
    scale_a, scale_b = scale_a.contiguous(), scale_b.contiguous()
    named = getattr(torch.nn.functional, "scaled_grouped_mm", None)
    if named is not None and Recipe.ROWWISE.scaling_type is not None:
        rowwise = Recipe.ROWWISE.scaling_type
        out = named(a, b, scale_a, rowwise, scale_b, rowwise, offs=ends,
                    output_dtype=torch.bfloat16)
    else:
        out = torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=ends,
                                       out_dtype=torch.bfloat16)
    past = torch.arange(a.shape[0], device=a.device) >= ends[-1]
    return out.masked_fill_(past.unsqueeze(1), 0)


def _torch_config(pair, k: int, n: int, num_experts: int, out_dtype):
    """:data:`TORCH_CONFIG` where torch's FP8 grouped GEMM takes the call, else why not."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return Declined("this torch has no torch._scaled_grouped_mm")
    if pair is not Pair.ROWWISE:
        return Declined(f"{pair}: torch's FP8 grouped GEMM serves the rowwise recipe only")
    if out_dtype != torch.bfloat16:
        return Declined(f"{out_dtype} out: torch's FP8 grouped GEMM gives bf16 only")
    if k % ALIGN or n % ALIGN:
        return Declined(f"K = {k}, N = {n}: torch's FP8 grouped GEMM needs multiples of 16")
    if num_experts > TORCH_SCALED_MAX_EXPERTS:
        return Declined(f"{num_experts} experts: torch's FP8 grouped GEMM takes at most "
                        f"{TORCH_SCALED_MAX_EXPERTS}")
    return TORCH_CONFIG


class TorchScaledGemm:
    allocates = True  # torch returns its own output: run takes out=None

    def choose_config(self, a, b, scale_a, scale_b, offs, out, a_index, pair):
        num_experts, k, n = b.shape
        return _torch_config(pair, k, n, num_experts, out.dtype)

    def run(self, a, b, scale_a, scale_b, offs, out, config, pair, *, a_index=None):
        return torch_scaled(a, b, scale_a, scale_b, offs, a_index)  # torch allocates


class TorchScaledSwiglu:
    """The GEMM to bf16 (torch's only output type), then the activation in fp32: two
    roundings."""

    def choose_config(self, a, gate_up, scale_a, scale_b, offs, out, a_index, pair):
        num_experts, two_i, k = gate_up.shape
        return _torch_config(pair, k, two_i, num_experts, out.dtype)

    def run(self, a, gate_up, scale_a, scale_b, offs, out, config, pair, *, a_index=None):
        h = torch_scaled(a, gate_up.transpose(-2, -1), scale_a, scale_b, offs, a_index)
        return out.copy_(swiglu(h.float(), out.dtype))


# ------------------------------------------------------------- the fallback
DEQUANTIZE_CONFIG = "dequantize"


class DequantizeGemm:
    allocates = False

    def choose_config(self, a, b, scale_a, scale_b, offs, out, a_index, pair):
        return DEQUANTIZE_CONFIG

    def run(self, a, b, scale_a, scale_b, offs, out, config, pair, *, a_index=None):
        return dequantize_path.gemm(a, scale_a, pair.a, b.transpose(-2, -1), scale_b, pair.b,
                                    offs, out, a_index)


class DequantizeSwiglu:
    def choose_config(self, a, gate_up, scale_a, scale_b, offs, out, a_index, pair):
        return DEQUANTIZE_CONFIG

    def run(self, a, gate_up, scale_a, scale_b, offs, out, config, pair, *, a_index=None):
        return dequantize_path.gemm_swiglu(a, scale_a, pair.a, gate_up, scale_b, pair.b, offs,
                                           out, a_index)


# ------------------------------------------------------------ the reference
REFERENCE_CONFIG = "reference"


class ReferenceGemm:
    allocates = False

    def choose_config(self, a, b, scale_a, scale_b, offs, out, a_index, pair):
        return REFERENCE_CONFIG

    def run(self, a, b, scale_a, scale_b, offs, out, config, pair, *, a_index=None):
        return out.copy_(scaled_grouped_gemm_reference(a, b, scale_a, pair.a, scale_b, pair.b,
                                                       offs, out.dtype, a_index))


class ReferenceSwiglu:
    def choose_config(self, a, gate_up, scale_a, scale_b, offs, out, a_index, pair):
        return REFERENCE_CONFIG

    def run(self, a, gate_up, scale_a, scale_b, offs, out, config, pair, *, a_index=None):
        return out.copy_(scaled_grouped_gemm_swiglu_reference(
            a, gate_up, scale_a, pair.a, scale_b, pair.b, offs, out.dtype, a_index))


class ReferenceQuantize:
    """:func:`ts_moe.fp8.reference.quantize_reference` a matrix at a time where x has
    leading dims (an (E, N, K) stack: one expert's fp32 temporaries at a time).  The
    stack is counted, not inferred (``-1``), so that empty matrices (an (E, 0, K)
    stack) get the shapes the fake kernel gives."""

    def choose_config(self, x, recipe):
        return REFERENCE_CONFIG

    def run(self, x, recipe, config):
        if x.dim() == 2:
            return quantize_reference(x, recipe)
        q = torch.empty(x.shape, dtype=E4M3, device=x.device)
        scale = torch.empty(recipe.scale_shape(x.shape), dtype=recipe.scale_dtype,
                            device=x.device)
        stack = math.prod(x.shape[:-2])
        flat_q = q.view(stack, *x.shape[-2:])
        flat_s = scale.view(stack, *scale.shape[x.dim() - 2:])
        for i, matrix in enumerate(x.reshape(stack, *x.shape[-2:])):
            flat_q[i], flat_s[i] = quantize_reference(matrix, recipe)
        return q, scale


TORCH_SCALED_GEMM = TorchScaledGemm()
TORCH_SCALED_SWIGLU = TorchScaledSwiglu()
DEQUANTIZE_GEMM = DequantizeGemm()
DEQUANTIZE_SWIGLU = DequantizeSwiglu()
REFERENCE_GEMM = ReferenceGemm()
REFERENCE_SWIGLU = ReferenceSwiglu()
REFERENCE_QUANTIZE = ReferenceQuantize()
