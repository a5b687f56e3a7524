"""The pre-flight: the Hopper (and Blackwell) hardware rules a kernel build can break,
checked on its PTX and trace-time facts without a GPU, so that no build meets a GPU
untried.

A broken rule rarely gives a clear error on the device: most give
``cudaErrorIllegalInstruction`` or a hang, sticky for the whole process
(``bench/notes/2026-12-05-fp8-kernel-first-gpu-run.md``).  :func:`check` is the one entry:
the PTX text of one build and its :class:`~.trace.BuildFacts` in, every
:class:`Violation` out, each naming the build, the rule (:data:`RULES`) and the PTX line.
The rules, by family, and their sources (PTX ISA, CUDA driver API, CUDA programming
guide): ``bench/notes/2026-12-06-preflight-rules.md`` and, for the ordering rules (fences,
waits, groups, phases, PDL, tcgen05), ``bench/notes/2026-12-07-preflight-third.md``; what
the pre-flight cannot see (values known only at run time, races) is listed there too.
"""

from . import (access, budget, bulk, bulk_reuse, collective, mbarrier, mbarrier_pass,
               pdl_order, phase, tcgen05, tma, tmem_lanes, tmem_order, wgmma, wgmma_order,
               wgmma_release)
from .context import Preflight, Violation
from .trace import BuildFacts

RULES = ("missing-fact", "tma-coordinate", "tensor-map", "tma-smem", "expect-tx",
         "mbarrier-align", "mbarrier-init", "mbarrier-reinit", "arrive-twice", "stage-range",
         "mbarrier-phase", "mbarrier-fence", "budget", "setmaxnreg", "warpgroup-uniform",
         "warp-uniform", "named-barrier", "raced-uniform", "bulk-copy", "access-align", "smem-bounds",
         "cluster", "proxy-fence", "wgmma-descriptor", "wgmma-order", "tcgen05",
         "tcgen05-order", "tcgen05-lanes", "pdl-order", "bulk-store-reuse",
         "wgmma-smem-release")

# the rules that stand on the PTX and the facts alone, then those that count threads
# (which a build without .reqntid, already reported as missing-fact, cannot feed)
_FIRST = (budget.check_facts, tma.check_maps, tma.check_tma, mbarrier.check_align,
          budget.check_budget, bulk.check_bulk, access.check_access,
          wgmma_order.check_wgmma_order,
          mbarrier_pass.check_reinit)
_COUNTING = (bulk.check_bounds, mbarrier.check_init, mbarrier_pass.check_arrive_twice,
             phase.check_phase,
             mbarrier.check_expect_tx, mbarrier.check_fence,
             budget.check_setmaxnreg, collective.check_warpgroup,
             collective.check_warp, collective.check_named,
             bulk.check_cluster, bulk.check_proxy_fence,
             wgmma.check_descriptors, tcgen05.check_tcgen05, tmem_order.check_order,
             tmem_lanes.check_lanes, pdl_order.check_pdl_order,
             bulk_reuse.check_bulk_reuse, wgmma_release.check_wgmma_release)


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
