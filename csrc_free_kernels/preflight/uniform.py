"""How uniform each PTX register is across a CTA's threads, for the pre-flight's rule that
warpgroup instructions run only under warpgroup-uniform control (:mod:`.preflight`).

Registers computed from ``%tid.x`` and constants alone (the warp index, the warpgroup
index, a role test such as ``warp_idx >= 4``, the compiler's signed-division idioms) are
evaluated exactly, for every thread of the CTA (``.reqntid``), so their level is read
off their values: the same in every thread, in each aligned group of 128 threads, of 32,
or not.  Every other value is CTA-uniform (constants, parameters, ``%ctaid``, loads from
a CTA-uniform address that no other thread writes concurrently: :mod:`.race`),
warp-uniform (a ``shfl.sync.idx`` broadcast, a vote) or per-thread (``elect.sync``,
atomics, an mbarrier's wait result, a raced load), and otherwise takes the least
uniform of its operands as the instruction reads them: a register that several
writes may reach also takes the level of the branches that choose among those writes
(reaching definitions; :meth:`UniformityFlow.use_level`).
"""

import operator

from .ptx import CTA_SPECIAL, REG, CTA, THREAD, WARP, WARPGROUP, Kernel, imm


def granularity(values) -> int:
    """The level of a per-thread vector of values."""
    if len(set(values)) <= 1:
        return CTA
    for size, level in ((128, WARPGROUP), (32, WARP)):
        if all(len(set(values[i:i + size])) == 1 for i in range(0, len(values), size)):
            return level
    return THREAD


def _width(op: str, first: bool = False) -> int:
    """The bit width of an instruction's type (``first``: its first type, a ``cvt``'s
    destination; else its last)."""
    parts = op.split(".")
    for part in (parts if first else reversed(parts)):
        if part[:1] in ("s", "u", "b") and part[1:].isdigit():
            return int(part[1:])
        if part == "pred":
            return 1
    return 32


_COMPARE = {"lt": operator.lt, "lo": operator.lt, "le": operator.le, "ls": operator.le,
            "gt": operator.gt, "hi": operator.gt, "ge": operator.ge, "hs": operator.ge,
            "eq": operator.eq, "ne": operator.ne}


def _signed(v: int, w: int) -> int:
    return v - (1 << w) if v >> (w - 1) & 1 else v


class ThreadValues:
    """The exact per-thread values of the registers computed from ``%tid.x`` and
    constants (every write of the register giving the same values):
    ``{register: tuple over threads}``.

    With ``cluster`` (the launch's cluster shape), over every thread of every CTA of a
    cluster instead (lane ``rank * threads + tid``): ``%cluster_ctarank`` and the
    cluster-relative ``%ctaid.x`` bits (``%ctaid.x & (cluster_x - 1)``: clusters tile
    the grid, CUDA programming guide) are then known too."""

    def __init__(self, kernel: Kernel, cluster: tuple | None = None):
        self.k = kernel
        self.threads = max(kernel.threads, 1)
        self.cluster = tuple(cluster) if cluster else None
        self.ranks = 1
        for c in self.cluster or ():
            self.ranks *= c
        self.n = self.threads * self.ranks
        self.values: dict = {}   # register -> values, the same at every write
        self.by_def: dict = {}   # instruction index -> the values it writes
        self._at = None
        writers = [ins for ins in kernel.instrs if len(ins.defs) == 1 and not ins.guard]
        for _ in range(50):
            changed = False
            for ins in writers:
                if ins.index not in self.by_def:
                    self._at = ins
                    v = self._eval(ins)
                    if v is not None:
                        self.by_def[ins.index], changed = v, True
            self._at = None
            for reg, defs in kernel.writes.items():
                if reg in self.values or not all(d.index in self.by_def for d in defs):
                    continue
                found = {self.by_def[d.index] for d in defs}  # several writes, one value
                if len(found) == 1:
                    self.values[reg], changed = found.pop(), True
            if not changed:
                break

    def at(self, reg: str, ins):
        """``reg``'s values as ``ins`` reads it: its only value, or that of the one
        write that reaches ``ins`` (reaching definitions)."""
        reg = reg.strip()
        if reg in self.values:
            return self.values[reg]
        if ins is None or not reg.startswith("%"):
            return None
        defs = self.k.reaching().get(ins.index, {}).get(reg)
        if defs and len(defs) == 1:
            return self.by_def.get(next(iter(defs)))
        return None

    def operand(self, arg: str, w: int):
        arg = arg.strip()
        if arg == "%tid.x":
            return tuple(i % self.threads for i in range(self.n))
        if arg == "%laneid":
            return tuple(i % self.threads % 32 for i in range(self.n))
        if arg in ("%tid.y", "%tid.z"):
            return (0,) * self.n
        if self.cluster and arg in ("%cluster_ctarank", "%cluster_nctarank"):
            return tuple(i // self.threads if arg == "%cluster_ctarank" else self.ranks
                         for i in range(self.n))
        v = imm(arg)
        if v is not None:
            return (v % (1 << w),) * self.n
        return self.at(arg, self._at)

    def _eval(self, ins):
        op, args = ins.op, ins.args
        parts = op.split(".")
        name, w = parts[0], _width(op)
        mask = (1 << w) - 1 if w > 1 else 1
        signed = any(p.startswith("s") and p[1:].isdigit() for p in parts)
        if name in ("mov", "cvt") and len(args) == 2:
            src = self.operand(args[1], 64)
            if src is None:
                return None
            if name == "cvt":
                src_w, w = _width(op), _width(op, first=True)
                mask = (1 << w) - 1
                src = tuple(v % (1 << src_w) for v in src)
                if parts[-1].startswith("s"):
                    src = tuple(_signed(v, src_w) for v in src)
            return tuple(v & mask for v in src)
        if name == "shfl" and ".idx" in op and len(args) >= 3:
            src, lane = self.operand(args[1], 32), imm(args[2])
            if src is None or lane is None or (len(args) > 4 and imm(args[4]) != -1):
                return None
            return tuple(src[(t // 32) * 32 + lane % 32] for t in range(self.n))
        if name == "not" and len(args) == 2:
            a = self.operand(args[1], w)
            return None if a is None else tuple(~v & mask for v in a)
        if name == "selp" and len(args) == 4:
            a, b, p = (self.operand(args[1], w), self.operand(args[2], w),
                       self.operand(args[3], 1))
            if None in (a, b, p):
                return None
            return tuple(x if c else y for x, y, c in zip(a, b, p))
        if name == "setp" and len(args) == 3:
            a, b = self.operand(args[1], w), self.operand(args[2], w)
            if a is None or b is None:
                return None
            cmp = parts[1]
            if signed:
                a = tuple(_signed(v, w) for v in a)
                b = tuple(_signed(v, w) for v in b)
            test = _COMPARE.get(cmp)
            if test is None:
                return None
            return tuple(int(test(x, y)) for x, y in zip(a, b))
        if len(args) != 3 and not (name == "mad" and len(args) == 4):
            return None
        if name == "and" and self.cluster:
            low = self._cluster_x_bits(args[1], args[2])
            if low is not None:
                return low
        vals = [self.operand(a, w) for a in args[1:]]
        if any(v is None for v in vals):
            return None
        return self._arith(name, op, vals, w, signed, mask)

    def _cluster_x_bits(self, a: str, b: str):
        """``%ctaid.x & m`` with ``m + 1`` a power of two dividing the cluster's x extent:
        the CTA's x position in its cluster, masked."""
        for reg, mask in ((a, b), (b, a)):
            m, src = imm(mask), reg.strip()
            defs = self.k.writes.get(src, [])
            if len(defs) == 1 and defs[0].op.startswith("mov") and len(defs[0].args) == 2:
                src = defs[0].args[1].strip()
            if src == "%ctaid.x" and m is not None and m >= 0 and (m + 1) & m == 0 \
                    and self.cluster[0] % (m + 1) == 0:
                return tuple(i // self.threads % self.cluster[0] & m for i in range(self.n))
        return None

    @staticmethod
    def _arith(name, op, vals, w, signed, mask):
        a, b = vals[0], vals[1]
        s = (lambda v: _signed(v, w)) if signed else (lambda v: v)
        if name == "add":
            return tuple((x + y) & mask for x, y in zip(a, b))
        if name == "sub":
            return tuple((x - y) & mask for x, y in zip(a, b))
        if name == "mul" and ".lo" in op:
            return tuple((x * y) & mask for x, y in zip(a, b))
        if name == "mad" and ".lo" in op:
            return tuple((x * y + z) & mask for x, y, z in zip(a, b, vals[2]))
        if name == "shl":
            return tuple((x << (y & 63)) & mask if y < w else 0 for x, y in zip(a, b))
        if name == "shr":
            return tuple((s(x) >> min(y, 63)) & mask for x, y in zip(a, b))
        if name in ("and", "or", "xor"):
            f = {"and": int.__and__, "or": int.__or__, "xor": int.__xor__}[name]
            return tuple(f(x, y) & mask for x, y in zip(a, b))
        if name in ("min", "max"):
            f = min if name == "min" else max
            return tuple(f(s(x), s(y)) & mask for x, y in zip(a, b))
        if name in ("div", "rem") and all(y for y in b):
            out = []
            for x, y in zip(a, b):
                q = abs(s(x)) // abs(s(y)) * (1 if (s(x) >= 0) == (s(y) >= 0) else -1)
                out.append((q if name == "div" else s(x) - q * s(y)) & mask)
            return tuple(out)
        return None


class UniformityFlow:
    """The least fixed point of the levels of ``kernel``'s writes and branches; a load
    from a uniform address that ``races`` (:class:`~.race.Races`) finds a concurrent
    write for gives a per-thread value (without it, every such load is trusted)."""

    def __init__(self, kernel: Kernel, races=None):
        self.k = kernel
        self.races = races
        self.exact = ThreadValues(kernel)
        self.def_level, self.branch_level = {}, {}

    def use_level(self, ins, reg: str) -> int:
        """The level of ``reg`` as ``ins`` reads it: the least uniform of the writes
        that reach it and, where several may, of the branches that choose among them
        (those deciding whether a write runs but not whether ``ins`` runs)."""
        if reg in self.exact.values:
            return granularity(self.exact.values[reg])
        defs = self.k.reaching()[ins.index].get(reg)
        if not defs:
            return CTA if CTA_SPECIAL.match(reg) else (
                THREAD if reg not in self.k.writes else CTA)
        level = max(self.def_level.get(d, CTA) for d in defs)
        if len(defs) > 1:
            here = self.k.cd.get(ins.block, set())
            for d in defs:
                for b in self.k.cd.get(self.k.instrs[d].block, ()):
                    if b not in here:
                        level = max(level, self.branch_level.get(b, CTA))
        return level

    def operand(self, ins, arg: str) -> int:
        """The level of one operand of ``ins``."""
        arg = arg.strip().lstrip("!")
        if imm(arg) is not None:
            return CTA
        if arg.startswith(("[", "{")):
            return max([self.operand(ins, r) for r in REG.findall(arg)] or [CTA])
        if not arg.startswith("%"):
            return CTA  # a symbol (a parameter, a shared array)
        if arg in self.k.writes:
            return self.use_level(ins, arg)
        if arg.startswith("%tid"):
            return THREAD
        return CTA if CTA_SPECIAL.match(arg) else THREAD

    def evaluate(self, ins) -> int:
        """The level ``ins`` gives its destination."""
        if len(ins.defs) == 1 and ins.defs[0] in self.exact.values:
            return granularity(self.exact.values[ins.defs[0]])
        op, args = ins.op, ins.args
        name = op.split(".")[0]
        srcs = [self.operand(ins, a) for a in args[1:]]
        worst = max(srcs or [CTA])
        guard = self.operand(ins, ins.guard) if ins.guard else CTA
        if name in ("elect", "atom") or op.startswith(
                ("mbarrier.try_wait", "mbarrier.test_wait", "mbarrier.arrive")):
            return THREAD
        if name == "activemask":
            return WARP
        if name == "ld" and ".param" in op:
            return guard
        if name in ("ld", "ldu") and self.races is not None and max(worst, guard) <= WARP \
                and self.races(ins) is not None:
            return THREAD
        if name in ("vote", "redux"):
            return max(min(worst, WARP), guard)
        if name == "shfl":
            src = srcs[0] if srcs else THREAD
            if ".idx" in op and len(srcs) >= 2 and srcs[1] <= WARP:
                return max(min(src, WARP), srcs[1], guard)
            return max(src if src <= WARP else THREAD, guard)
        return max(worst, guard)

    def run(self) -> "UniformityFlow":
        writers = [ins for ins in self.k.instrs if ins.defs]
        for _ in range(500):
            changed = False
            for b in range(len(self.k.blocks)):
                br = self.k.branch(b)
                lvl = self.operand(br, br.guard) if br is not None else CTA
                if lvl > self.branch_level.get(b, CTA):
                    self.branch_level[b], changed = lvl, True
            for ins in writers:
                lvl = self.evaluate(ins)
                if lvl > self.def_level.get(ins.index, CTA):
                    self.def_level[ins.index], changed = lvl, True
            if not changed:
                return self
        raise RuntimeError("the uniformity dataflow did not settle")
