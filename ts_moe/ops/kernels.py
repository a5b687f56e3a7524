"""The kernel backends, imported once and statically, each family under its own
guard: the only place the ops import ``csrc_free_kernels`` (the bf16 ops'
paths, :mod:`ts_moe.ops.paths`, and the FP8 ops', :mod:`ts_moe.fp8.paths`;
only the command line reaches the package's build tools directly: ``python -m
ts_moe compile`` and ``cache``).  Importing them imports the DSL.

A family whose import fails (any exception: a missing DSL, an API the
installed DSL lacks, a bug) is None here, its name is missing from
:data:`AVAILABLE` and the reason is in :data:`FAILED`, with one
:class:`KernelImportWarning` naming it; every other family stays on, and the
paths take the next backend where a family is None.  Without
``nvidia-cutlass-dsl`` (``cutlass``) every family is off, said in one warning.
The families and their status: :mod:`.kernel_status`.
"""

import warnings

# what a backend answers for a call it does not take: the kernels own it (data flows
# down), and it needs no DSL
from csrc_free_kernels.common.kernel_config import Declined  # noqa: F401

from . import kernel_status as status


class KernelImportWarning(RuntimeWarning):
    """A kernel family could not be imported: it is off, the others are not."""


FAILED: dict = {}
"""``{family name: "ExceptionType: message"}`` of each family that failed to import."""

try:
    import cutlass  # noqa: F401  (every family's kernels are written in it)
    _NO_DSL = None
except ImportError as exc:
    _NO_DSL = f"{type(exc).__name__}: {exc}"
    warnings.warn(f"ts_moe: nvidia-cutlass-dsl cannot be imported ({_NO_DSL}): every kernel "
                  f"family is off; the ops take torch's kernels and the plain-torch "
                  f"references", KernelImportWarning, stacklevel=1)


def _off(family: status.FamilyStatus, exc: Exception) -> None:
    """Record ``family`` as off and warn once, naming it (unless the DSL is missing)."""
    FAILED[family.name] = _NO_DSL or f"{type(exc).__name__}: {exc}"
    if _NO_DSL is None:
        warnings.warn(f"ts_moe: the {family.name} kernels ({family.title}) are off: importing "
                      f"csrc_free_kernels.{family.module} raised {FAILED[family.name]}; "
                      f"every other kernel family is unaffected", KernelImportWarning,
                      stacklevel=2)


try:
    from csrc_free_kernels.hopper import grouped_gemm_sm90_launch as sm90
except Exception as exc:
    sm90 = _off(status.GEMM_SM90, exc)
try:
    from csrc_free_kernels.hopper import grouped_gemm_dw_sm90_launch as sm90_dw
except Exception as exc:
    sm90_dw = _off(status.GEMM_DW_SM90, exc)
try:
    from csrc_free_kernels.hopper import swiglu_sm90_launch as swiglu_sm90
except Exception as exc:
    swiglu_sm90 = _off(status.SWIGLU_SM90, exc)
try:
    from csrc_free_kernels.routing import route_sm90_launch as route_sm90
except Exception as exc:
    route_sm90 = _off(status.ROUTE_SM90, exc)
try:
    from csrc_free_kernels.routing import router_sm90_launch as router_sm90
except Exception as exc:
    router_sm90 = _off(status.ROUTER_SM90, exc)
try:
    from csrc_free_kernels.sm100 import grouped_gemm_sm100_launch as sm100
except Exception as exc:
    sm100 = _off(status.GEMM_SM100, exc)
try:
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_launch as sm90_fp8
except Exception as exc:
    sm90_fp8 = _off(status.GEMM_FP8_SM90, exc)
try:
    from csrc_free_kernels.fp8 import quantize_fp8_sm90_launch as quantize_fp8_sm90
except Exception as exc:
    quantize_fp8_sm90 = _off(status.QUANTIZE_FP8_SM90, exc)

AVAILABLE = frozenset(f.name for f in status.STATUS if f.in_ops and f.name not in FAILED)
"""The names of the families that imported (all of the ops' families, where nothing failed)."""
