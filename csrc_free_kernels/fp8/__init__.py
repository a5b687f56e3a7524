"""The FP8 (e4m3) families, Hopper, each declared here once: the grouped GEMM and its
fused SwiGLU form (``grouped_gemm_fp8_sm90``, the bf16 kernel's subclass with an FP8
mainloop) and the activation quantizer (``quantize_fp8_sm90``).  Importing this package
imports no DSL."""

from ..common.family import Family, Op, Proof
from ..hopper import H100_RUN


def _gemm():
    from . import grouped_gemm_fp8_sm90_launch
    return grouped_gemm_fp8_sm90_launch.KERNELS


def _quantize():
    from . import quantize_fp8_sm90_launch
    return quantize_fp8_sm90_launch.KERNELS


GEMM_FP8_SM90 = Family(
    "gemm_fp8_sm90", "FP8 (e4m3) grouped GEMM and fused SwiGLU GEMM", "sm_90a", Proof.VERIFIED,
    "against float64 products of the quantized operands on the GPU, every configuration "
    "and recipe, aligned and unaligned expert starts (the scale-box fault fixed: "
    "bench/notes/2026-12-06-h100-run.md)", _gemm,
    serves=(Op.SCALED_GROUPED_GEMM, Op.SCALED_GROUPED_GEMM_SWIGLU), run=H100_RUN,
    setting="fp8_kernels")
QUANTIZE_FP8_SM90 = Family(
    "quantize_fp8_sm90", "FP8 activation quantizer", "sm_90a", Proof.VERIFIED,
    "bit-equal to the reference quantizer on the GPU, values and scales "
    "(bench/notes/2026-12-06-fp8-first-gpu-pass.md)", _quantize,
    serves=(Op.QUANTIZE_FP8,), run=H100_RUN, setting="fp8_kernels")
