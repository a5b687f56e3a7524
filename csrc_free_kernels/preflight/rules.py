"""The pre-flight: the Hopper (and Blackwell) hardware rules a kernel build can break,
checked on its PTX and trace-time facts without a GPU, so that no build meets a GPU
untried.

A broken rule rarely gives a clear error on the device: most give
``cudaErrorIllegalInstruction`` or a hang, sticky for the whole process
(``bench/notes/2026-12-05-fp8-kernel-first-gpu-run.md``).  The rules and their sources:
``bench/notes/2026-12-05-preflight.md``.  Each :class:`Violation` names the build, the rule
and the instruction (its PTX line):

1. ``tma-coordinate``: every ``cp.async.bulk.tensor`` load and store starts its box at a
   global address that is a provable multiple of 16 bytes: its innermost coordinate
   times the element size (:meth:`~.preflight_ptx.Kernel.alignment`; unproven fails);
2. ``tensor-map``: each map's parameters (:class:`~.preflight_trace.TmaMap`): global
   address and strides 16-byte multiples, innermost stride 1, box dims 1..256, inner box
   bytes a multiple of 16 and within the swizzle span, rank 1..5;
3. ``expect-tx``: each ``mbarrier.arrive.expect_tx`` arms a constant equal to the bytes
   that one stage's TMA loads deliver to a CTA (:meth:`Preflight.stage_bytes`);
4. ``budget``: ``setmaxnreg`` values multiples of 8 in [24, 256]; the warpgroups'
   registers times their threads within 65,536; no local memory; dynamic shared memory
   within 227 KB; TMA shared-memory boxes 128-byte aligned (a swizzled box to its
   pattern's repeat) and mbarriers 8-byte aligned;
5. ``warpgroup-uniform``: ``wgmma.*`` and ``setmaxnreg`` (``.aligned`` for a whole
   warpgroup) run only under branches and guards that are warpgroup-uniform
   (:mod:`.preflight_uniform`).
"""

import dataclasses
import re

from .ptx import INF, LEVEL_NAMES, WARPGROUP, Kernel, _imm
from .trace import BuildFacts
from .uniform import UniformityFlow

REGISTER_FILE = 65536            # 32-bit registers per SM (and so per CTA)
MAX_DYNAMIC_SMEM = 232448        # 227 KB: sm_90 and sm_100 with the opt-in attribute
RULES = ("tma-coordinate", "tensor-map", "expect-tx", "budget", "warpgroup-uniform")

_TMA = re.compile(r"^cp(\.reduce)?\.async\.bulk\.tensor\.(\d)d\.")


@dataclasses.dataclass(frozen=True)
class Violation:
    build: str
    rule: str
    where: str
    why: str

    def __str__(self) -> str:
        return f"{self.build}: [{self.rule}] {self.why}\n    at {self.where}"


def _where(ins) -> str:
    return f"PTX line {ins.line}: {ins.text[:160]}"


class Preflight:
    """The rules over one build (:func:`check`)."""

    def __init__(self, build: str, ptx: str, facts: BuildFacts):
        self.build, self.facts = build, facts
        self.k = Kernel(ptx)
        self.align = self.k.alignment()
        self.found: list = []
        self._warps = None

    def fail(self, rule: str, where: str, why: str) -> None:
        self.found.append(Violation(self.build, rule, where, why))

    def aligned_to(self, arg: str) -> int:
        """The proven power of two of an operand (a register, an immediate, ``reg+off``)."""
        m = re.fullmatch(r"\s*\[?\s*([%\w$]+)\s*(?:\+\s*(-?\d+))?\s*\]?\s*", arg)
        if m is None:
            return 0
        base, off = m.group(1), int(m.group(2) or 0)
        v = _imm(base)
        if v is not None:
            return _tz(v + off)
        if base.startswith("%"):
            k = self.align.get(base, 0)
        else:
            k = _tz(self.k.shared_align.get(base, 1))
        return min(k, _tz(off))

    # ------------------------------------------------------------ tensor maps
    def tensor_map(self, ins):
        """The :class:`TmaMap` a TMA instruction's tensor-map operand comes from: a
        ``mov`` of a kernel parameter, through ``cvta.param`` copies."""
        operand = ins.args[1] if ".global.shared" not in ins.op else ins.args[0]
        reg = re.match(r"\[\s*(%\w+)", operand)
        seen = 0
        name = reg.group(1) if reg else None
        while name and name.startswith("%") and seen < 16:
            defs = self.k.defs_of(name)
            if len(defs) != 1 or defs[0].op.split(".")[0] not in ("mov", "cvta"):
                return None
            name, seen = defs[0].args[1].strip(), seen + 1
        maps = [p for p, align, size in self.k.params if size == 128 and align == 64]
        if name not in maps or len(maps) != len(self.facts.map_params):
            return None
        return self.facts.maps[self.facts.map_params[maps.index(name)]]

    def tma_sites(self):
        for ins in self.k.instrs:
            m = _TMA.match(ins.op)
            if m:
                yield ins, int(m.group(2))

    def check_tma(self) -> None:
        for ins, rank in self.tma_sites():
            tmap = self.tensor_map(ins)
            if tmap is None:
                self.fail("tma-coordinate", _where(ins),
                          "its tensor map cannot be tied to a TMA atom of the build")
                continue
            store = ".global.shared" in ins.op
            operand = ins.args[0] if store else ins.args[1]
            coords = re.search(r"\{([^}]*)\}", operand)
            inner = coords.group(1).split(",")[0].strip() if coords else ""
            k = self.aligned_to(inner)
            need = max(16 // tmap.element_bytes, 1)
            if (1 << min(k, 30)) % need:
                self.fail("tma-coordinate", _where(ins),
                          f"the box's innermost coordinate {inner} is not provably a "
                          f"multiple of {need} {tmap.dtype} elements (16 bytes): its start "
                          f"address may be misaligned (proven: a multiple of {1 << min(k, 30)})")
            smem = ins.args[1] if store else ins.args[0]
            swizzle_repeat = 8 << (tmap.swizzle_bits + 4) if tmap.swizzle_bits else 128
            if (1 << min(self.aligned_to(smem), 30)) % swizzle_repeat:
                self.fail("budget", _where(ins),
                          f"the shared-memory box {smem} is not provably "
                          f"{swizzle_repeat}-byte aligned")
            if not store:
                bar = ins.args[2] if len(ins.args) > 2 else ""
                if self.aligned_to(bar) < 3:
                    self.fail("budget", _where(ins), f"the mbarrier {bar} is not provably "
                                                     f"8-byte aligned")

    def check_maps(self) -> None:
        for i, m in enumerate(self.facts.maps):
            where = f"TMA atom {i} ({m.kind}, {m.dtype}, box {m.box})"
            eb = m.element_bytes
            inner = m.box[0] * eb
            problems = []
            if not 1 <= len(m.box) <= 5:
                problems.append(f"rank {len(m.box)} outside 1..5")
            if any(not 1 <= b <= 256 for b in m.box):
                problems.append(f"a box dimension outside 1..256: {m.box}")
            if inner % 16:
                problems.append(f"inner box bytes {inner} not a multiple of 16")
            if m.swizzle_bits and inner > 16 << m.swizzle_bits:
                problems.append(f"inner box bytes {inner} beyond the swizzle span "
                                f"{16 << m.swizzle_bits}")
            if m.align % 16:
                problems.append(f"global address aligned to {m.align} bytes, not 16")
            if m.strides and m.strides[0] != 1:
                problems.append(f"innermost stride {m.strides[0]}, not 1")
            for d, s in enumerate(m.strides[1:], start=1):
                step = s[1] if isinstance(s, tuple) else s
                if (step * eb) % 16 or (not isinstance(s, tuple) and s * eb >= 1 << 40):
                    problems.append(f"stride of dimension {d} ({s} elements) not a "
                                    f"16-byte multiple below 2**40")
            for p in problems:
                self.fail("tensor-map", where, p)

    # -------------------------------------------------------------- expect_tx
    def warps(self) -> dict:
        """``{block: frozenset of warps that may run it}``, from the entry's every warp
        through the branches that test a warp-uniform function of the warp index."""
        if self._warps is not None:
            return self._warps
        from .warps import warp_sets

        self._warps = warp_sets(self.k)
        return self._warps

    def stage_bytes(self):
        """``(bytes, why)``: what one stage's TMA loads deliver to a CTA's full barrier.

        Per warp, the bytes of the load sites it runs on one pass through the CFG with
        its back edges cut (one iteration of each loop): every pass that loads must load
        the same bytes (alternatives, such as a pair's multicast or own copy, are counted
        once), and the warps' bytes add up.  A site's bytes are its atom's ``copy_bits``
        (a multicast atom's counts what every CTA of the group receives), doubled for a
        2-SM pair's loads, which complete on the leader CTA's barrier."""
        warps = self.warps()
        site_bytes = {}
        for ins, _ in self.tma_sites():
            tmap = self.tensor_map(ins)
            if tmap is None or ".global.shared" in ins.op or "complete_tx" not in ins.op:
                continue
            pair = 2 if ".cta_group::2" in ins.op else 1
            site_bytes.setdefault(ins.block, []).append((tmap.box_bytes * pair, ins))
        order, back = _dag_order(self.k)
        total = 0
        for w in sorted(set().union(*warps.values()) if warps else ()):
            totals = {0: {0}}
            for b in order:
                if b not in totals or w not in warps.get(b, ()):
                    continue
                here = sum(n for n, _ in site_bytes.get(b, ()))
                sums = {t + here for t in totals[b]}
                skip = self._not_elected_edge(b)
                for nxt in self.k.succ[b]:
                    if (b, nxt) not in back and nxt != skip:
                        totals.setdefault(nxt, set()).update(sums)
            loads = sorted(totals.get(self.k.exit, {0}) - {0})
            if len(loads) > 1:
                return None, f"warp {w} loads {loads} bytes on different passes"
            total += loads[0] if loads else 0
        return total, ""

    def _not_elected_edge(self, block: int):
        """The successor that a warp's ``elect.sync``-chosen lane never takes from
        ``block`` (the other lanes' way around the one-lane TMA issue), or None."""
        br = self.k.branch(block)
        if br is None:
            return None
        guard, negated = br.guard.lstrip("!"), br.guard.startswith("!")
        for _ in range(4):
            defs = self.k.defs_of(guard)
            if len(defs) != 1:
                return None
            d = defs[0]
            if d.op.startswith("elect.sync"):
                taken_by_elected = not negated
                break
            if d.op.startswith("not.pred") and len(d.args) == 2:
                guard, negated = d.args[1].strip(), not negated
                continue
            return None
        else:
            return None
        target = self.k.instrs[self.k.labels[br.args[0]]].block \
            if br.args and br.args[0] in self.k.labels else self.k.exit
        fall = next((s for s in self.k.succ[block] if s != target), None)
        return fall if taken_by_elected else target

    def check_expect_tx(self) -> None:
        arms = [ins for ins in self.k.instrs
                if ins.op.startswith(("mbarrier.arrive.expect_tx", "mbarrier.expect_tx"))]
        if not arms:
            return
        delivered, why = self.stage_bytes()
        for ins in arms:
            value = self.constant(ins.args[-1])
            if value is None:
                self.fail("expect-tx", _where(ins), f"the armed byte count {ins.args[-1]} "
                                                    f"is not a constant")
            elif delivered is None:
                self.fail("expect-tx", _where(ins), f"arms {value} bytes; {why}")
            elif value != delivered:
                self.fail("expect-tx", _where(ins),
                          f"arms {value} bytes; the stage's TMA loads deliver {delivered}")

    def constant(self, arg: str):
        v = _imm(arg)
        if v is not None:
            return v
        defs = self.k.defs_of(arg.strip())
        if len(defs) == 1 and defs[0].op.startswith("mov") and not defs[0].guard:
            return _imm(defs[0].args[1])
        return None

    # ----------------------------------------------------------------- budget
    def check_budget(self) -> None:
        regs = self.facts.registers
        if self.k.has_local or (self.facts.frame_bytes or 0) > 0:
            self.fail("budget", self.k.name, f"local memory (a stack frame of "
                                             f"{self.facts.frame_bytes} bytes, or .local)")
        if self.facts.smem_bytes > MAX_DYNAMIC_SMEM:
            self.fail("budget", self.k.name, f"{self.facts.smem_bytes} bytes of shared "
                                             f"memory, over {MAX_DYNAMIC_SMEM}")
        if regs is None:
            self.fail("budget", self.k.name, "the cubin's register count is not known")
            return
        per_warpgroup = {wg: regs for wg in range(-(-self.k.threads // 128))}
        for ins in self.k.instrs:
            if not ins.op.startswith("setmaxnreg"):
                continue
            n = _imm(ins.args[0]) if ins.args else None
            if n is None or n % 8 or not 24 <= n <= 256:
                self.fail("budget", _where(ins), f"setmaxnreg {ins.args} is not a multiple "
                                                 f"of 8 in [24, 256]")
                continue
            for w in self.warps().get(ins.block, ()):
                per_warpgroup[w // 4] = n
        total = sum(per_warpgroup.values()) * 128
        if total > REGISTER_FILE:
            self.fail("budget", self.k.name,
                      f"warpgroups' registers x 128 threads = {total} > {REGISTER_FILE} "
                      f"({per_warpgroup})")

    # ------------------------------------------------------------- uniformity
    def check_uniform(self) -> None:
        targets = [ins for ins in self.k.instrs
                   if ins.op.startswith(("wgmma.", "setmaxnreg"))]
        if not targets:
            return
        flow = UniformityFlow(self.k).run()
        for ins in targets:
            worst, why = 0, ""
            if ins.guard:
                worst = flow.operand(ins, ins.guard)
                why = f"its guard {ins.guard}"
            for b in self.k.cd.get(ins.block, ()):
                lvl = flow.branch_level.get(b, 0)
                if lvl > worst:
                    br = self.k.branch(b)
                    worst, why = lvl, f"the branch at PTX line {br.line} ({br.text[:80]})"
            if worst > WARPGROUP:
                self.fail("warpgroup-uniform", _where(ins),
                          f"a warpgroup instruction under {why}, which is only "
                          f"{LEVEL_NAMES[worst]}")

    def run(self) -> list:
        self.check_maps()
        self.check_tma()
        self.check_expect_tx()
        self.check_budget()
        self.check_uniform()
        return self.found


def _dag_order(kernel: Kernel) -> tuple:
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


def _tz(value: int) -> int:
    return INF if value == 0 else min((value & -value).bit_length() - 1, INF)


def check(build: str, ptx: str, facts: BuildFacts) -> list:
    """Every :class:`Violation` of the rules by one build (its PTX and facts)."""
    return Preflight(build, ptx, facts).run()
