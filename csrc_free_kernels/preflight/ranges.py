"""Value ranges of the registers that offset a shared-memory address, for the
pre-flight's bounds and overlap tests (:mod:`.bulk`): a register's range is
its values over the threads that run an instruction where those are known exactly
(:class:`~.uniform.ThreadValues`), a modular counter's ``[start, N - 1]``
(the pipeline stage: written ``0`` or ``c``, else ``next == N ? 0 : next`` with
``next = reg + 1``), ``[0, m]`` for ``and`` with a constant ``m``, ``(-M, M)`` for a
remainder by ``M`` (``rem``, or the compiler's ``x - ((x + bias) & -M)``); otherwise
unknown.
"""

from .ptx import imm


def register_range(pf, reg: str, ins=None):
    """``(lo, hi)`` of ``reg``'s values (at ``ins``, over the threads that run it), or
    None."""
    values = pf.lanes.values.at(reg, ins)
    if values is None and reg.startswith("%") and reg not in pf.k.writes:
        values = pf.lanes.values.operand(reg, 32)  # %tid.x, %cluster_ctarank
    if values is not None:
        lanes = pf.lanes.at(ins) if ins is not None else ()
        picked = [values[lane] for lane in lanes] or list(values)
        signed = [v - (1 << 32) if v >= 1 << 31 else v for v in picked]
        return min(signed), max(signed)
    counter = _counter(pf, reg)
    if counter is not None:
        return counter
    defs = pf.k.writes.get(reg, [])
    if len(defs) != 1 or len(defs[0].args) != 3:
        return None
    d = defs[0]
    if d.op.startswith("and"):
        for x in d.args[1:]:
            m = imm(x)
            if m is not None and m >= 0:
                return 0, m
    if d.op.startswith("rem") and imm(d.args[2]) is not None and imm(d.args[2]) > 0:
        m = imm(d.args[2])
        return (0 if ".u" in d.op else 1 - m), m - 1
    m = _signed_remainder(pf, d)
    return (1 - m, m - 1) if m else None


def _signed_remainder(pf, d):
    """M when ``d`` is the compiler's ``x srem M`` (M a power of two):
    ``x - ((x + bias) & -M)``."""
    if not d.op.startswith("sub"):
        return None
    x, y = (a.strip() for a in d.args[1:])
    ands = pf.k.writes.get(y, [])
    if len(ands) != 1 or not ands[0].op.startswith("and"):
        return None
    m = imm(ands[0].args[2])
    if m is None or m >= 0 or (-m) & (-m - 1):
        return None
    adds = pf.k.writes.get(ands[0].args[1].strip(), [])
    if len(adds) != 1 or not adds[0].op.startswith("add") or x not in \
            [a.strip() for a in adds[0].args[1:]]:
        return None
    return -m


def _counter(pf, reg: str):
    defs = pf.k.writes.get(reg, [])
    starts, limit = [], None
    for d in defs:
        start = _start_value(pf, d)
        if start is not None:
            starts.append(start)
            continue
        if not d.op.startswith("selp") or len(d.args) != 4:
            return None
        a, b, p = (x.strip() for x in d.args[1:])
        zero_first = imm(a) == 0
        nxt = b if zero_first else a
        if (imm(b) if not zero_first else imm(a)) != 0:
            return None
        n = _wrap_limit(pf, nxt, reg, p.lstrip("!"), zero_first != p.startswith("!"))
        if n is None or (limit is not None and n != limit):
            return None
        limit = n
    if limit is None or not starts or min(starts) < 0 or max(starts) >= limit:
        return None
    return min(starts), limit - 1


def _start_value(pf, d):
    """A counter's start: an unguarded ``mov`` of an immediate, or of a register every
    write reaching it sets to one immediate (the phase bit it starts beside)."""
    if not d.op.startswith("mov") or d.guard or len(d.args) != 2:
        return None
    value = imm(d.args[1])
    if value is not None:
        return value
    reaching = pf.k.reaching().get(d.index, {}).get(d.args[1].strip()) or ()
    values = {imm(pf.k.instrs[r].args[1]) if pf.k.instrs[r].op.startswith("mov") and
              not pf.k.instrs[r].guard else None for r in reaching}
    return values.pop() if len(values) == 1 and None not in values else None


def _wrap_limit(pf, nxt: str, reg: str, pred: str, zero_when_true: bool):
    """N when ``nxt = reg + 1`` and ``pred`` is ``nxt == N`` (``zero_when_true``) or
    ``nxt != N``."""
    adds = pf.k.writes.get(nxt, [])
    if len(adds) != 1 or not adds[0].op.startswith("add") or \
            {x.strip() for x in adds[0].args[1:]} != {reg, "1"}:
        return None
    tests = pf.k.writes.get(pred, [])
    if len(tests) != 1 or not tests[0].op.startswith("setp"):
        return None
    cmp = tests[0].op.split(".")[1]
    x, y = (v.strip() for v in tests[0].args[1:3])
    n = imm(y) if x == nxt else imm(x) if y == nxt else None
    if n is None or n <= 0 or (cmp, zero_when_true) not in (("eq", True), ("ne", False)):
        return None
    return n


def sym_range(pf, sym, ins=None, extra=None):
    """``(lo, hi)`` of a :class:`~.addr.Sym`'s offset from its shared
    symbol: each register term over its interval (:func:`interval`; ``extra``: ranges
    known otherwise, e.g. a stage tied to its barrier array), or None if one is
    unbounded."""
    lo = hi = sym.const
    for name, coef in sym.registers():
        rng = (extra or {}).get(name) or interval(pf, name, ins)
        if rng is None:
            return None
        a, b = coef * rng[0], coef * rng[1]
        lo, hi = lo + min(a, b), hi + max(a, b)
    return lo, hi


def interval(pf, reg: str, ins=None, depth: int = 12):
    """``(lo, hi)`` of a register: :func:`register_range` where it knows the register,
    else interval arithmetic over its one write (sums, differences, shifts and
    multiplies by constants, moves), a shared symbol counting 0; None if unbounded."""
    from .ptx import imm

    v = imm(reg)
    if v is not None:
        return v, v
    if not reg.startswith("%"):
        return (0, 0) if reg in pf.k.shared_align else None
    rng = register_range(pf, reg, ins)
    if rng is not None or depth == 0:
        return rng
    defs = pf.k.writes.get(reg, [])
    if len(defs) != 1 or defs[0].guard or defs[0].args[0].startswith("{"):
        return None
    d = defs[0]
    name, a = d.op.split(".")[0], [x.strip() for x in d.args[1:]]

    def sub(x):
        return interval(pf, x, ins, depth - 1)

    if name in ("mov", "cvt", "cvta") and len(a) == 1 or name == "shfl" and ".idx" in d.op:
        return sub(a[0])
    if name in ("add", "sub") and len(a) == 2:
        x, y = sub(a[0]), sub(a[1])
        if x is None or y is None:
            return None
        return (x[0] + y[0], x[1] + y[1]) if name == "add" else (x[0] - y[1], x[1] - y[0])
    if name == "shl" and len(a) == 2 and imm(a[1]) is not None:
        x = sub(a[0])
        return None if x is None else (x[0] << imm(a[1]), x[1] << imm(a[1]))
    if name in ("mul", "mad") and len(a) >= 2 and (".lo" in d.op or ".wide" in d.op):
        for p, q in ((a[0], a[1]), (a[1], a[0])):
            c = imm(q)
            x = sub(p) if c is not None else None
            if x is not None:
                lo, hi = sorted((x[0] * c, x[1] * c))
                if name == "mad":
                    z = sub(a[2])
                    return None if z is None else (lo + z[0], hi + z[1])
                return lo, hi
    return None


def operand_range(pf, operand: str, ins=None, extra=None):
    """``(lo, hi)`` of an address operand's offset from its shared symbol (``[%r5+16]``)."""
    import re

    m = re.fullmatch(r"\[?\s*([%\w$]+)\s*(?:\+\s*(-?\d+))?\s*\]?", operand.strip())
    if m is None:
        return None
    off = int(m.group(2) or 0)
    rng = (extra or {}).get(m.group(1)) or interval(pf, m.group(1), ins)
    return None if rng is None else (rng[0] + off, rng[1] + off)


def shared_size(pf, symbol: str):
    """The bytes a shared symbol spans: the build's dynamic shared memory for the
    ``.extern`` array, a static array's declared size, else None."""
    import re

    m = re.search(r"\.shared\s+\.align\s+\d+\s+\.b8\s+" + re.escape(symbol)
                  + r"\[(\d*)\]", pf.k.text)
    if m is None:
        return None
    return int(m.group(1)) if m.group(1) else pf.facts.smem_bytes


def allocation_at(pf, symbol: str, offset):
    """``(start, end)`` of the shared-memory allocation (recorded at trace time) that
    holds ``offset`` of the dynamic shared memory, or None."""
    regions = getattr(pf.facts, "smem_regions", None)
    if not regions or shared_size(pf, symbol) != pf.facts.smem_bytes:
        return None
    return next(((a, b) for a, b in regions if a <= offset < b), None)


def footprint(pf, sym, ins, width, operand=None):
    """``(symbol, lo, hi)``: the bytes an access of ``width`` at ``sym`` may touch; an
    offset with no known range is taken to stay inside the allocation its constant
    falls in (an access past its own buffer is a bug of its own), else anywhere
    (``lo``/``hi`` None)."""
    symbols = sym.symbols()
    if len(symbols) != 1:
        return None
    name = symbols[0][0]
    rng = sym_range(pf, sym, ins) or (operand_range(pf, operand, ins) if operand else None)
    if rng is not None and width is not None:
        return name, rng[0], rng[1] + width
    alloc = allocation_at(pf, name, sym.const)
    return (name, *alloc) if alloc else (name, None, None)
