"""ts_moe: Mixture-of-Experts ops for PyTorch with CuTeDSL kernels.

``import ts_moe`` registers ``torch.ops.ts_moe.*``.
"""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("ts-moe")
except PackageNotFoundError:  # a checkout on sys.path, not installed
    __version__ = "0+unknown"

from .ops import grouped_gemm, grouped_gemm_swiglu, use_router_kernel, use_sm100_kernel
from .reference import grouped_gemm_reference, grouped_gemm_swiglu_reference, segment_ends
from .routing import combine, permute, route, sort_slots
from .moe import MoE, experts_forward, moe_forward
from .loaders import load_mixtral_experts
from .tiny import make_tiny_mixtral, make_tiny_moe_checkpoint

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
]
