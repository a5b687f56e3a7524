"""Which threads of a cluster may run each instruction of a kernel's PTX, for the rules
that count threads (:mod:`.preflight`): the arrivals an mbarrier phase gets, the threads
a named barrier waits for, the bytes a stage's loads deliver.

A lane is one thread of one CTA of the cluster, ``rank * threads + tid``.  Every lane
enters at the first block.  A branch (or a guard) whose predicate is computed from
``%tid.x``, the cluster rank and constants is evaluated for every lane
(:class:`~.uniform.ThreadValues`); one on an ``elect.sync`` predicate sends one
lane of each warp (the lowest of those that reach it: the choice is deterministic, PTX
ISA, elect.sync) one way and the rest the other; ``and``/``or``/``not`` of predicates
combine what is known per lane; any other may send every lane either way, so a lane
set is what *may* run an instruction.
"""

from .ptx import Instr, Kernel, imm
from .uniform import ThreadValues


class Lanes:
    """``reach[block]``: the lanes that may run each block."""

    def __init__(self, kernel: Kernel, cluster: tuple | None = None):
        self.k = kernel
        self.values = ThreadValues(kernel, cluster)
        self.threads, self.ranks = self.values.threads, self.values.ranks
        self._chosen = {}  # elect.sync index -> its lanes, fixed for one propagation
        for _ in range(4):
            self._propagate()
            final = {i: self._elect_from_reach(self.k.instrs[i]) for i in self._chosen}
            if final == self._chosen:
                return
            self._chosen = final
        raise RuntimeError("the lanes of the elect.sync branches did not settle")

    def _propagate(self) -> None:
        kernel = self.k
        self.reach = {b: frozenset() for b in kernel.succ}
        self.edges = {}  # (block, successor) -> the lanes that may take that edge
        self.reach[0] = frozenset(range(self.values.n))
        changed = True
        while changed:
            changed = False
            for b in range(len(kernel.blocks)):
                if not self.reach[b]:
                    continue
                br = kernel.branch(b)
                yes, no = self.split(br, br.guard) if br is not None else (None, None)
                target = _target(kernel, br) if br is not None else None
                for s in kernel.succ[b]:
                    flow = self.reach[b]
                    if yes is not None and len(kernel.succ[b]) == 2:
                        flow = yes if s == target else no
                    self.edges[b, s] = flow
                    if not flow <= self.reach[s]:
                        self.reach[s] = self.reach[s] | flow
                        changed = True

    def split(self, ins: Instr, guard: str) -> tuple:
        """``(may_hold, may_fail)``: the lanes of ``ins``'s block for which ``guard``
        (``%p``, ``!%p``) may hold and may fail; a lane in both is not known."""
        here = self.reach.get(ins.block, frozenset())
        yes, no = self._may(guard.lstrip("!"), here, 6, ins)
        return (no, yes) if guard.startswith("!") else (yes, no)

    def _may(self, pred: str, here: frozenset, depth: int, at: Instr) -> tuple:
        values = self.values.at(pred, at)
        if values is not None:
            yes = frozenset(lane for lane in here if values[lane])
            return yes, here - yes
        reaching = self.k.reaching().get(at.index, {}).get(pred) or ()
        if depth == 0 or len(reaching) != 1:
            return here, here
        d = self.k.instrs[next(iter(reaching))]
        if d.guard:
            return here, here
        parts = [a.strip() for a in d.args[1:]]
        if d.op.startswith("not.pred") and len(parts) == 1:
            yes, no = self._may(parts[0].lstrip("!"), here, depth - 1, d)
            return (yes, no) if parts[0].startswith("!") else (no, yes)
        if d.op.startswith(("and.pred", "or.pred")) and len(parts) == 2:
            sides = []
            for p in parts:
                yes, no = self._may(p.lstrip("!"), here, depth - 1, d)
                sides.append((no, yes) if p.startswith("!") else (yes, no))
            (y1, n1), (y2, n2) = sides
            if d.op.startswith("and"):
                return y1 & y2, n1 | n2
            return y1 | y2, n1 & n2
        if d.op.startswith("elect.sync") and "|" in d.args[0]:
            found = self.elected(d) & here
            return found, here - found
        return here, here

    def true_lanes(self, ins: Instr, guard: str):
        """The lanes for which ``guard`` holds, or None where some lane is not known."""
        yes, no = self.split(ins, guard)
        return None if yes & no else yes

    def elected(self, elect: Instr) -> frozenset:
        """One lane per warp of those that reach ``elect`` (and are in its mask)."""
        if elect.index not in self._chosen:
            self._chosen[elect.index] = self._elect_from_reach(elect)
        return self._chosen[elect.index]

    def _elect_from_reach(self, elect: Instr) -> frozenset:
        mask = imm(elect.args[1]) if len(elect.args) > 1 else None
        mask = 0xFFFFFFFF if mask is None or mask == -1 else mask & 0xFFFFFFFF
        chosen = {}
        for lane in sorted(self.reach.get(elect.block, ())):
            if mask >> (lane % self.threads % 32) & 1:
                chosen.setdefault(lane // 32, lane)
        return frozenset(chosen.values())

    def at(self, ins: Instr) -> frozenset:
        """The lanes that may execute ``ins`` (its block's, less those its guard stops)."""
        if not ins.guard:
            return self.reach.get(ins.block, frozenset())
        return self.split(ins, ins.guard)[0]

    def rank(self, lane: int) -> int:
        return lane // self.threads

    def per_cta(self, lanes) -> dict:
        """``{rank: threads of that CTA among lanes}``."""
        counts = {}
        for lane in lanes:
            counts[lane // self.threads] = counts.get(lane // self.threads, 0) + 1
        return counts

    def classes(self) -> list:
        """The lanes grouped by the CFG edges they may take: ``[(edges, lanes)]``, the
        edges a frozenset of ``(block, successor)``."""
        by_lane = {}
        for edge, lanes in self.edges.items():
            for lane in lanes:
                by_lane.setdefault(lane, set()).add(edge)
        groups = {}
        for lane, edges in by_lane.items():
            groups.setdefault(frozenset(edges), []).append(lane)
        return [(edges, lanes) for edges, lanes in groups.items()]


def _target(kernel: Kernel, branch) -> int:
    label = branch.args[0] if branch.args else None
    if branch.op.startswith("bra") and label in kernel.labels:
        return kernel.instrs[kernel.labels[label]].block
    return kernel.exit


def dag_order(kernel: Kernel) -> tuple:
    """The blocks in a topological order of the CFG without its back edges, and those
    back edges (found by a depth-first walk from the entry)."""
    back, done, on_stack, post = set(), set(), set(), []
    stack = [(0, iter(sorted(kernel.succ[0])))]
    on_stack.add(0)
    while stack:
        node, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            stack.pop()
            on_stack.discard(node)
            done.add(node)
            post.append(node)
        elif nxt in on_stack:
            back.add((node, nxt))
        elif nxt not in done:
            on_stack.add(nxt)
            stack.append((nxt, iter(sorted(kernel.succ[nxt]))))
    return post[::-1], back


def first_pass(pf, order, back, step, merge) -> None:
    """Each class of lanes (:meth:`Lanes.classes`) walked through one pass of the CFG
    (``order``, ``back``: :func:`dag_order`; back edges cut), a state carried along the
    edges the class may take: ``step(state, ins)`` gives the state after each
    instruction the class may run, ``merge(old, new)`` joins the states that reach a
    block by several edges; the entry starts from the empty frozenset."""
    k = pf.k
    for edges, lanes in pf.lanes.classes():
        lanes = frozenset(lanes)
        into = {0: frozenset()}
        for b in order:
            if b not in into or b == k.exit:
                continue
            state = into[b]
            for i in k.blocks[b]:
                ins = k.instrs[i]
                if lanes & pf.lanes.at(ins):
                    state = step(state, ins)
            for s in k.succ[b]:
                if (b, s) in edges and (b, s) not in back and s != k.exit:
                    into[s] = state if s not in into else merge(into[s], state)


def pass_sums(kernel: Kernel, edges: frozenset, gains: dict, order=None) -> set:
    """The totals of ``gains`` (``{block: {key: amount}}``) over every pass from the entry
    to the exit along ``edges`` (one lane's: :meth:`Lanes.classes`) with the back edges
    cut (one trip around each loop): a set of frozensets of ``(key, total)``."""
    order, back = order or dag_order(kernel)
    totals = {0: {frozenset()}}
    for b in order:
        if b not in totals:
            continue
        here = gains.get(b)
        sums = totals[b]
        if here:
            sums = {_add(s, here) for s in sums}
        for nxt in kernel.succ[b]:
            if (b, nxt) in back or (b, nxt) not in edges:
                continue
            totals.setdefault(nxt, set()).update(sums)
    return totals.get(kernel.exit, set())


def _add(total: frozenset, gains: dict) -> frozenset:
    merged = dict(total)
    for key, amount in gains.items():
        merged[key] = merged.get(key, 0) + amount
    return frozenset((k, v) for k, v in merged.items() if v)
