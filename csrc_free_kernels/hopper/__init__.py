"""The Hopper (sm_90a) GEMM families, each declared here once: the row-grouped GEMM and
its fused SwiGLU form (``grouped_gemm_sm90``, with its MMA warpgroups ``sm90_mma`` and
epilogue pieces ``sm90_epilogue``), the k-grouped GEMM of the weight gradient
(``grouped_gemm_dw_sm90``) and the elementwise SwiGLU activation (``swiglu_sm90``).
Importing this package imports no DSL: each record's ``load`` imports its launch module."""

from ..common.family import Family, Op, Proof, Run

H100_RUN = Run("3defe77", "NVIDIA H100 80GB HBM3", "2026-12-07",
               "the whole gpu suite, 668 tests passed, 0 failed in 20 files "
               "(scripts/gpu_check.py, two invocations)")
"""The run the sm_90a families' statuses rest on (bench/notes/2026-12-07-h100-gpu-check-3defe77.md;
the ones before: 2026-12-07-h100-gpu-check.md, 2026-12-06-h100-run.md)."""


def _gemm():
    from . import grouped_gemm_sm90_launch
    return grouped_gemm_sm90_launch.KERNELS


def _dw():
    from . import grouped_gemm_dw_sm90_launch
    return grouped_gemm_dw_sm90_launch.KERNELS


def _swiglu():
    from . import swiglu_sm90_launch
    return swiglu_sm90_launch.KERNELS


GEMM_SM90 = Family(
    "gemm_sm90", "bf16/fp16 grouped GEMM and fused SwiGLU GEMM", "sm_90a", Proof.VERIFIED,
    "against the fp32 references on the GPU", _gemm,
    serves=(Op.GROUPED_GEMM, Op.GROUPED_GEMM_SWIGLU), run=H100_RUN)
GEMM_DW_SM90 = Family(
    "gemm_dw_sm90", "k-grouped GEMM (the weight gradient)", "sm_90a", Proof.VERIFIED,
    "against the fp32 references on the GPU", _dw, serves=(Op.GROUPED_GEMM_K,), run=H100_RUN)
SWIGLU_SM90 = Family(
    "swiglu_sm90", "SwiGLU activation and its gradient, elementwise", "sm_90a", Proof.VERIFIED,
    "against the fp32 references on the GPU", _swiglu, serves=(Op.SWIGLU_ACTIVATION,),
    run=H100_RUN)
