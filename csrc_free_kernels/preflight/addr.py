"""Symbolic addresses for the pre-flight (:mod:`.preflight`): which mbarrier an
instruction names, where a TMA box lands, where a ``wgmma`` descriptor points, compared
across instructions without running them.

:meth:`Addresses.of` writes a register as a constant plus multiples of shared-memory
symbols (``__dynamic_shmem__0``) and of opaque registers (a pipeline's stage counter,
a tile index), and which CTA of the cluster it names (:class:`Sym`).  It follows single
writes through moves, conversions, ``cvta``, broadcasts (``shfl.sync.idx``), sums, shifts
and multiplies by constants, and the masks that only clear bits known to be zero or the
CTA-rank bits of a ``shared::cluster`` address (a 2-SM pair's "peer bit"); anything else
is an opaque register of its own.  Two instructions name the same barrier when their
symbols are equal: the same stage register at the same offset.

:func:`barrier_arrays` groups the ``mbarrier.init`` instructions into arrays (one
pipeline's barriers, one per stage); :func:`param_alignment` reads what the launch
promises about the kernel's parameters (a tensor's address alignment, its strides'
divisibility) from the operand types the DSL printed (:mod:`.trace`).
"""

import dataclasses
import re
from fractions import Fraction

from .ptx import Kernel, imm

SHARED_BITS = 24     # a shared::cluster address: the CTA's rank above bit 24
DESC_FIELD = 0x3FFF  # a matrix descriptor's address: bits 4..17 of a shared address


@dataclasses.dataclass(frozen=True)
class Sym:
    """``const + sum(coef * name)`` over ``terms`` (sorted ``(name, coef)``), in the CTA
    ``rank`` names: ``("own",)``, ``("and", mask)`` (the own rank with bits cleared: a
    pair's leader), or ``("reg", register, instruction index)`` (``mapa``'s operand)."""

    const: Fraction
    terms: tuple
    rank: tuple = ("own",)

    def __add__(self, other: "Sym") -> "Sym":
        merged = dict(self.terms)
        for name, c in other.terms:
            merged[name] = merged.get(name, 0) + c
        rank = self.rank if self.rank != ("own",) else other.rank
        return Sym(self.const + other.const,
                   tuple(sorted((n, c) for n, c in merged.items() if c)), rank)

    def scale(self, k) -> "Sym":
        return Sym(self.const * k, tuple((n, c * k) for n, c in self.terms if c * k),
                   self.rank)

    def registers(self) -> tuple:
        return tuple((n, c) for n, c in self.terms if n.startswith("%"))

    def symbols(self) -> tuple:
        return tuple((n, c) for n, c in self.terms if not n.startswith("%"))

    @property
    def place(self) -> tuple:
        """The address without its CTA: what names a barrier within every CTA."""
        return (self.const, self.terms)


def const(v) -> Sym:
    return Sym(Fraction(v), ())


def leaf(name: str) -> Sym:
    return Sym(Fraction(0), ((name, Fraction(1)),))


class Addresses:
    """:meth:`of` over one kernel, memoised; ``align`` is its alignment dataflow."""

    def __init__(self, kernel: Kernel, align: dict):
        self.k, self.align = kernel, align
        self._memo = {}

    def operand(self, arg: str) -> Sym:
        """An address operand: ``[%r5+16]``, ``[sym]``, ``%r5``, an immediate."""
        text = arg.strip().strip("[]").strip()
        m = re.fullmatch(r"([%\w$.]+)\s*(?:\+\s*(-?\w+))?", text)
        if m is None:
            return leaf(text)
        base = self.value(m.group(1))
        off = imm(m.group(2)) if m.group(2) else 0
        return base + const(off or 0)

    def value(self, text: str) -> Sym:
        v = imm(text)
        if v is not None:
            return const(v)
        if not text.startswith("%"):
            return leaf(text)  # a shared symbol or a parameter
        if text not in self._memo:
            self._memo[text] = leaf(text)  # a cycle reads as opaque
            self._memo[text] = self._of(text)
        return self._memo[text]

    of = value

    def _of(self, reg: str) -> Sym:
        defs = self.k.writes.get(reg, [])
        if len(defs) != 1:
            return leaf(reg)
        ins = defs[0]
        if ins.args[0].startswith("{"):
            return self._half(reg, ins)
        op, a = ins.op, ins.args
        name = op.split(".")[0]
        if name in ("mov", "cvt", "cvta") and len(a) == 2:
            pair = re.fullmatch(r"\{\s*(%\w+)\s*,\s*(%\w+)\s*\}", a[1].strip())
            if pair:  # {lo, hi} packed
                return self.value(pair.group(1)) + self.value(pair.group(2)).scale(1 << 32)
            return self.operand(a[1])
        if name == "shfl" and ".idx" in op and len(a) >= 2:
            return self.value(a[1].strip())  # a broadcast of one lane's value
        if name in ("add", "sub") and len(a) == 3:
            x, y = self.value(a[1].strip()), self.value(a[2].strip())
            return x + y.scale(-1) if name == "sub" else x + y
        if name == "shl" and len(a) == 3 and imm(a[2]) is not None:
            return self.value(a[1].strip()).scale(1 << imm(a[2]))
        if name == "mul" and len(a) == 3 and (".lo" in op or ".wide" in op):
            for x, y in ((a[1], a[2]), (a[2], a[1])):
                if imm(y) is not None:
                    return self.value(x.strip()).scale(imm(y))
        if name == "mad" and len(a) == 4 and (".lo" in op or ".wide" in op):
            for x, y in ((a[1], a[2]), (a[2], a[1])):
                if imm(y) is not None:
                    return self.value(x.strip()).scale(imm(y)) + self.value(a[3].strip())
        if name == "shr" and len(a) == 3 and imm(a[2]) is not None:
            return self._shifted_down(reg, a[1].strip(), imm(a[2]))
        if name == "and" and len(a) == 3:
            return self._masked(reg, a)
        if name == "or" and len(a) == 3:
            for x, y in ((a[1], a[2]), (a[2], a[1])):
                v = imm(y)
                if v is None or v < 0:
                    continue
                top = self.upper(x.strip())
                if self.align.get(x.strip(), 0) >= v.bit_length() or \
                        top is not None and top.bit_length() <= _tz(v):
                    return self.value(x.strip()) + const(v)  # no bit in common: a sum
        if name == "mapa" and len(a) == 3:
            base = self.value(a[1].strip())
            return Sym(base.const, base.terms, ("reg", a[2].strip(), ins.index))
        return leaf(reg)

    def upper(self, reg: str):
        """A bound on an unsigned register set by ``and`` with a constant (through moves
        and conversions), else None."""
        for _ in range(8):
            defs = self.k.writes.get(reg, [])
            if len(defs) != 1:
                return None
            d = defs[0]
            if d.op.startswith(("mov", "cvt")) and len(d.args) == 2:
                reg = d.args[1].strip()
                continue
            if d.op.startswith("and") and len(d.args) == 3:
                bounds = [imm(x) for x in d.args[1:] if imm(x) is not None and imm(x) >= 0]
                return min(bounds) if bounds else None
            return None
        return None

    def _shifted_down(self, reg: str, x: str, s: int) -> Sym:
        """``x >> s`` where every part of ``x`` is a multiple of ``2**s`` (a shared
        symbol by its declared alignment)."""
        base = self.value(x)
        for name, coef in base.terms:
            if name.startswith("%"):
                if coef.denominator != 1 or coef % (1 << s):
                    return leaf(reg)
            elif self.k.shared_align.get(name, 1) % (1 << s):
                return leaf(reg)
        if base.const.denominator != 1 or base.const % (1 << s):
            return leaf(reg)
        return Sym(base.const / (1 << s), tuple((n, c / (1 << s)) for n, c in base.terms),
                   base.rank)

    def _half(self, reg: str, ins) -> Sym:
        """One half of ``mov.b64 {lo, hi}, x`` where ``x = small | C`` (``small`` below
        2^32 by its mask): ``lo = small + (C mod 2^32)``, ``hi = C >> 32``.  A wgmma
        descriptor's fields are split so."""
        parts = [p.strip() for p in ins.args[0].strip("{}").split(",")]
        if not ins.op.startswith("mov.b64") or len(parts) != 2 or len(ins.args) != 2:
            return leaf(reg)
        src = ins.args[1].strip()
        defs = self.k.writes.get(src, [])
        if len(defs) != 1 or not defs[0].op.startswith("or") or len(defs[0].args) != 3:
            return leaf(reg)
        for x, y in ((defs[0].args[1], defs[0].args[2]), (defs[0].args[2], defs[0].args[1])):
            c, top = imm(y), self.upper(x.strip())
            if c is None or c < 0 or top is None or top + (c & 0xFFFFFFFF) >= 1 << 32:
                continue
            if parts.index(reg) == 0:
                return self.value(x.strip()) + const(c & 0xFFFFFFFF)
            return const(c >> 32)
        return leaf(reg)

    def _masked(self, reg: str, a: list) -> Sym:
        """``and`` with a mask that keeps every offset bit not known to be zero: the same
        address, in the CTA whose rank bits the mask keeps."""
        for x, y in ((a[1], a[2]), (a[2], a[1])):
            m = imm(y)
            if m is None:
                continue
            m &= 0xFFFFFFFF
            known_zero = (1 << min(self.align.get(x.strip(), 0), SHARED_BITS)) - 1
            if (m | known_zero) & DESC_FIELD == DESC_FIELD and m <= DESC_FIELD:
                return self.value(x.strip())  # a descriptor's 14-bit address field
            if (m | known_zero) & ((1 << SHARED_BITS) - 1) != (1 << SHARED_BITS) - 1:
                continue
            base = self.value(x.strip())
            keep = m >> SHARED_BITS
            return base if keep == 0xFF else Sym(base.const, base.terms, ("and", keep))
        return leaf(reg)


@dataclasses.dataclass
class BarrierArray:
    """Consecutive mbarriers initialised together (one per stage of a pipeline):
    ``symbols`` + ``start`` + 8 * stage, ``count`` each (None: not a constant)."""

    symbols: tuple
    start: int
    size: int
    count: int | None
    inits: list

    def holds(self, s: Sym) -> bool:
        """Whether an address names one of these barriers (any stage)."""
        if s.symbols() != self.symbols:
            return False
        off = s.const
        return off.denominator == 1 and self.start <= off < self.start + 8 * self.size \
            and (off - self.start) % 8 == 0 \
            and all(c.denominator == 1 and c % 8 == 0 for _, c in s.registers())

    def __str__(self) -> str:
        return (f"the mbarrier array at +{self.start} ({self.size} barriers, PTX line "
                f"{self.inits[0].line})")


def barrier_arrays(kernel: Kernel, addrs: Addresses, constant) -> tuple:
    """``(arrays, unplaced)``: the :class:`BarrierArray` s of a kernel's ``mbarrier.init``
    instructions (a run of inits in one block with one count operand, 8 bytes apart),
    and the inits whose address is not a shared symbol plus a constant."""
    arrays, unplaced = [], []
    for ins in kernel.instrs:
        if not ins.op.startswith("mbarrier.init") or len(ins.args) < 2:
            continue
        s = addrs.operand(ins.args[0])
        if s.registers() or s.const.denominator != 1:
            unplaced.append(ins)
            continue
        last = arrays[-1] if arrays else None
        off = int(s.const)
        if last is not None and last.symbols == s.symbols() and last.inits[-1].block == \
                ins.block and last.inits[-1].args[1] == ins.args[1] and \
                off == last.start + 8 * last.size:
            last.size += 1
            last.inits.append(ins)
            continue
        arrays.append(BarrierArray(s.symbols(), off, 1, constant(ins.args[1]), [ins]))
    return arrays, unplaced


# ------------------------------------------------------------------ parameters
_MEMREF = re.compile(r'!cute\.memref<(\w+), gmem, (?:align<(\d+)>, )?"(.*)">')


def _dynamic(leaf_text: str):
    """``(bytes, divisibility)`` of one printed dynamic shape or stride value, or None
    for a static one: ``?`` (i32), ``?{i64 div=8}``, ``?{div=4}``."""
    if not leaf_text.startswith("?"):
        return None
    m = re.fullmatch(r"\?(?:\{(i\d+)?\s*(?:div=(\d+))?\})?", leaf_text)
    if m is None:
        raise ValueError(f"unreadable dynamic value {leaf_text!r}")
    return (8 if m.group(1) == "i64" else 4), int(m.group(2) or 1)


def _memref_fields(type_text: str):
    """``(size, [(offset, alignment bits)])`` of the parameter a printed ``!cute.memref``
    becomes: its address, then its dynamic shape values, then its dynamic strides, each
    at its natural alignment, the whole rounded to 8 bytes."""
    from .trace import leaves

    m = _MEMREF.fullmatch(type_text)
    if m is None:
        return None
    align = int(m.group(2) or 1)
    shape, stride = m.group(3).split(":")
    fields, offset = [(0, _bits(align))], 8
    for text in (shape, stride):
        for value in leaves(text).values():
            dyn = _dynamic(value)
            if dyn is None:
                continue
            size, div = dyn
            offset = -(-offset // size) * size
            fields.append((offset, _bits(div)))
            offset += size
    return -(-offset // 8) * 8, fields


def _tz(v: int) -> int:
    return (v & -v).bit_length() - 1 if v else 64


def _bits(n: int) -> int:
    return (n & -n).bit_length() - 1 if n else 0


def param_alignment(kernel: Kernel, operands) -> dict:
    """``{(parameter, byte offset): bits}`` promised by the launch's tensors: each
    ``!cute.memref`` operand, in order, is the next ``.align 8`` parameter of its size.
    Empty when the operand types are not known or do not line up with the parameters."""
    if not operands:
        return {}
    found, params = {}, list(kernel.params)
    i = 0
    for text in operands:
        layout = _memref_fields(text)
        if layout is None:
            continue
        size, fields = layout
        while i < len(params) and not (params[i][1] == 8 and params[i][2] == size):
            i += 1
        if i == len(params):
            return {}
        for off, bits in fields:
            found[params[i][0], off] = bits
        i += 1
    return found
