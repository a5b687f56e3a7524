"""A small reader of one kernel's PTX for the pre-flight (:mod:`.preflight`).

It parses an ``.entry`` into instructions and basic blocks, builds the control-flow graph
and its control dependence (which branches decide whether a block runs), and runs two
flow-insensitive dataflows over the virtual registers to a fixed point:

- :meth:`Kernel.alignment`: the power of two every value of a register is a multiple of
  (constants, ``shl``, ``mul``/``mad`` by constants, ``and`` with a mask, sums; anything
  else is "not known to be aligned");
- how far a register's value is the same across threads (the CTA, each warpgroup,
  each warp or no further) is :mod:`.uniform`'s, over this reader.

Inline-asm scopes (``{ ... }`` inside the body, e.g. the DSL's mbarrier wait loops) are
read as straight-line code: their local labels and branches stay inside them.  The
analyses are conservative: what they cannot follow is reported as unknown, never as safe.
"""

import dataclasses
import functools
import re

INF = 64                         # "a multiple of 2**64": zero, or nothing written
CTA, WARPGROUP, WARP, THREAD = range(4)
LEVEL_NAMES = ("CTA-uniform", "warpgroup-uniform", "warp-uniform", "per-thread")

REG = re.compile(r"%[A-Za-z_$][\w$]*")
CTA_SPECIAL = re.compile(r"%(ctaid|nctaid|ntid|cluster_\w+|clusterid|nclusterid|smid|nsmid|"
                          r"gridid|is_explicit_cluster|dynamic_smem_size|total_smem_size)"
                          r"(\.[xyzw])?$")
_NO_DEF = ("st.", "stmatrix", "cp.", "red.", "bra", "ret", "exit", "bar.", "barrier.",
           "fence", "membar", "griddepcontrol", "prefetch", "setmaxnreg", "wgmma.fence",
           "wgmma.commit_group", "wgmma.wait_group", "mbarrier.init", "mbarrier.inval",
           "mbarrier.expect_tx", "trap", "nanosleep", "discard", "applypriority",
           "tcgen05.wait", "tcgen05.commit", "tcgen05.fence", "tcgen05.cp", "tcgen05.mma",
           "tcgen05.st", "tcgen05.dealloc", "tcgen05.relinquish", "tcgen05.alloc",
           "tcgen05.shift")


@dataclasses.dataclass
class Instr:
    index: int
    line: int           # 1-based line in the PTX text
    guard: str | None   # "%p3" or "!%p3"
    op: str
    args: list
    text: str
    block: int = -1
    in_asm: bool = False

    @functools.cached_property
    def defs(self) -> list:
        """The registers this instruction writes (its first operand, for most)."""
        if not self.args or self.op.startswith(_NO_DEF) or self.op.startswith("@"):
            return []
        first = self.args[0]
        if first.startswith("["):
            return []
        return [r for r in REG.findall(first)]

    @functools.cached_property
    def uses(self) -> list:
        start = 0 if not self.defs else 1
        regs = [r for a in self.args[start:] for r in REG.findall(a)]
        if self.guard:
            regs.append(self.guard.lstrip("!"))
        return regs


def _split_args(text: str) -> list:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def imm(text: str):
    """An integer immediate (decimal or 0x hex, PTX's forms), else None."""
    t = text.strip()
    m = re.fullmatch(r"(-?)(0[xX][0-9a-fA-F]+|\d+)U?", t)
    if m is None:
        return None
    return int(m.group(1) + m.group(2), 0)


def _tz(value: int) -> int:
    return INF if value == 0 else min((value & -value).bit_length() - 1, INF)


class Kernel:
    """One ``.entry`` of a PTX text: its parameters, instructions, blocks and CFG."""

    def __init__(self, ptx: str):
        self.text = ptx
        head = re.search(r"\.entry\s+(\w+)\s*\(", ptx)
        if head is None:
            raise ValueError("no .entry in the PTX")
        self.name = head.group(1)
        close = ptx.index(")", head.end())
        self.params = [(m.group(2), int(m.group(1) or 0), int(m.group(3) or 0))
                       for m in re.finditer(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.\w+\s+(\w+)"
                                            r"(?:\[(\d+)\])?", ptx[head.end():close])]
        self.entries = len(re.findall(r"\.entry\s+\w+\s*\(", ptx))
        body = ptx.index("{", close)
        threads = re.search(r"\.reqntid\s+(\d+)(?:,\s*(\d+))?(?:,\s*(\d+))?", ptx[close:body])
        self.declares_threads = threads is not None
        self.threads = 1
        for g in (threads.groups() if threads else ()):
            self.threads *= int(g or 1)
        self.shared_align = {m.group(2): int(m.group(1)) for m in re.finditer(
            r"\.shared\s+\.align\s+(\d+)\s+\.\w+\s+(\w+)", ptx)}
        self.has_local = bool(re.search(r"\.local\b", ptx))
        self.instrs: list = []
        self.labels: dict = {}
        self._parse(ptx, body)
        self._blocks()
        self._control_dependence()
        self.writes = {}
        for ins in self.instrs:
            for r in ins.defs:
                self.writes.setdefault(r, []).append(ins)

    # ----------------------------------------------------------------- parse
    def _parse(self, ptx: str, body_start: int) -> None:
        depth = 0
        line_no = ptx.count("\n", 0, body_start) + 1
        for raw in ptx[body_start:].splitlines():
            text = raw.split("//")[0].strip()
            line_no += 1
            if not text:
                continue
            if text.startswith("{"):
                depth += 1
                text = text[1:].strip()
            if text.startswith("}"):
                depth -= 1
                if depth <= 0:
                    break
                continue
            if not text:
                continue
            in_asm = depth > 1
            label = re.fullmatch(r"([\w$]+):", text)
            if label:
                if not in_asm:
                    self.labels[label.group(1)] = len(self.instrs)
                continue
            if text.startswith(".") or text.endswith(":"):
                continue  # declarations, directives, inline-asm labels
            m = re.fullmatch(r"(?:@(!?%\w+)\s+)?([\w.:]+)\s*(.*?);?", text)
            if m is None:
                continue
            self.instrs.append(Instr(len(self.instrs), line_no - 1, m.group(1), m.group(2),
                                     _split_args(m.group(3)), text, in_asm=in_asm))

    def _blocks(self) -> None:
        """Basic blocks (lists of instruction indices), ``succ`` and ``pred``."""
        starts = {0, *self.labels.values()}
        for ins in self.instrs:
            if self._is_branch(ins) or ins.op in ("ret", "exit"):
                starts.add(ins.index + 1)
        starts = sorted(s for s in starts if s < len(self.instrs))
        self.blocks = [list(range(s, e)) for s, e in
                       zip(starts, starts[1:] + [len(self.instrs)])]
        for b, idx in enumerate(self.blocks):
            for i in idx:
                self.instrs[i].block = b
        exit_node = len(self.blocks)
        self.succ = {b: set() for b in range(exit_node + 1)}
        for b, idx in enumerate(self.blocks):
            last = self.instrs[idx[-1]]
            falls = b + 1 if b + 1 < len(self.blocks) else exit_node
            if self._is_branch(last):
                self.succ[b].add(self.instrs[self.labels[last.args[0]]].block
                                 if last.args[0] in self.labels else exit_node)
                if last.guard:
                    self.succ[b].add(falls)
            elif last.op in ("ret", "exit"):
                self.succ[b].add(exit_node)
                if last.guard:
                    self.succ[b].add(falls)
            else:
                self.succ[b].add(falls)
        self.exit = exit_node
        self.pred = {b: set() for b in self.succ}
        for b, ss in self.succ.items():
            for s in ss:
                self.pred[s].add(b)

    @staticmethod
    def _is_branch(ins: Instr) -> bool:
        return ins.op.startswith("bra") and not ins.in_asm

    def _control_dependence(self) -> None:
        """``cd[b]``: the blocks whose conditional branch decides, directly or through
        other such branches, whether block ``b`` runs (post-dominator frontiers)."""
        nodes = list(self.succ)
        pdom = {n: set(nodes) for n in nodes}
        pdom[self.exit] = {self.exit}
        changed = True
        while changed:
            changed = False
            for n in nodes:
                if n == self.exit:
                    continue
                succs = [pdom[s] for s in self.succ[n]] or [set()]
                new = {n} | set.intersection(*succs)
                if new != pdom[n]:
                    pdom[n], changed = new, True
        ipdom = {}
        for n in nodes:
            strict = pdom[n] - {n}
            # the closest: the one every other strict post-dominator post-dominates
            ipdom[n] = next((c for c in strict if strict <= pdom[c]), None)
        direct = {n: set() for n in nodes}
        for a in nodes:
            if len(self.succ[a]) < 2:
                continue
            for b in self.succ[a]:
                runner = b
                while runner is not None and runner != ipdom[a]:
                    direct[runner].add(a)
                    runner = ipdom[runner]
        self.cd = {}
        for n in nodes:
            seen, todo = set(), list(direct[n])
            while todo:
                a = todo.pop()
                if a not in seen:
                    seen.add(a)
                    todo.extend(direct[a])
            self.cd[n] = seen

    def reaching(self) -> dict:
        """``{instruction index: {register: frozenset(def indices)}}``: for each
        register an instruction reads, the writes that may reach it (reaching
        definitions over the CFG)."""
        if hasattr(self, "_reaching"):
            return self._reaching
        defs_of = {}
        for ins in self.instrs:
            for r in ins.defs:
                defs_of.setdefault(r, set()).add(ins.index)
        gen, kill = {}, {}
        for b, idx in enumerate(self.blocks):
            g, k = {}, set()
            for i in idx:
                for r in self.instrs[i].defs:
                    g[r] = i
                    k |= defs_of[r]
            gen[b] = set(g.values())
            kill[b] = k - gen[b]
        out = {b: set(gen.get(b, ())) for b in self.succ}
        changed = True
        while changed:
            changed = False
            for b in range(len(self.blocks)):
                inn = set().union(*(out[p] for p in self.pred[b])) if self.pred[b] else set()
                new = gen[b] | (inn - kill[b])
                if new != out[b]:
                    out[b], changed = new, True
        self._reaching = {}
        for b, idx in enumerate(self.blocks):
            live = {}
            for d in set().union(*(out[p] for p in self.pred[b])) if self.pred[b] else ():
                for r in self.instrs[d].defs:
                    live.setdefault(r, set()).add(d)
            for i in idx:
                ins = self.instrs[i]
                self._reaching[i] = {r: frozenset(live.get(r, ())) for r in ins.uses}
                for r in ins.defs:
                    live[r] = {i}
        return self._reaching

    def branch(self, block: int) -> Instr | None:
        """The conditional branch that ends ``block`` (None if it has none)."""
        last = self.instrs[self.blocks[block][-1]] if block < len(self.blocks) else None
        return last if last is not None and last.guard and (
            self._is_branch(last) or last.op in ("ret", "exit")) else None

    def defs_of(self, reg: str) -> list:
        return self.writes.get(reg, [])

    # -------------------------------------------------------------- alignment
    def alignment(self, params: dict | None = None) -> dict:
        """``{register: k}``: every value of the register is a multiple of ``2**k``.

        ``params``: ``{(parameter, byte offset): k}``, what the launch promises of values
        loaded from the kernel's parameters (a tensor's base address, a stride's
        divisibility: :func:`~.addr.param_alignment`); any other load is
        unknown.  A 64-bit value unpacked into halves (``mov.b64 {lo, hi}, x``) gives
        the low half at most 32 bits of its alignment and the high half what is left
        above bit 32; packing takes the halves' least."""
        params = params or {}
        align = {r: INF for r in self.writes}

        def of(arg: str) -> int:
            arg = arg.strip().lstrip("-")
            v = imm(arg)
            if v is not None:
                return _tz(v)
            pair = re.fullmatch(r"\{\s*(%\w+)\s*,\s*(%\w+)\s*\}", arg)
            if pair:  # {lo, hi} packed into 64 bits
                return min(of(pair.group(1)), of(pair.group(2)) + 32, INF)
            base = re.fullmatch(r"(\w+)(?:\+(\d+))?", arg)
            if base and base.group(1) in self.shared_align:
                off = int(base.group(2) or 0)
                return min(_tz(self.shared_align[base.group(1)]), _tz(off))
            return align.get(arg, 0) if arg.startswith("%") else 0

        def step(ins: Instr) -> int:
            op, a = ins.op, ins.args
            name = op.split(".")[0]
            if name == "ld" and ".param" in op and len(a) >= 2:
                m = re.fullmatch(r"\[\s*(\w+)\s*(?:\+\s*(\d+))?\s*\]", a[1])
                return params.get((m.group(1), int(m.group(2) or 0)), 0) if m else 0
            if name in ("mov", "cvt", "cvta", "neg", "abs") and len(a) >= 2:
                return of(a[1])
            if name in ("add", "sub", "min", "max", "or", "xor") and len(a) >= 3:
                return min(of(a[1]), of(a[2]))
            if name == "selp" and len(a) >= 3:
                return min(of(a[1]), of(a[2]))
            if name == "and" and len(a) >= 3:
                return max(of(a[1]), of(a[2]))
            if name == "mul" and (".lo" in op or ".wide" in op) and len(a) >= 3:
                return min(of(a[1]) + of(a[2]), INF)
            if name == "mad" and (".lo" in op or ".wide" in op) and len(a) >= 4:
                return min(of(a[1]) + of(a[2]), of(a[3]), INF)
            if name == "shl" and len(a) >= 3:
                s = imm(a[2])
                return min(of(a[1]) + (s if s is not None else 0), INF)
            if name == "shr" and len(a) >= 3 and imm(a[2]) is not None:
                return max(of(a[1]) - imm(a[2]), 0)
            if name == "mapa" and len(a) >= 2:
                return min(of(a[1]), 24)  # the rank goes above the offset's bits
            if name == "shfl" and len(a) >= 2:
                return of(a[1])  # another lane's value of the same register
            return 0

        def written(ins: Instr, reg: str) -> int:
            """The alignment ``ins`` gives ``reg``: one part of a vector destination
            takes its share of the source's bits (an unpack) or its own element of a
            vector load."""
            dst = ins.args[0] if ins.args else ""
            if not dst.startswith("{"):
                return step(ins)
            parts = [p.strip() for p in dst.strip("{}").split(",")]
            i = parts.index(reg)
            name = ins.op.split(".")[0]
            if name == "ld" and ".param" in ins.op:
                m = re.fullmatch(r"\[\s*(\w+)\s*(?:\+\s*(\d+))?\s*\]", ins.args[1])
                width = max(_bits(ins.op) // 8, 1)
                return params.get((m.group(1), int(m.group(2) or 0) + i * width), 0) if m else 0
            if name == "mov" and len(ins.args) >= 2:
                width = _bits(ins.op) // len(parts)
                k = of(ins.args[1]) - i * width
                return INF if k >= width else max(k, 0)
            return 0

        for _ in range(200):
            changed = False
            for reg, defs in self.writes.items():
                new = min(written(ins, reg) for ins in defs)
                if new < align[reg]:
                    align[reg], changed = new, True
            if not changed:
                return align
        raise RuntimeError("the alignment dataflow did not settle")


def _bits(op: str) -> int:
    """The width of an instruction's type (``mov.b64`` -> 64, ``ld.param.v2.b32`` -> 32)."""
    m = re.search(r"\.[bsuf](\d+)$", op)
    return int(m.group(1)) if m else 32
