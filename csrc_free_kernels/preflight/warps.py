"""Which warps of a CTA may run each basic block of a kernel's PTX: the pre-flight counts
the warps that issue a TMA load site (the bytes a stage receives) and the warpgroups a
``setmaxnreg`` reaches (:mod:`.preflight`).

Every warp enters at the first block.  A conditional branch whose predicate is computed
from ``%tid.x`` and constants alone and is the same across each warp (a role test on
the warp index: :class:`~.uniform.ThreadValues`) sends each warp down the
side its threads take; any other branch may send every warp either way.
"""

from .ptx import Kernel
from .uniform import ThreadValues


def warp_sets(kernel: Kernel) -> dict:
    """``{block: frozenset(warp indices)}``, the entry block reached by every warp."""
    n_warps = max(kernel.threads // 32, 1)
    warps = frozenset(range(n_warps))
    exact = ThreadValues(kernel).values

    def truth(guard: str):
        values = exact.get(guard.lstrip("!"))
        if values is None or any(len(set(values[32 * w:32 * w + 32])) != 1
                                 for w in range(n_warps)):
            return None
        found = frozenset(w for w in warps if values[32 * w])
        return warps - found if guard.startswith("!") else found

    reach = {b: frozenset() for b in kernel.succ}
    reach[0] = warps
    changed = True
    while changed:
        changed = False
        for b in range(len(kernel.blocks)):
            if not reach[b]:
                continue
            br = kernel.branch(b)
            taken = truth(br.guard) if br is not None else None
            for s in kernel.succ[b]:
                flow = reach[b]
                if taken is not None and len(kernel.succ[b]) == 2:
                    flow = flow & (taken if _target(kernel, br) == s else warps - taken)
                if not flow <= reach[s]:
                    reach[s] = reach[s] | flow
                    changed = True
    return reach


def _target(kernel: Kernel, branch) -> int:
    label = branch.args[0] if branch.args else None
    if branch.op.startswith("bra") and label in kernel.labels:
        return kernel.instrs[kernel.labels[label]].block
    return kernel.exit
