"""``mbarrier-phase`` (:mod:`.preflight`): each mbarrier wait's first parity, against who
completes the barrier's first phase (a hang, or a wait that passes before its data).

PTX ISA, mbarrier.test_wait/try_wait: ``.parity`` waits for the completion of the
phase whose parity the operand gives, the current phase or the one just before it.  A
barrier starts in phase 0, so a first wait with parity 0 blocks until the first phase
completes, and one with parity 1 names the phase "before" it, taken as complete: it
passes at once.  A ring's producer therefore starts its waits on the *empty* barriers at
parity 1 (the stages start free) and its consumers on the *full* ones at parity 0.

The rule models the first pass of every thread (back edges cut) as a graph:

- a wait whose first parity is 0 on a barrier array needs every site that completes that
  array's first phase: its arrivals (``mbarrier.arrive``, ``cp.async.mbarrier.arrive
  .noinc``, ``tcgen05.commit``) and the copies that complete bytes on it;
- such a site needs every wait that comes before it on every path of the threads that
  run it (the waits of the blocks that dominate it, on their edges: :mod:`.lanes`).

A cycle is a hang on the first round: a wait that needs, through the other threads, its
own thread to pass it first (a producer waiting at parity 0 on stages that start free,
or a wait on the barrier its own thread releases).  A barrier completed by bytes
(``expect_tx``, copies completing on it) holds data: its first wait must be at parity
0, else it passes before the bytes land; so judged, a cycle through such a wait is laid
at the other waits on it.  And any other wait whose first parity is 1 is right only if
the first phase it skips waits for it (some site completing that phase needs this
wait): otherwise it passes before that phase's work is done.  A wait whose first parity
is not a constant (a phase register that another loop advanced first) is left out.
"""

from .lanes import dag_order, first_pass
from .mbarrier import _arrivals, barrier_operand

_WAIT = ("mbarrier.try_wait.parity", "mbarrier.test_wait.parity")


def check_phase(pf) -> None:
    k = pf.k
    waits = {ins.index: pf.array_of(pf.addrs.operand(barrier_operand(ins)))
             for ins in k.instrs if ins.op.startswith(_WAIT)}
    waits = {i: arr for i, arr in waits.items() if arr is not None}
    if not waits:
        return
    order, back = dag_order(k)
    first = _FirstValues(k, order, back)
    parity = {i: first.at(k.instrs[i].args[2].strip(), k.instrs[i]) for i in waits}
    sites = {}  # array -> the sites that complete its phases
    for ins in k.instrs:
        bar = barrier_operand(ins)
        if bar is None or ins.op.startswith(("mbarrier.init", "mbarrier.inval")) \
                or ins.index in waits:
            continue
        arr = pf.array_of(pf.addrs.operand(bar))
        if arr is not None and (_arrivals(pf, ins) or "complete_tx" in ins.op):
            sites.setdefault(id(arr), []).append(ins.index)
    # a barrier completed by bytes (armed, copies completing on it) holds data: its
    # first wait must block; judged so, the other waits are judged against it
    data = {id(pf.array_of(pf.addrs.operand(barrier_operand(ins)))) for ins in k.instrs
            if "complete_tx" in ins.op or ins.op.startswith(("mbarrier.arrive.expect_tx",
                                                            "mbarrier.expect_tx"))}
    before = _waits_before(pf, order, back, set(waits))
    needs = {}  # node -> the nodes it needs; nodes: instruction indices
    for w, arr in waits.items():
        blocks = parity[w] == 0 or (parity[w] == 1 and id(arr) in data)
        needs[w] = set(sites.get(id(arr), ())) if blocks else set()
    for group in sites.values():
        for s in group:
            needs[s] = before.get(s, set())
    for w in sorted(waits):
        ins, arr = k.instrs[w], waits[w]
        if parity[w] == 1 and id(arr) in data:
            pf.fail("mbarrier-phase", ins, f"waits at parity 1 on {arr}, which copies "
                                           f"complete: it passes at once, before the first "
                                           f"phase's bytes land")
        elif parity[w] == 0 and w in _reach(needs, needs[w]) and not (
                id(arr) in data and any(id(waits[v]) not in data for v in
                                        _cycle(needs, w) if v in waits)):
            pf.fail("mbarrier-phase", ins, f"waits at parity 0 on {arr}, whose first phase "
                                           f"needs this wait passed first: a hang on the "
                                           f"first round")
        elif parity[w] == 1 and not any(w in _reach(needs, needs.get(s, ()))
                                        for s in sites.get(id(arr), ())):
            pf.fail("mbarrier-phase", ins, f"waits at parity 1 on {arr}: it passes at once, "
                                           f"but no site completing that barrier's first "
                                           f"phase waits for it: it runs ahead of that phase")


def _cycle(needs: dict, w) -> set:
    """The nodes on some cycle through ``w``: those it reaches that reach it."""
    return {n for n in _reach(needs, needs[w]) if w in _reach(needs, needs.get(n, ()))}


def _reach(needs: dict, start: set) -> set:
    seen, todo = set(), list(start)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(needs.get(n, ()))
    return seen


def _waits_before(pf, order, back, waits: set) -> dict:
    """``{instruction: the waits before it on every first-pass path of the threads that
    run it}``, for every instruction after some wait (lane classes united)."""
    found = {}

    def step(have, ins):
        if have:
            found.setdefault(ins.index, set()).update(have)
        return have | {ins.index} if ins.index in waits else have

    first_pass(pf, order, back, step, frozenset.intersection)
    return found


class _FirstValues:
    """A register's value the first time a thread reaches an instruction: over the
    writes that reach it with back edges cut, each a constant (``mov``, ``selp`` of two,
    ``xor`` with one); a write in a loop that does not hold the instruction (run an
    unknown number of times first) makes it unknown (None)."""

    def __init__(self, k, order, back):
        self.k = k
        self.in_loop = _loop_blocks(k, back)
        out, self.block_in = {}, {}
        for b in order:
            if b == k.exit:
                continue
            live = {}
            for p in k.pred[b]:
                if (p, b) not in back and p in out:
                    for r, ds in out[p].items():
                        live[r] = live.get(r, frozenset()) | ds
            self.block_in[b] = live
            live = dict(live)
            for i in k.blocks[b]:
                for r in k.instrs[i].defs:
                    live[r] = frozenset({i})
            out[b] = live

    def _reaching(self, reg: str, ins) -> frozenset:
        """The writes of ``reg`` that reach ``ins`` with back edges cut."""
        for i in reversed(self.k.blocks[ins.block]):
            if i < ins.index and reg in self.k.instrs[i].defs:
                return frozenset({i})
        return self.block_in.get(ins.block, {}).get(reg, frozenset())

    def at(self, reg: str, ins, depth: int = 8):
        from .ptx import imm

        v = imm(reg)
        if v is not None or depth == 0:
            return v
        values = set()
        for d in self._reaching(reg, ins):
            di = self.k.instrs[d]
            if self.in_loop.get(di.block, set()) - self.in_loop.get(ins.block, set()):
                return None
            value = self._eval(di, depth)
            if value is None:
                return None
            values.add(value)
        return values.pop() if len(values) == 1 else None

    def _eval(self, d, depth):
        a = [x.strip() for x in d.args]
        if d.guard:
            return None
        if d.op.startswith("mov") and len(a) == 2:
            return self.at(a[1], d, depth - 1)
        if d.op.startswith("xor") and len(a) == 3:
            x, y = self.at(a[1], d, depth - 1), self.at(a[2], d, depth - 1)
            return None if x is None or y is None else x ^ y
        if d.op.startswith("selp") and len(a) == 4:
            x, y = self.at(a[1], d, depth - 1), self.at(a[2], d, depth - 1)
            return x if x is not None and x == y else None
        return None


def _loop_blocks(k, back) -> dict:
    """``{block: the back edges of the loops that hold it}`` (natural loops)."""
    found = {}
    for tail, head in back:
        body, todo = {head}, [tail]
        while todo:
            b = todo.pop()
            if b not in body:
                body.add(b)
                todo.extend(k.pred[b])
        for b in body:
            found.setdefault(b, set()).add((tail, head))
    return found
