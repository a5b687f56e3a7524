"""What one thread does to one mbarrier on one pass (:mod:`.preflight`): initialises it
once, and arrives on one phase of it once.

- ``mbarrier-reinit``: an ``mbarrier.init`` of a barrier an earlier ``mbarrier.init``
  on the same path set up, with no ``mbarrier.inval`` between (or an init in a loop,
  run again): PTX ISA, mbarrier.init, "performing mbarrier.init on a valid mbarrier
  object without first invalidating it is undefined"; a live barrier's pending
  arrivals and phase are lost (a hang, or a phase that completes early).
- ``arrive-twice``: a thread that arrives twice on the same barrier within one pass
  (back edges cut), its address (the same stage register, not written between)
  unchanged: the arrival rule (``mbarrier-init``) counts each site once per phase, so a
  duplicated release completes a phase early (the producer overwrites a stage still
  read).  Sites on different stages (a counter advanced between) are not duplicates.
"""

from .lanes import dag_order, first_pass
from .mbarrier import _arrivals, barrier_operand


def _place(pf, ins):
    sym = pf.addrs.operand(barrier_operand(ins))
    return sym.place, frozenset(name for name, _ in sym.registers())


def check_reinit(pf) -> None:
    k = pf.k
    inits = {ins.index: _place(pf, ins) for ins in k.instrs
             if ins.op.startswith("mbarrier.init") and barrier_operand(ins)}
    if not inits:
        return
    live_in = {0: {}}  # block -> {place: the init that set it up}, over every path
    work, flagged = [0], set()
    while work:
        b = work.pop()
        live = dict(live_in[b])
        for i in k.blocks[b]:
            ins = k.instrs[i]
            if ins.op.startswith("mbarrier.inval"):
                live.pop(_place(pf, ins)[0], None)
            elif i in inits:
                place = inits[i][0]
                if place in live and i not in flagged:
                    flagged.add(i)
                    pf.fail("mbarrier-reinit", ins, f"initialises the barrier that the "
                                                    f"mbarrier.init at PTX line "
                                                    f"{k.instrs[live[place]].line} set up, "
                                                    f"with no mbarrier.inval between")
                live[place] = i
        for s in k.succ[b]:
            if s == k.exit:
                continue
            old = live_in.get(s)
            new = live if old is None else {**live, **old}
            if old is None or new.keys() != old.keys():
                live_in[s] = new
                work.append(s)


def check_arrive_twice(pf) -> None:
    k = pf.k
    arrives = {}
    for ins in k.instrs:
        if barrier_operand(ins) is None or ins.op.startswith(("mbarrier.init", "mbarrier.inval")):
            continue
        if _arrivals(pf, ins) and pf.array_of(pf.addrs.operand(barrier_operand(ins))):
            arrives[ins.index] = _place(pf, ins)
    if len(arrives) < 2:
        return
    found = {}

    def step(done, ins):
        if ins.index in arrives:
            place, regs = arrives[ins.index]
            first = next((s for p, _, s in done if p == place and s != ins.index), None)
            if first is not None:
                found.setdefault(ins.index, first)
            done = done | {(place, regs, ins.index)}
        if ins.defs:  # a stage register written: a later arrive names another stage
            written = set(ins.defs)
            done = frozenset(d for d in done if not d[1] & written)
        return done

    # (place, registers, site) arrived on so far this pass, over every path
    first_pass(pf, *dag_order(k), step, frozenset.union)
    for i, first in sorted(found.items()):
        pf.fail("arrive-twice", k.instrs[i], f"arrives again on the barrier this thread "
                                             f"arrived on at PTX line {k.instrs[first].line} "
                                             f"in the same pass, its stage unchanged: one "
                                             f"phase gets both")
