"""Value ranges of shared-memory addresses under known loop counters, for the ordering
rules that compare byte ranges across loop trips (:mod:`.bulk_reuse`).

:class:`CounterValues` evaluates a register as ``(symbol, lo, hi)``: a shared symbol
(``__dynamic_shmem__0``; None for a plain number) plus an offset in ``[lo, hi]``,
given concrete values of the kernel's *counters* (registers written more than once: a
ring buffer's index, a pipeline stage, a phase bit) in ``env``.  Exact values go
through the same 32-/64-bit arithmetic the hardware does (so a compiler's remainder
``x - ((x + bias) & -M)`` of a counter is exact); ranges go through sums, constant
scales, masks, and the ``xor``/``or`` of a swizzle (a perturbation of the low bits,
which a symbol's alignment keeps inside the span); per-thread values come from
:mod:`.uniform` over the threads that run the instruction.  Anything else is unknown
(None), never guessed.

A counter's value is kept modulo its *period*: the largest power of two it is reduced
by (``and`` with ``-M`` or ``M - 1``, ``rem M``) in the values computed from it, so a
ring index is exact while the dataflow over loop trips stays finite; a counter with no
period is kept exact while it stays small (:data:`SMALL`, or what the rule asks: a
first-trip test ``k == 0`` needs only 0 and 1 told apart), then as "at least that".
"""

import re

from .addr import leaf
from .ptx import imm
from .ranges import register_range
from .uniform import ThreadValues, _COMPARE, _signed, _width

SMALL = 64       # a counter with no period: tracked while its value stays below this
SWIZZLE = 1024   # the low bits a swizzle may perturb inside an aligned shared symbol
MANY = 1 << 31   # the top of "at least small": a counter past what is told apart


class CounterValues:
    """Ranges of one kernel's registers as functions of its counters (``env``)."""

    def __init__(self, pf, small: int = SMALL):
        self.pf, self.k, self.small = pf, pf.k, small
        self.lanes = None
        self._deps, self._memo, self._periods = {}, {}, {}

    # ------------------------------------------------------------- counters
    def is_counter(self, reg: str) -> bool:
        return len(self.k.writes.get(reg, ())) > 1

    def deps(self, reg: str) -> frozenset:
        """The counters ``reg``'s value is computed from (through single writes)."""
        if reg in self._deps:
            return self._deps[reg]
        self._deps[reg] = frozenset()  # a cycle adds nothing
        if self.is_counter(reg):
            found = frozenset({reg})
        else:
            found = frozenset()
            for d in self.k.writes.get(reg, ()):
                for u in d.uses:
                    found |= self.deps(u)
        self._deps[reg] = found
        return found

    def operand_deps(self, arg: str) -> frozenset:
        found = frozenset()
        for reg in re.findall(r"%[\w$]+", arg):
            found |= self.deps(reg)
        return found

    def period(self, counter: str):
        """The largest power of two a value computed from ``counter`` is reduced by
        (None: none)."""
        if counter not in self._periods:
            closure, found = {counter}, []
            for ins in self.k.instrs:
                used = [a.strip() for a in ins.args[1:]]
                if not any(u in closure for u in used):
                    continue
                name = ins.op.split(".")[0]
                consts = [imm(u) for u in used if imm(u) is not None]
                if name == "and" and consts:
                    m = consts[0]
                    m = -m if m < 0 else m + 1
                    if m & (m - 1) == 0 and m > 1:
                        found.append(m)
                elif name == "rem" and consts and consts[0] > 1 and \
                        consts[0] & (consts[0] - 1) == 0:
                    found.append(consts[0])
                if name in ("add", "sub", "mov", "cvt") and len(ins.defs) == 1 and \
                        not self.is_counter(ins.defs[0]):
                    closure.add(ins.defs[0])
            self._periods[counter] = max(found) if found else None
        return self._periods[counter]

    def step(self, ins, env: dict):
        """The value a counter's write ``ins`` gives it under ``env`` (None: unknown)."""
        if ins.guard:
            g = self.reg(ins.guard.lstrip("!"), ins, env)
            if not _exact(g):
                return None
            if bool(g[1]) == ins.guard.startswith("!"):
                return env.get(ins.defs[0])  # not taken: the counter keeps its value
        v = self._op(ins, env)
        p = self.period(ins.defs[0])
        if v is None or v[0] is not None:
            return None
        if _exact(v) and (p or 0 <= v[1] < self.small):
            return v[1] % p if p else v[1]
        return (self.small, MANY) if not p and v[1] >= self.small else None

    # ------------------------------------------------------------- evaluation
    def operand(self, arg: str, at, env: dict):
        """An operand (``[%r5+16]``, ``%r5``, an immediate, a shared symbol) as
        ``(symbol, lo, hi)``, or None."""
        v = imm(arg)
        if v is not None:
            return None, v, v
        m = re.fullmatch(r"\[?\s*([%\w$.]+)\s*(?:\+\s*(-?\w+))?\s*\]?", arg.strip())
        if m is None:
            return None
        v = self.reg(m.group(1), at, env)
        off = imm(m.group(2)) if m.group(2) else 0
        return None if v is None or off is None else (v[0], v[1] + off, v[2] + off)

    def anchor(self, arg: str):
        """An address operand as :meth:`~.addr.Addresses.operand` writes it, a swizzle
        (``xor``/``or`` with a value below :data:`SWIZZLE`) read as its address: what
        names the allocation an access with an unknown offset stays in."""
        sym = self.pf.addrs.operand(arg)
        for _ in range(4):
            if sym.symbols():
                break
            for name, coef in sym.registers():
                defs = self.k.writes.get(name, [])
                if coef != 1 or len(defs) != 1 or not defs[0].op.startswith(("xor", "or")):
                    continue
                a, b = (x.strip() for x in defs[0].args[1:3])
                for big, small in ((a, b), (b, a)):
                    v = self.reg(small, defs[0], {})
                    if v is not None and v[0] is None and v[1] >= 0 and v[2] < SWIZZLE:
                        sym = sym + leaf(name).scale(-1) + self.pf.addrs.value(big)
                        break
                else:
                    continue
                break
            else:
                break
        return sym

    def reg(self, reg: str, at, env: dict):
        v = imm(reg)
        if v is not None:
            return None, v, v
        if not reg.startswith("%"):
            return (reg, 0, 0) if reg in self.k.shared_align else None
        if self.is_counter(reg):
            if reg in env:
                x = env[reg]
                return None if x is None else (None, *x) if isinstance(x, tuple) else \
                    (None, x, x)
            reaching = self.k.reaching().get(at.index, {}).get(reg) if at else None
            if not reaching or len(reaching) != 1:
                return None  # a counter the dataflow does not follow
            d = self.k.instrs[next(iter(reaching))]
            return None if d.guard else self._op(d, env)  # the one write that reaches
        deps = self.deps(reg)
        key = (reg, at.index if at is not None else None,
               tuple(env.get(c) for c in sorted(deps)))
        if key not in self._memo:
            self._memo[key] = None  # a cycle reads as unknown
            self._memo[key] = self._reg(reg, at, env, deps)
        return self._memo[key]

    def restrict(self, lanes) -> None:
        """Per-thread values over ``lanes`` only (one lane class's walk; None: every
        thread that runs the instruction)."""
        if lanes != self.lanes:
            self.lanes, self._memo = lanes, {}

    def _range(self, reg, at):
        values = self.pf.lanes.values.at(reg, at)
        if values is None:
            return register_range(self.pf, reg, at)
        lanes = self.pf.lanes.reach.get(at.block, frozenset()) if at is not None else \
            frozenset(range(len(values)))
        picked = [values[lane] for lane in (lanes & self.lanes if self.lanes else lanes)]
        if not picked:
            return None
        signed = [v - (1 << 32) if v >= 1 << 31 else v for v in picked]
        return min(signed), max(signed)

    def _reg(self, reg, at, env, deps):
        defs = self.k.writes.get(reg, [])
        if not deps or len(defs) != 1 or defs[0].guard:
            rng = self._range(reg, at)
            if rng is not None or len(defs) != 1 or defs[0].guard:
                return None if rng is None else (None, rng[0], rng[1])
        return self._op(defs[0], env)

    def _op(self, d, env):
        name = d.op.split(".")[0]
        if d.args[0].startswith("{"):
            return None
        vals = [self.operand(a, d, env) for a in d.args[1:]]
        if name in ("mov", "cvt", "cvta") and len(vals) == 1 or \
                name == "shfl" and ".idx" in d.op:
            return vals[0]
        if all(_exact(v) and v[0] is None for v in vals):
            return _concrete(d, [v[1] for v in vals])
        if len(vals) < 2 or None in vals[:2]:
            if name == "and" and len(vals) == 2 and _mask(vals) is not None:
                return None, 0, _mask(vals)
            return None
        (ta, la, ha), (tb, lb, hb) = vals[:2]
        if name == "add" and not (ta and tb):
            return ta or tb, la + lb, ha + hb
        if name == "sub" and not tb:
            return ta, la - hb, ha - lb
        if name == "setp" and not ta and not tb and d.op.split(".")[1] in _ORDER:
            return _compare(d.op.split(".")[1], (la, ha), (lb, hb))
        if name in ("shl", "mul") and (name == "shl" or ".lo" in d.op) and _exact(vals[1]) \
                and not ta and not tb:
            c = 1 << lb if name == "shl" else lb
            return (None, la * c, ha * c) if c >= 0 else None
        if name == "and" and _mask(vals) is not None:
            return None, 0, _mask(vals)
        if name in ("xor", "or"):
            for (t, lo, hi), (t2, lo2, hi2) in ((vals[0], vals[1]), (vals[1], vals[0])):
                if t2 is None and lo2 >= 0 and hi2 < SWIZZLE:
                    m = (1 << hi2.bit_length()) - 1
                    return t, lo & ~m, hi | m
        return None


def _exact(v) -> bool:
    return v is not None and v[1] == v[2]


_ORDER = ("eq", "ne", "lt", "le", "gt", "ge")


def _compare(cmp, a, b):
    """A comparison of two signed ranges, where the ranges decide it."""
    if cmp in ("gt", "ge"):
        cmp, a, b = {"gt": "lt", "ge": "le"}[cmp], b, a
    if cmp in ("eq", "ne"):
        if a[1] < b[0] or b[1] < a[0]:
            v = int(cmp == "ne")
            return None, v, v
        return None
    if (a[1] < b[0]) if cmp == "lt" else (a[1] <= b[0]):
        return None, 1, 1
    if (a[0] >= b[1]) if cmp == "lt" else (a[0] > b[1]):
        return None, 0, 0
    return None


def _mask(vals):
    """``m`` of an ``and`` with a non-negative constant ``m``."""
    for v in vals[:2]:
        if _exact(v) and v[0] is None and v[1] >= 0:
            return v[1]
    return None


def _concrete(d, xs):
    """One instruction on exact operands, as the hardware computes it."""
    parts = d.op.split(".")
    name, w = parts[0], _width(d.op)
    mask = (1 << w) - 1 if w > 1 else 1
    signed = any(p.startswith("s") and p[1:].isdigit() for p in parts)
    if name == "setp" and len(xs) == 2 and parts[1] in _COMPARE:
        a, b = (_signed(x & mask, w) if signed else x & mask for x in xs)
        return None, int(_COMPARE[parts[1]](a, b)), int(_COMPARE[parts[1]](a, b))
    if name == "selp" and len(xs) == 3:
        return None, xs[0] if xs[2] else xs[1], xs[0] if xs[2] else xs[1]
    if name == "neg" and len(xs) == 1:
        v = -xs[0]
    elif name == "not" and len(xs) == 1:
        v = ~xs[0]
    elif len(xs) in (2, 3):
        out = ThreadValues._arith(name, d.op, [(x & mask,) for x in xs], w, signed, mask)
        if out is None:
            return None
        v = out[0]
    else:
        return None
    v = _signed(v & mask, w) if w > 1 else v & 1
    return None, v, v


def taken(cv, k, b, env: dict):
    """The successors of block ``b`` its branch may take under ``env`` (all of them
    where its predicate is not known)."""
    from .lanes import _target

    succ = k.succ[b]
    br = k.branch(b)
    if br is None or not br.guard or len(succ) != 2:
        return succ
    v = cv.reg(br.guard.lstrip("!"), br, env)
    if not _exact(v):
        return succ
    target = _target(k, br)
    return {target} if bool(v[1]) != br.guard.startswith("!") else succ - {target}
