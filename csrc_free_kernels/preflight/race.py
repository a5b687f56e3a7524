"""Raced loads (:mod:`.preflight`): a value loaded from a location that other threads
write concurrently is not uniform, however uniform its address.

PTX ISA, memory consistency model ("Data races", "Causality order"): a load that no
synchronisation (a barrier both threads take, an mbarrier, a fence pair) orders against
a conflicting write to an overlapping location may read that write's value or an
earlier one, so threads that load one address in one barrier phase may read different
values.  :class:`~.uniform.UniformityFlow` therefore gives the value of a load from a
uniform address that :class:`Races` finds a concurrent write for the per-thread level,
and ``raced-uniform`` (reported from :mod:`.collective`, the load named by
:func:`blame`) is a collective or barrier whose control is not uniform only because of
one: ``bar.sync`` taken by some threads and not others hangs (PTX ISA, bar.sync), a warp
collective or ``elect.sync`` a lane leaves is undefined (``.aligned``).

A load races with a write when the two may overlap and may run in the same phase:

- *overlap*, by state space and base: shared accesses by their symbol and bytes
  (where the offset's range is known, :func:`~.ranges.sym_range`, and meets at most
  one allocation; else the allocation that the constant at the top of the address's sum
  falls in, the DSL addressing a buffer as its start plus an offset into it,
  swizzles included: :func:`_sum_top`; else the whole symbol); global accesses by the
  pointer parameter at the top of the address's sum (``ld.param``), any global access
  where that is not one parameter; a generic access (no state space) overlaps every
  other; mbarrier objects are left out (only mbarrier instructions may access them);
- *phase*: a write to the CTA's own shared memory by its threads (``st``, ``atom``,
  ``red``, ``stmatrix``) and a load of it are ordered when no CTA-wide barrier
  (``bar.sync``/``barrier.sync``/``bar.red`` without a thread count or counting every
  thread, ``barrier.cluster.wait``), and not the entry, starts a barrier-free stretch
  of the CFG that reaches both (:class:`_Phases`).  Every thread passes those barriers
  in the same order (they run under CTA-uniform control: ``named-barrier``), so the
  write then lies in an earlier phase than the load on every path, or in a later one:
  both orders, a write after the load in a loop included.  A write through
  ``shared::cluster``, or any write against a ``shared::cluster`` load (another CTA's
  memory), is ordered only by the cluster barrier; any other asynchronous write
  (``cp.async``, bulk stores, ``st.async``) and any global write (the other CTAs of the
  grid run the same code, and no barrier orders them) never are.  A copy that
  completes on an mbarrier (``complete_tx``: TMA and bulk loads) is left out: its
  box is read after a wait on that barrier's phase, which makes its writes visible to
  every thread that waits (PTX ISA, mbarrier: tx-count), and its stage is refilled
  only once its readers release it (the ring the mbarrier rules check).
"""

import functools
import re

from .ptx import imm
from .ranges import allocation_at, operand_range, sym_range

_LOAD = re.compile(r"^(ld|ldu)\.")
_STORE = re.compile(r"^(st|atom|red|stmatrix|multimem\.(st|red))\.")
_ASYNC = re.compile(r"^(cp\.async|cp\.reduce\.async|st\.async|red\.async)")
_CTA_BAR = re.compile(r"^(bar|barrier)(\.cta)?\.(sync|red)\b")
_WIDTH = re.compile(r"\.[bsuf](\d+)$")
_VECTOR = re.compile(r"\.v(\d)\.")


def _bytes(op: str):
    vec, width = _VECTOR.search(op), _WIDTH.search(op)
    if width is None:
        return None
    return (int(vec.group(1)) if vec else 1) * max(int(width.group(1)) // 8, 1)


def _space(op: str) -> str:
    """The state space an access names (a copy's destination: the first one it names)."""
    for part in op.split("."):
        if part.startswith(("shared", "global")):
            return "cluster" if part == "shared::cluster" else part.split("::")[0]
    return "generic"


class _Access:
    """Where one load or write may touch: its state space and its base (a shared
    footprint ``(symbol, lo, hi)``, a global pointer ``(parameter, offset)``; None: not
    known), the base worked out when first compared."""

    def __init__(self, pf, ins, operand: str, size):
        self.pf, self.ins, self.operand, self.size = pf, ins, operand, size
        self.memory = _memory(_space(ins.op))

    @functools.cached_property
    def base(self):
        if self.memory == "shared":
            return _shared_footprint(self.pf, self.ins, self.operand, self.size)
        if self.memory == "global":
            leaves, _ = _sum_top(self.pf, self.operand, through_loops=True)
            return leaves.pop() if len(leaves) == 1 else None
        return None

    def may_meet(self, other: "_Access") -> bool:
        """Whether the two may touch the same memory."""
        if "generic" in (self.memory, other.memory):
            return True
        if self.memory != other.memory:
            return False
        if self.base is None or other.base is None:
            return True
        if self.memory == "global":
            return self.base == other.base
        (name, lo, hi), (name2, lo2, hi2) = self.base, other.base
        return name == name2 and (None in (lo, hi, lo2, hi2) or not (hi <= lo2 or hi2 <= lo))


def _memory(space: str) -> str:
    """The memory a state space names (``shared::cluster`` is shared memory too)."""
    return "shared" if space == "cluster" else space


def _shared_footprint(pf, ins, operand: str, size):
    """``(symbol, lo, hi)`` a shared access may touch (``lo``, ``hi`` None: anywhere in
    the symbol; None: anywhere): its bytes where its offset's range is known and meets
    at most one allocation; else the allocation that the constant at the top of the
    address's sum falls in (:func:`_sum_top`); else its bytes, or the whole symbol."""
    sym = pf.addrs.operand(operand)
    symbols = sym.symbols()
    name = symbols[0][0] if len(symbols) == 1 and symbols[0][1] == 1 else None
    rng = (sym_range(pf, sym, ins) or operand_range(pf, operand, ins)) if name else None
    bytes_ = None if rng is None or size is None else (name, rng[0], rng[1] + size)
    regions = getattr(pf.facts, "smem_regions", None) or ()
    if bytes_ and sum(a < bytes_[2] and bytes_[1] < b for a, b in regions) <= 1:
        return bytes_
    tops, offset = _sum_top(pf, operand)
    if len(tops) == 1:
        top = tops.pop()
        alloc = allocation_at(pf, top, offset)
        if alloc is not None:
            return (top, *alloc)
    return bytes_ or ((name, None, None) if name else None)


def _sum_top(pf, operand: str, through_loops: bool = False) -> tuple:
    """``(leaves, constant)``: what an address adds at the top of its sum (through
    ``add``, ``mad``'s addend, moves, broadcasts and swizzles ``x ^ m`` with ``m``
    masked), leaving out what is scaled or computed: its shared symbols or the kernel
    parameters (``(name, offset)`` of an ``ld.param``) it starts from, and the
    constant.  A buffer is addressed so, as its start plus an offset into it.
    ``through_loops``: a register written in several places (a pointer advanced in a
    loop) adds each write's leaves (the constant is then meaningless)."""
    m = re.fullmatch(r"\[?\s*([%\w$]+)\s*(?:\+\s*(-?\d+))?\s*\]?", operand.strip())
    if m is None:
        return set(), 0
    leaves, total, todo, seen = set(), int(m.group(2) or 0), [m.group(1)], set()
    while todo and len(seen) < 64:
        arg = todo.pop()
        v = imm(arg)
        if v is not None:
            total += v
            continue
        if not arg.startswith("%"):
            leaves.add(arg)
            continue
        defs = pf.k.writes.get(arg, [])
        if not defs or len(defs) > 1 and not through_loops:
            continue
        for d in defs:
            if d.index in seen:
                continue
            seen.add(d.index)
            args, name = [a.strip() for a in d.args[1:]], d.op.split(".")[0]
            if d.op.startswith("ld.param") and len(args) == 1:
                p = re.fullmatch(r"\[\s*(\w+)\s*(?:\+\s*(\d+))?\s*\]", args[0])
                leaves.add((p.group(1), int(p.group(2) or 0)) if p else args[0])
            elif name in ("mov", "cvt", "cvta") and len(args) == 1 or \
                    name == "shfl" and ".idx" in d.op:
                todo.append(args[0])
            elif name == "add" and len(args) == 2:
                todo.extend(args)
            elif name == "mad" and len(args) == 3:
                todo.append(args[2])
            elif name == "xor" and len(args) == 2:
                masked = [a for a in args if pf.addrs.upper(a) is not None]
                todo.extend(a for a in args if a not in masked[:1])
    return leaves, total


def _write(pf, ins):
    """A write's :class:`_Access` and the barriers that order it (``"cta"``,
    ``"cluster"`` or None: none do), or None if ``ins`` writes no memory (mbarrier
    objects are left out: only mbarrier instructions may access them, PTX ISA)."""
    op = ins.op
    if op.startswith(("mbarrier.", "cp.async.bulk.prefetch", "cp.async.commit",
                      "cp.async.wait", "cp.async.bulk.commit", "cp.async.bulk.wait",
                      "cp.async.mbarrier")):
        return None
    if "mbarrier::complete_tx" in op:
        return None  # its readers wait on the barrier's phase: the copy is done for all
    if _ASYNC.match(op):
        size = (pf.constant(ins.args[2]) if len(ins.args) > 2 else None) \
            if op.startswith("cp.") else _bytes(op)
        return _Access(pf, ins, ins.args[0], size), None
    operand = next((a for a in ins.args if a.startswith("[")), None)
    if not _STORE.match(op) or operand is None:
        return None
    access = _Access(pf, ins, operand, 16 if op.startswith("stmatrix") else _bytes(op))
    return access, {"shared": "cta", "cluster": "cluster"}.get(_space(op))


class _Phases:
    """``origins(ins)``: the barriers ``cut`` picks (and the entry, -1) from which a
    barrier-free stretch of the CFG reaches ``ins``."""

    def __init__(self, pf, cut):
        k = self.k = pf.k
        self.cut = {ins.index for ins in k.instrs if cut(pf, ins)}
        into = {b: frozenset() for b in k.succ}
        into[0] = frozenset({-1})
        work = [0]
        while work:
            b = work.pop()
            if b == k.exit:
                continue
            last = [i for i in k.blocks[b] if i in self.cut]
            out = frozenset({last[-1]}) if last else into[b]
            for s in k.succ[b]:
                if not out <= into[s]:
                    into[s] = into[s] | out
                    work.append(s)
        self.into = into

    def origins(self, ins) -> frozenset:
        before = [i for i in self.k.blocks[ins.block] if i < ins.index and i in self.cut]
        return frozenset({before[-1]}) if before else self.into[ins.block]


def _cta_barrier(pf, ins) -> bool:
    """A barrier every thread of the CTA takes: ``bar.sync``/``barrier.sync``/``bar.red``
    without a thread count or counting them all, or the cluster barrier's wait."""
    if ins.op.startswith("barrier.cluster.wait"):
        return True
    if not _CTA_BAR.match(ins.op):
        return False
    args = ins.args[1:-1] if ".red" in ins.op else ins.args
    return len(args) <= 1 or pf.constant(args[1]) == pf.k.threads


def _cluster_barrier(pf, ins) -> bool:
    return ins.op.startswith("barrier.cluster.wait")


class Races:
    """``races(load)``: the write a load races with (an instruction), or None; each
    load judged once, when first asked (:class:`~.uniform.UniformityFlow` asks only
    of loads from a uniform address)."""

    def __init__(self, pf):
        self.pf = pf
        self.found = {}  # load index -> the write, or None
        self._writes = None
        self._phases = {}

    def __call__(self, ins):
        if ins.index not in self.found:
            self.found[ins.index] = self._judge(ins)
        return self.found[ins.index]

    def _judge(self, ins):
        if not _LOAD.match(ins.op) or re.search(r"\.(param|const|local)\b", ins.op) \
                or len(ins.args) < 2:
            return None
        if self._writes is None:
            self._writes = [w for w in (_write(self.pf, i) for i in self.pf.k.instrs)
                            if w is not None]
        load = _Access(self.pf, ins, ins.args[1], _bytes(ins.op))
        for write, order in self._writes:
            if "generic" not in (load.memory, write.memory) and load.memory != write.memory:
                continue
            if order == "cta" and _space(ins.op) == "cluster":
                order = "cluster"  # another CTA's writes: its barriers order nothing here
            if order is not None:
                phases = self._phases.get(order)
                if phases is None:
                    phases = self._phases[order] = _Phases(
                        self.pf, _cta_barrier if order == "cta" else _cluster_barrier)
                if not phases.origins(ins) & phases.origins(write.ins):
                    continue
            if load.may_meet(write):
                return write.ins
        return None


def blame(pf, ins, guard_regs):
    """The raced load (an instruction) whose value the registers ``guard_regs`` (read
    at ``ins``) are computed from, through the writes that reach them, or None."""
    reaching = pf.k.reaching()
    seen, todo = set(), [(ins.index, r) for r in guard_regs]
    while todo:
        at, reg = todo.pop()
        for d in sorted(reaching.get(at, {}).get(reg, ())):
            if d in seen:
                continue
            seen.add(d)
            if pf.races.found.get(d) is not None:
                return pf.k.instrs[d]
            todo.extend((d, r) for r in pf.k.instrs[d].uses)
    return None
