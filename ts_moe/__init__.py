"""ts_moe: Mixture-of-Experts ops for PyTorch with CuTeDSL kernels.

``import ts_moe`` registers ``torch.ops.ts_moe.*``.
"""

from .ops import grouped_gemm, grouped_gemm_swiglu
from .reference import grouped_gemm_reference, grouped_gemm_swiglu_reference, segment_ends

__all__ = [
    "grouped_gemm",
    "grouped_gemm_swiglu",
    "grouped_gemm_reference",
    "grouped_gemm_swiglu_reference",
    "segment_ends",
]
