"""ts_moe: Mixture-of-Experts ops for PyTorch with CuTeDSL kernels.

``import ts_moe`` registers ``torch.ops.ts_moe.*``.  The names here are the
ops (the kernels where the path has them, :mod:`ts_moe.ops`) and the layer
(:mod:`ts_moe.moe`); the plain-torch versions of the ops, which the tests and
the CPU run, are :mod:`ts_moe.reference` (``ts_moe.reference.route``,
``.sort_slots``, ``.permute``, ``.combine``, ``.grouped_gemm_reference``, ...).
Every switch and environment variable is an attribute of ``ts_moe.settings``
(:mod:`ts_moe.settings`).
"""

import sys
from importlib.metadata import PackageNotFoundError, version as _version
from pathlib import Path as _Path

try:
    __version__ = _version("ts-moe")
except PackageNotFoundError:  # a checkout on sys.path, not installed
    __version__ = "0+unknown"

from . import reference
from .settings import settings


def _started_as_command() -> bool:
    """Whether this process is ``python -m ts_moe`` or the ``ts-moe`` script, not a
    program that imports ts_moe."""
    argv = getattr(sys, "orig_argv", [])
    return _Path(sys.argv[0]).name == "ts-moe" or ["-m", "ts_moe"] in (
        argv[i:i + 2] for i in range(len(argv) - 1))


try:
    settings.check_environment()  # a bad TS_MOE_* variable fails here, on every device
except ValueError as _bad:
    if not _started_as_command():
        raise
    # a command's usage error, as its own arguments' (exit 2), not a traceback
    print(f"ts_moe: {_bad}", file=sys.stderr)
    raise SystemExit(2) from None
from .ops import (combine, fp8_kernels_enabled, grouped_gemm, grouped_gemm_swiglu, permute,
                  quantize_fp8, route, route_slots, scaled_grouped_gemm,
                  scaled_grouped_gemm_swiglu, sort_slots, use_fp8_kernels, use_router_kernel,
                  use_sm100_kernel)
from .reference import grouped_gemm_reference, grouped_gemm_swiglu_reference, segment_ends
from .moe import MoE, experts_forward, moe_forward
from .loaders import load_fp8_experts, load_mixtral_experts
from .tiny import make_tiny_fp8_checkpoint, make_tiny_mixtral, make_tiny_moe_checkpoint

__all__ = [
    "settings",
    "grouped_gemm",
    "grouped_gemm_swiglu",
    "use_sm100_kernel",
    "use_router_kernel",
    "use_fp8_kernels",
    "route",
    "route_slots",
    "sort_slots",
    "permute",
    "combine",
    "reference",
    "grouped_gemm_reference",
    "grouped_gemm_swiglu_reference",
    "segment_ends",
    "MoE",
    "moe_forward",
    "experts_forward",
    "load_mixtral_experts",
    "load_fp8_experts",
    "make_tiny_mixtral",
    "make_tiny_moe_checkpoint",
    "make_tiny_fp8_checkpoint",
    "scaled_grouped_gemm",
    "scaled_grouped_gemm_swiglu",
    "quantize_fp8",
    "fp8_kernels_enabled",
]
