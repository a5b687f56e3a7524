"""The kernel families (``csrc_free_kernels.families``), each loaded once under its own
guard: the only place the ops import ``csrc_free_kernels``' launch code (through the
records' ``load``); the path table (:mod:`ts_moe.ops.paths`) reads what loaded.
Importing this module imports the DSL.

A family whose load fails (any exception: a missing DSL, an API the installed DSL
lacks, a bug) is missing from :data:`LOADED` and :data:`AVAILABLE`, its reason is in
:data:`FAILED`, with one :class:`KernelImportWarning` naming it; every other family
stays on, and the paths take the next backend where a family is missing.  Without
``nvidia-cutlass-dsl`` (``cutlass``) every family is off, said in one warning.
"""

import warnings

from csrc_free_kernels.common.family import Family, Kernels, Op, Proof  # noqa: F401
# the scaled number formats, as data (ts_moe.fp8.recipes reads them)
from csrc_free_kernels.common.formats import FORMATS, ScaleFormat  # noqa: F401
# what a backend answers for a call it does not take: the kernels own it (data flows
# down), and it needs no DSL
from csrc_free_kernels.common.kernel_config import Declined  # noqa: F401
# a kernel build the pre-flight refused, and the refusals of this process (no DSL either)
from csrc_free_kernels.common.refusals import PreflightError, refused  # noqa: F401
from csrc_free_kernels.families import FAMILIES


class KernelImportWarning(RuntimeWarning):
    """A kernel family could not be imported: it is off, the others are not."""


LOADED: dict[str, Kernels] = {}
"""``{family name: what its launch module serves}`` of each family that loaded."""
FAILED: dict[str, str] = {}
"""``{family name: "ExceptionType: message"}`` of each family that failed to load."""

try:
    import cutlass  # noqa: F401  (every family's kernels are written in it)
    _NO_DSL = None
except ImportError as exc:
    _NO_DSL = f"{type(exc).__name__}: {exc}"
    warnings.warn(f"ts_moe: nvidia-cutlass-dsl cannot be imported ({_NO_DSL}): every kernel "
                  f"family is off; the ops take torch's kernels and the plain-torch "
                  f"references", KernelImportWarning, stacklevel=1)


def _load(family: Family) -> None:
    """Load ``family``, or record it as off and warn once, naming it (unless the DSL is
    missing)."""
    try:
        LOADED[family.name] = family.load()
    except Exception as exc:
        FAILED[family.name] = _NO_DSL or f"{type(exc).__name__}: {exc}"
        if _NO_DSL is None:
            warnings.warn(f"ts_moe: the {family.name} kernels ({family.title}) are off: "
                          f"loading {family.load.__module__} raised {FAILED[family.name]}; "
                          f"every other kernel family is unaffected", KernelImportWarning,
                          stacklevel=2)


for _family in FAMILIES:
    _load(_family)

AVAILABLE = frozenset(f.name for f in FAMILIES if f.in_ops and f.name in LOADED)
"""The names of the families the ops take that loaded (all of them, where nothing failed)."""

