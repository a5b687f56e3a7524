"""The Blackwell (sm_100a) grouped GEMM family (``grouped_gemm_sm100``; its barrier
protocol in ``sm100_protocol.md``), declared here once.  Compiled and model-checked only:
no Blackwell GPU has run it.  Importing this package imports no DSL."""

from ..common.family import Family, Op, Proof


def _gemm():
    from . import grouped_gemm_sm100_launch
    return grouped_gemm_sm100_launch.KERNELS


GEMM_SM100 = Family(
    "gemm_sm100", "bf16/fp16 grouped GEMM and fused SwiGLU GEMM, Blackwell", "sm_100a",
    Proof.COMPILED,
    "no Blackwell GPU here: every configuration compiles, its PTX is checked, ptxas "
    "assembles it without spills, its barrier protocol is model-checked "
    "(csrc_free_kernels/sm100/sm100_protocol.md)", _gemm,
    serves=(Op.GROUPED_GEMM, Op.GROUPED_GEMM_SWIGLU), setting="sm100_kernel")
