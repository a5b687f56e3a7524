"""``tcgen05`` (:mod:`.preflight`): Blackwell's tensor-memory rules (sm_100a), from the
PTX ISA's tcgen05 chapter; no Blackwell GPU runs here, so for the 2-SM kernel this is
the only check before a user runs it.  Notes: ``bench/notes/2026-12-06-preflight-rules.md``.

- ``tcgen05.alloc``/``dealloc`` take a constant column count, a power of two in
  [32, 512]; one warp of a CTA allocates (``.sync.aligned``, whole warps: the
  ``warp-uniform`` rule); a thread's allocations are all deallocated before it exits
  (per pass, columns allocated = columns freed, summed over the CTA's warps); a later
  allocation is no larger than an earlier one; no allocation after
  ``relinquish_alloc_permit`` on a thread's path;
- every ``tcgen05`` instruction of a kernel names the same ``.cta_group``;
- ``tcgen05.mma``, ``tcgen05.cp`` and ``tcgen05.commit`` are issued by one thread
  (at most one lane of a warp runs each);
- a ``tcgen05.commit`` signals a barrier that some thread waits on.
"""

import re

from .lanes import dag_order, pass_sums
from .mbarrier import barrier_operand

_GROUP = re.compile(r"\.cta_group::(\d)")
_ONE_THREAD = ("tcgen05.mma", "tcgen05.cp", "tcgen05.commit")


def check_tcgen05(pf) -> None:
    sites = [ins for ins in pf.k.instrs if ins.op.startswith("tcgen05.")]
    if not sites:
        return
    groups = {}
    for ins in sites:
        m = _GROUP.search(ins.op)
        if m:
            groups.setdefault(m.group(1), ins)
    if len(groups) > 1:
        pf.fail("tcgen05", sorted(groups.values(), key=lambda i: i.index)[-1],
                f"tcgen05 instructions with .cta_group::{' and ::'.join(sorted(groups))}: "
                f"a kernel's must all name the same")
    _columns(pf, sites)
    _one_thread(pf, sites)
    _commit_waited(pf, sites)


def _columns(pf, sites) -> None:
    cols = {}
    for ins in sites:
        if not ins.op.startswith(("tcgen05.alloc", "tcgen05.dealloc")):
            continue
        n = pf.constant(ins.args[1]) if len(ins.args) > 1 else None
        if n is None or n < 32 or n > 512 or n & (n - 1):
            pf.fail("tcgen05", ins, f"column count {ins.args[1:2]} is not a constant power "
                                    f"of two in [32, 512]")
            continue
        cols[ins.index] = n
        if ins.op.startswith("tcgen05.alloc"):
            per_cta = {}
            for lane in pf.lanes.at(ins):
                per_cta.setdefault(pf.lanes.rank(lane), set()).add(lane // 32)
            if any(len(warps) > 1 for warps in per_cta.values()):
                pf.fail("tcgen05", ins, "more than one warp of a CTA may allocate")
    allocs = {i for i in cols if pf.k.instrs[i].op.startswith("tcgen05.alloc")}
    if not cols:
        return
    order = dag_order(pf.k)
    shown = False
    for edges, lanes in pf.lanes.classes():
        lane_set = set(lanes)
        gains = {}
        for i, n in cols.items():
            ins = pf.k.instrs[i]
            if lane_set & pf.lanes.at(ins):
                sign = 1 if i in allocs else -1
                gains.setdefault(ins.block, {})["cols"] = \
                    gains.get(ins.block, {}).get("cols", 0) + sign * n
        if not gains:
            continue
        for total in pass_sums(pf.k, edges, gains, order):
            left = dict(total).get("cols", 0)
            if left and not shown:
                shown = True
                warps = sorted({lane % pf.lanes.threads // 32 for lane in lanes})
                site = pf.k.instrs[min(cols)]
                pf.fail("tcgen05", site, f"warps {warps} may exit with {left} tensor-memory "
                                         f"columns {'allocated' if left > 0 else 'freed twice'}"
                                         f" on some pass")
        _order_rules(pf, edges, lane_set, cols, allocs)


def _order_rules(pf, edges, lanes, cols, allocs) -> None:
    """On one thread's path: no alloc after relinquish_alloc_permit; an alloc no larger
    than one before it."""
    k = pf.k
    start = {0: (False, None)}
    work = [0] if start else []
    seen_fail = set()
    while work:
        b = work.pop()
        relinquished, last = start[b]
        for i in k.blocks[b]:
            ins = k.instrs[i]
            if not ins.op.startswith("tcgen05.") or not lanes & pf.lanes.at(ins):
                continue
            if ins.op.startswith("tcgen05.relinquish_alloc_permit"):
                relinquished = True
            elif i in allocs:
                if relinquished and i not in seen_fail:
                    seen_fail.add(i)
                    pf.fail("tcgen05", ins, "an allocation after relinquish_alloc_permit")
                if last is not None and cols[i] > last and i not in seen_fail:
                    seen_fail.add(i)
                    pf.fail("tcgen05", ins, f"allocates {cols[i]} columns after an "
                                            f"allocation of {last}: the count may not grow")
                last = cols[i]
        for s in k.succ[b]:
            if (b, s) not in edges or s == k.exit:
                continue
            old = start.get(s)
            new = (relinquished or (old[0] if old else False),
                   last if old is None or old[1] is None else
                   (old[1] if last is None else min(old[1], last)))
            if new != old:
                start[s] = new
                work.append(s)


def _one_thread(pf, sites) -> None:
    for ins in sites:
        if not ins.op.startswith(_ONE_THREAD):
            continue
        per_warp = {}
        for lane in pf.lanes.at(ins):
            per_warp[lane // 32] = per_warp.get(lane // 32, 0) + 1
        many = [w for w, n in per_warp.items() if n > 1]
        if many:
            pf.fail("tcgen05", ins, f"{ins.op.split('.')[1]} is issued by one thread, but "
                                    f"{per_warp[many[0]]} lanes of a warp may run it")


def _commit_waited(pf, sites) -> None:
    waited = set()
    for ins in pf.k.instrs:
        if ins.op.startswith(("mbarrier.try_wait", "mbarrier.test_wait")):
            arr = pf.array_of(pf.addrs.operand(barrier_operand(ins)))
            if arr is not None:
                waited.add(id(arr))
    for ins in sites:
        if ins.op.startswith("tcgen05.commit"):
            arr = pf.array_of(pf.addrs.operand(barrier_operand(ins)))
            if arr is not None and id(arr) not in waited:
                pf.fail("tcgen05", ins, f"commits to {arr}, which no thread waits on")
