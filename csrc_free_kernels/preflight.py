"""The pre-flight: the Hopper (and Blackwell) hardware rules a kernel build can break,
checked on its PTX and trace-time facts without a GPU, so that no build meets a GPU
untried.

A broken rule rarely gives a clear error on the device: most give
``cudaErrorIllegalInstruction`` or a hang, sticky for the whole process
(``bench/notes/2026-12-05-fp8-kernel-first-gpu-run.md``).  :func:`check` is the one entry:
the PTX text of one build and its :class:`~.preflight_trace.BuildFacts` in, every
:class:`Violation` out, each naming the build, the rule (:data:`RULES`) and the PTX line.
The rules, by family, and their sources (PTX ISA, CUDA driver API, CUDA programming
guide): ``bench/notes/2026-12-06-preflight-rules.md``; what the pre-flight cannot see
(values known only at run time, races) is listed there too.
"""

from . import (preflight_budget, preflight_bulk, preflight_collective, preflight_mbarrier,
               preflight_tcgen05, preflight_tma, preflight_wgmma)
from .preflight_context import Preflight, Violation
from .preflight_trace import BuildFacts

RULES = ("missing-fact", "tma-coordinate", "tensor-map", "tma-smem", "expect-tx",
         "mbarrier-align", "mbarrier-init", "mbarrier-fence", "budget", "setmaxnreg",
         "warpgroup-uniform", "warp-uniform", "named-barrier", "bulk-copy", "cluster",
         "proxy-fence", "wgmma-descriptor", "tcgen05")

# the rules that stand on the PTX and the facts alone, then those that count threads
# (which a build without .reqntid, already reported as missing-fact, cannot feed)
_FIRST = (preflight_budget.check_facts, preflight_tma.check_maps, preflight_tma.check_tma,
          preflight_mbarrier.check_align, preflight_budget.check_budget,
          preflight_bulk.check_bulk)
_COUNTING = (preflight_bulk.check_bounds, preflight_mbarrier.check_init,
             preflight_mbarrier.check_expect_tx, preflight_mbarrier.check_fence,
             preflight_budget.check_setmaxnreg, preflight_collective.check_warpgroup,
             preflight_collective.check_warp, preflight_collective.check_named,
             preflight_bulk.check_cluster, preflight_bulk.check_proxy_fence,
             preflight_wgmma.check_descriptors, preflight_tcgen05.check_tcgen05)


def check(build: str, ptx: str, facts: BuildFacts) -> list:
    """Every :class:`Violation` of the rules by one build: ``ptx`` its PTX text (one
    ``.entry``), ``facts`` what its trace and cubin recorded; ``build`` names it in the
    violations.  Empty: the build may meet a GPU."""
    pf = Preflight(build, ptx, facts)
    for rule in _FIRST + (_COUNTING if pf.k.declares_threads else ()):
        try:
            rule(pf)
        except Exception as exc:  # a rule that cannot read the build is no pass
            pf.fail("missing-fact", pf.k.name, f"{rule.__module__}.{rule.__name__} could "
                                               f"not read this build: {exc!r}")
    return pf.found


__all__ = ["RULES", "Violation", "check"]
