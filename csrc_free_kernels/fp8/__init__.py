"""The FP8 (e4m3) families, Hopper, each declared here once: the grouped GEMM and its
fused SwiGLU form (``grouped_gemm_fp8_sm90``, the bf16 kernel's subclass with an FP8
mainloop) and the activation quantizer (``quantize_fp8_sm90``); both opt-in.  Importing
this package imports no DSL."""

from ..common.family import Family, Op, Proof, Run

H100_RUN = Run("1a4410d", "NVIDIA H100 80GB HBM3", "2026-12-06",
               "every configuration x recipe ran without a fault and matched float64; "
               "190 of 214 FP8 GPU tests passed")


def _gemm():
    from . import grouped_gemm_fp8_sm90_launch
    return grouped_gemm_fp8_sm90_launch.KERNELS


def _quantize():
    from . import quantize_fp8_sm90_launch
    return quantize_fp8_sm90_launch.KERNELS


GEMM_FP8_SM90 = Family(
    "gemm_fp8_sm90", "FP8 (e4m3) grouped GEMM and fused SwiGLU GEMM", "sm_90a", Proof.COMPILED,
    "the scale-box fault is fixed on hardware: the old layout faults on unaligned expert "
    "starts only, the fixed one passes every configuration and recipe; a float32-output "
    "test failed (bench/notes/2026-12-06-h100-run.md)", _gemm,
    serves=(Op.SCALED_GROUPED_GEMM, Op.SCALED_GROUPED_GEMM_SWIGLU), run=H100_RUN,
    setting="fp8_kernels")
QUANTIZE_FP8_SM90 = Family(
    "quantize_fp8_sm90", "FP8 activation quantizer", "sm_90a", Proof.COMPILED,
    "on an H100 its values were bit-equal to the reference on one shape and differed from "
    "the tests' torch division on others (bench/notes/2026-12-06-h100-run.md)", _quantize,
    serves=(Op.QUANTIZE_FP8,), run=H100_RUN, setting="fp8_kernels")
