"""``bulk-store-reuse`` (:mod:`.preflight`): shared memory that a bulk store reads is
not written again until a ``cp.async.bulk.wait_group.read`` has retired the store.

PTX ISA, cp.async.bulk and cp.async.bulk.tensor (``.global.shared::cta``: the source
in shared memory, read asynchronously), cp.async.bulk.commit_group and
cp.async.bulk.wait_group: the bulk operations a thread issued since its last
``commit_group`` form one bulk async-group; ``cp.async.bulk.wait_group.read N`` waits
until at most the ``N`` most recent of the thread's groups are still reading their
source (``wait_group N``: still pending at all); the groups are per thread, and a store
not yet committed is in no group.  Writing the source before its store's group is
retired is undefined: the store may send the new data (wrong results, silently).

The staging buffers are a ring (the dW epilogue's ``B`` buffers indexed
``epi_count % B``, the wait for the *next* buffer's store after this one's write), so
the rule follows byte ranges, not names: a forward dataflow over the kernel's
instructions in control-flow order (the threads' paths merged, as the named barriers
keep them in step), per path the counters' values (:mod:`.values`: the ring index is
exact), the store ranges in each committed group newest last, those not committed, and
those retired only as the issuing thread sees it.  A bulk store adds its source range;
``commit_group`` closes a group; ``wait_group[.read] N`` retires all but the ``N``
newest groups, only the stores its own threads issued; a CTA barrier
(``bar.sync``/``barrier.sync``/``bar.red``) makes those retirements visible to every
thread.  A shared-memory write (``st.shared``, ``stmatrix``, atomics, ``cp.async``, a
bulk or TMA load) that overlaps a pending store's range, or one retired only in another
thread, breaks the rule.
"""

import re

from .access import _bytes
from .ranges import allocation_at
from .values import CounterValues

_STORE = re.compile(r"^cp(\.reduce)?\.async\.bulk(\.tensor\.\dd)?\.global\.shared")
_LOAD = re.compile(r"^cp\.async\.bulk(\.tensor\.\dd)?\.shared::(cta|cluster)\.global")
_WRITE = re.compile(r"^(st\.shared|stmatrix|atom\.shared|red\.shared|"
                    r"cp\.async\.(ca|cg)\.shared)")
_BARRIER = re.compile(r"^(bar|barrier)(\.cta)?\.(sync|red)")
MAX_GROUPS = 8     # deeper: the oldest groups merged (more stays pending)
MAX_STATES = 512   # per block; more: the counters forgotten (ranges fall back)


def check_bulk_reuse(pf) -> None:
    k = pf.k
    stores = [ins for ins in k.instrs if _STORE.match(ins.op)]
    if not stores:
        return
    writes = [ins for ins in k.instrs
              if _WRITE.match(ins.op) or _LOAD.match(ins.op)]
    if not writes:
        return
    cv = CounterValues(pf)
    operands = {ins.index: _shared_operand(ins) for ins in stores + writes}
    # the counters that place a store's source: a write placed by others falls back to
    # its allocation's bytes, which no store of another allocation overlaps
    counters = sorted(frozenset().union(*(cv.operand_deps(operands[s.index])
                                          for s in stores)))
    ctx = _Context(pf, cv, counters, operands)
    found = ctx.walk()
    for i in sorted(found):
        rng, entry, why = found[i]
        ins, store = k.instrs[i], k.instrs[entry[0]]
        pf.fail("bulk-store-reuse", ins,
                f"writes {_bytes_text(rng)} that the bulk store at PTX "
                f"line {store.line} reads ({_bytes_text(entry[1:])}) {why}: the store "
                f"may send the new data")


def _shared_operand(ins) -> str:
    """The shared-memory address operand: a store's source, a write's destination."""
    return ins.args[1] if _STORE.match(ins.op) else ins.args[0]


def _bytes_text(rng) -> str:
    sym, lo, hi = rng
    if sym is None:
        return "shared memory"
    return f"{sym} bytes [{lo}, {hi})" if lo is not None else f"{sym}"


def _overlap(a, b) -> bool:
    if a[0] is None or b[0] is None:
        return True
    if a[0] != b[0]:
        return False
    if None in a[1:] or None in b[1:]:
        return True
    return a[1] < b[2] and b[1] < a[2]


class _Context:
    def __init__(self, pf, cv, counters, operands):
        self.pf, self.k, self.cv = pf, pf.k, cv
        self.counters, self.operands = counters, operands
        self.stores = [self.k.instrs[i] for i, a in operands.items()
                       if _STORE.match(self.k.instrs[i].op)]
        self.counter_defs = {d.index: d.defs[0] for c in counters
                             for d in self.k.writes.get(c, ())}
        self._widths = {}

    def width(self, ins):
        if ins.index not in self._widths:
            w = None
            if ins.op.startswith("stmatrix"):
                w = 16
            elif ".tensor" in ins.op:
                tmap = self.pf.tensor_map(ins)
                w = tmap.box_bytes if tmap is not None else None
            elif ins.op.startswith(("cp.async.bulk", "cp.async.ca", "cp.async.cg",
                                    "cp.reduce.async.bulk")):
                w = self.pf.constant(ins.args[2]) if len(ins.args) > 2 else None
            else:
                w = _bytes(ins.op)
            self._widths[ins.index] = w
        return self._widths[ins.index]

    def range_of(self, ins, env: dict):
        """``(symbol, lo, hi)`` of the bytes an access touches (None bounds: its whole
        allocation, or the symbol; a None symbol: anywhere in shared memory)."""
        arg, width = self.operands[ins.index], self.width(ins)
        v = self.cv.operand(arg, ins, env)
        if v is not None and v[0] is not None and width is not None:
            step = 1 << min(self.pf.aligned_to(arg), 10)  # the first and last start
            return v[0], v[1] + -v[1] % step, v[2] - v[2] % step + width
        sym = self.cv.anchor(arg)
        symbols = sym.symbols()
        if len(symbols) != 1:
            return None, None, None
        alloc = allocation_at(self.pf, symbols[0][0], sym.const)
        return (symbols[0][0], *alloc) if alloc else (symbols[0][0], None, None)

    # ------------------------------------------------------------- the dataflow
    def walk(self) -> dict:
        """Every thread's path (one lane class at a time: a bulk group is its issuing
        thread's), the states of each block kept apart (a ring's position is exact)."""
        found = {}
        for edges, lanes in self.pf.lanes.classes():
            lanes = frozenset(lanes)
            if any(lanes & self.pf.lanes.at(s) for s in self.stores):
                self._walk(edges, lanes, found)
        return found

    def _walk(self, edges, lanes, found) -> None:
        k = self.k
        unknown = tuple((c, None) for c in self.counters)
        start = (unknown, (), frozenset(), frozenset())
        seen, work = {0: {start}}, [(0, start)]
        self.cv.restrict(lanes)
        while work:
            b, state = work.pop()
            out = self._block(b, state, lanes, found)
            for s in k.succ[b]:
                if s == k.exit or (b, s) not in edges:
                    continue
                states = seen.setdefault(s, set())
                if len(states) >= MAX_STATES:
                    out = (unknown,) + out[1:]
                if out not in states:
                    states.add(out)
                    work.append((s, out))

    def _block(self, b, state, lanes, found):
        env_t, groups, open_, local = state
        env = dict(env_t)
        for i in self.k.blocks[b]:
            ins = self.k.instrs[i]
            op = ins.op
            if not lanes & self.pf.lanes.at(ins):
                continue
            if _STORE.match(op):
                open_ = open_ | {(i, *self.range_of(ins, env))}
            elif op.startswith("cp.async.bulk.commit_group"):
                groups = _capped(groups + (open_,))
                open_ = frozenset()
            elif op.startswith("cp.async.bulk.wait_group"):
                groups, retired = self._wait(ins, groups)
                local = local | retired
            elif _BARRIER.match(op):
                local = frozenset()
            elif i in self.operands:  # a write
                self._check_write(ins, env, groups, open_, local, found)
            if i in self.counter_defs:
                env[self.counter_defs[i]] = self.cv.step(ins, env)
        return tuple(sorted(env.items())), groups, open_, local

    def _wait(self, ins, groups):
        keep = self.pf.constant(ins.args[0])
        keep = len(groups) if keep is None else keep
        lanes = self.pf.lanes.at(ins)
        older = groups[:max(len(groups) - keep, 0)]
        newer = groups[len(older):]
        retired, stay = set(), []
        for g in older:
            mine = {e for e in g if self.pf.lanes.at(self.k.instrs[e[0]]) <= lanes}
            retired |= mine
            stay.append(g - mine)
        return tuple(stay) + newer, frozenset(retired)

    def _check_write(self, ins, env, groups, open_, local, found):
        if ins.index in found:
            return
        rng = self.range_of(ins, env)
        for n, g in enumerate(reversed(groups)):
            for e in sorted(g):
                if _overlap(rng, e[1:]):
                    found[ins.index] = (rng, e, f"while its bulk group may still be pending: "
                                           f"{n} newer group{'s' if n != 1 else ''} "
                                           f"committed and no wait_group.read {n} or "
                                           f"lower since")
                    return
        for e in sorted(open_):
            if _overlap(rng, e[1:]):
                found[ins.index] = (rng, e, "before its bulk group is committed and waited for")
                return
        lanes = self.pf.lanes.at(ins)
        for e in sorted(local):
            if _overlap(rng, e[1:]) and not lanes <= self.pf.lanes.at(self.k.instrs[e[0]]):
                found[ins.index] = (rng, e, "retired by a wait in the issuing thread with no "
                                       "barrier between that wait and this write")
                return


def _capped(groups: tuple) -> tuple:
    while len(groups) > MAX_GROUPS:
        groups = (groups[0] | groups[1],) + groups[2:]
    return groups
