"""ts_moe: Mixture-of-Experts ops for PyTorch with CuTeDSL kernels.

``import ts_moe`` registers ``torch.ops.ts_moe.*``.
"""

from .ops import grouped_gemm, grouped_gemm_swiglu, use_router_kernel, use_sm100_kernel
from .reference import grouped_gemm_reference, grouped_gemm_swiglu_reference, segment_ends
from .routing import combine, permute, route, sort_slots
from .moe import MoE, experts_forward, moe_forward
from .loaders import load_mixtral_experts
from .tiny import make_tiny_mixtral, make_tiny_moe_checkpoint
from .fp8 import quantize_fp8, scaled_grouped_gemm

__all__ = [
    "grouped_gemm",
    "grouped_gemm_swiglu",
    "use_sm100_kernel",
    "use_router_kernel",
    "grouped_gemm_reference",
    "grouped_gemm_swiglu_reference",
    "segment_ends",
    "route",
    "permute",
    "sort_slots",
    "combine",
    "MoE",
    "moe_forward",
    "experts_forward",
    "load_mixtral_experts",
    "make_tiny_mixtral",
    "make_tiny_moe_checkpoint",
    "scaled_grouped_gemm", "quantize_fp8",
]
