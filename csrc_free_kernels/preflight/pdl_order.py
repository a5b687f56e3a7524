"""``pdl-order`` (:mod:`.preflight`): a kernel built for programmatic dependent launch
waits for the grid ahead before it touches global memory (sm_90a; the project's rule,
``csrc_free_kernels/common/pdl.py``).

PTX ISA, griddepcontrol: a grid launched with programmatic dependence may start while
the prerequisite grid still runs; ``griddepcontrol.wait`` returns once the
prerequisite grids have completed and their memory operations are visible.  Before it,
a read may see data the grid ahead has not written yet, and a write may land in a
buffer the grid ahead still reads (or that a freed tensor's memory became).  And
``griddepcontrol.launch_dependents`` lets the next grid start: ts_moe's kernels give
that only after their own wait, so that every kernel before a waiting one has
completed (the chain ``prefetch_weights`` stands on).

So, in a build with ``griddepcontrol`` instructions, on every path of every thread (the lanes'
edges, :mod:`.lanes`; a must-analysis: a block is waited only if every path into it
waited):

- every global write (``st``/``atom``/``red`` to global or generic addresses, bulk and
  TMA stores and reductions to global) and every ``launch_dependents`` comes after a
  wait;
- every global read too, except in a build whose trace declared reads before the wait
  (``pdl.reads_before_wait``: ``prefetch_weights``, weights and ``offs`` the kernel
  ahead does not write), where L2 loads (``ld.global.cg``) and TMA loads may come first.
"""

import re

_SPACES = (".global", ".shared", ".local", ".param", ".const")
_THREAD_ACCESS = re.compile(r"^(ld|st|atom|red)\.")
_BULK_WRITE = re.compile(r"^cp(\.reduce)?\.async\.bulk(\.tensor\.\dd)?\.global\.")
_ASYNC_READ = re.compile(r"^cp\.async\.(ca|cg)\.shared|^cp\.async\.bulk(\.tensor\.\dd)?\."
                         r"shared::\w+\.global")
_EARLY_READ = re.compile(r"^ld\.global\.cg\.|^cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global")


def _access(ins):
    """``"read"``/``"write"`` for an instruction that touches global memory, else None."""
    op = ins.op
    if _BULK_WRITE.match(op):
        return "write"
    if _ASYNC_READ.match(op):
        return "read"
    if not _THREAD_ACCESS.match(op):
        return None
    space = next((s for s in _SPACES if s in op), ".global")  # no space: generic
    if space != ".global":
        return None
    return "read" if op.startswith("ld.") else "write"


def check_pdl_order(pf) -> None:
    k = pf.k
    if not any(ins.op.startswith("griddepcontrol.") for ins in k.instrs):
        return  # not built for PDL
    early_ok = bool(getattr(pf.facts, "pdl_early_reads", None))
    flagged = {}  # instruction index -> why it may not run before the wait
    for edges, lanes in pf.lanes.classes():
        lanes = frozenset(lanes)
        for b, state in _waited(pf, edges, lanes).items():
            for i in k.blocks[b]:
                ins = k.instrs[i]
                if not lanes & pf.lanes.at(ins):
                    continue
                why = None if state or i in flagged else _unwaited(ins, early_ok)
                if why:
                    flagged[i] = why
                state = state or _waits(ins)
    for i, why in sorted(flagged.items()):
        pf.fail("pdl-order", k.instrs[i], f"{why} before griddepcontrol.wait on some path: "
                                          f"under PDL the grid ahead may still run")


def _waits(ins) -> bool:
    return ins.op.startswith("griddepcontrol.wait") and not ins.guard


def _unwaited(ins, early_ok: bool):
    """Why ``ins`` may not run before the wait (None: it may)."""
    if ins.op.startswith("griddepcontrol.launch_dependents"):
        return "lets the dependent grid launch"
    kind = _access(ins)
    if kind == "write":
        return "writes global memory"
    if kind == "read" and not (early_ok and _EARLY_READ.match(ins.op)):
        return "reads global memory"
    return None


def _waited(pf, edges, lanes) -> dict:
    """``{block: whether every path of these lanes into it passed a wait}`` (the blocks
    they reach)."""
    k = pf.k
    into = {0: False}
    changed = True
    while changed:
        changed = False
        for b in sorted(into):
            state = into[b] or any(_waits(k.instrs[i]) and lanes & pf.lanes.at(k.instrs[i])
                                   for i in k.blocks[b])
            for s in k.succ[b]:
                if (b, s) not in edges or s == k.exit:
                    continue
                new = state if s not in into else into[s] and state
                if into.get(s) != new:
                    into[s], changed = new, True
    return into
