"""One build under the pre-flight: its PTX read once, the analyses the rules share
(alignment, symbolic addresses, lanes, uniformity), built when a rule first asks, and
the violations found (:mod:`.preflight`)."""

import dataclasses
import re

from .addr import Addresses, barrier_arrays, param_alignment
from .ptx import INF, Kernel, imm
from .trace import BuildFacts

_TMA = re.compile(r"^cp(\.reduce)?\.async\.bulk\.tensor\.(\d)d\.")
_CLUSTER_USE = re.compile(r"shared::cluster|multicast::cluster|cta_group::2|%cluster_|"
                          r"barrier\.cluster|mapa\.")


@dataclasses.dataclass(frozen=True)
class Violation:
    """One broken rule: the build, the rule's name (:data:`.preflight.RULES`), the
    PTX line of the instruction (None for a fact of the build as a whole), where, why."""

    build: str
    rule: str
    where: str
    why: str
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.build}: [{self.rule}] {self.why}\n    at {self.where}"


def where(ins) -> str:
    return f"PTX line {ins.line}: {ins.text[:160]}"


class Preflight:
    """The analyses of one build, shared by the rule modules."""

    def __init__(self, build: str, ptx: str, facts: BuildFacts):
        self.build, self.facts = build, facts
        self.k = Kernel(ptx)
        self.params = param_alignment(self.k, getattr(facts, "operands", None))
        self.align = self.k.alignment(self.params)
        self.addrs = Addresses(self.k, self.align)
        self.found: list = []
        self._cache = {}

    # ------------------------------------------------------------- reporting
    def fail(self, rule: str, at, why: str) -> None:
        """``at``: the instruction, or a description of the build's fact."""
        if hasattr(at, "line"):
            self.found.append(Violation(self.build, rule, where(at), why, at.line))
        else:
            self.found.append(Violation(self.build, rule, str(at), why))

    # ------------------------------------------------------------- analyses
    def _once(self, name, make):
        if name not in self._cache:
            self._cache[name] = make()
        return self._cache[name]

    @property
    def cluster(self) -> tuple | None:
        """The launch's cluster shape (None: not recorded)."""
        c = getattr(self.facts, "cluster", None)
        return tuple(c) if c else None

    @property
    def cluster_size(self) -> int:
        n = 1
        for c in self.cluster or (1,):
            n *= c
        return n

    def uses_clusters(self) -> list:
        """The instructions that reach other CTAs of a cluster (or read its shape)."""
        return [ins for ins in self.k.instrs
                if _CLUSTER_USE.search(ins.op) or any("%cluster_" in a for a in ins.args)]

    @property
    def lanes(self):
        from .lanes import Lanes

        return self._once("lanes", lambda: Lanes(self.k, self.cluster))

    @property
    def races(self):
        """Which loads race with a write (:class:`~.race.Races`)."""
        from .race import Races

        return self._once("races", lambda: Races(self))

    @property
    def flow(self):
        """How uniform each value is, raced loads per-thread (:mod:`.uniform`)."""
        from .uniform import UniformityFlow

        return self._once("flow", lambda: UniformityFlow(self.k, self.races).run())

    @property
    def trusting_flow(self):
        """:attr:`flow` with every load from a uniform address taken as uniform: what
        tells a raced load's fault from any other (``raced-uniform``)."""
        from .uniform import UniformityFlow

        return self._once("trusting_flow", lambda: UniformityFlow(self.k).run())

    @property
    def warps(self) -> dict:
        """``{block: frozenset of warps that may run it}``."""
        from .warps import warp_sets

        return self._once("warps", lambda: warp_sets(self.k))

    @property
    def arrays(self) -> list:
        return self._once("arrays", lambda: barrier_arrays(self.k, self.addrs,
                                                           self.constant))[0]

    @property
    def unplaced_inits(self) -> list:
        return barrier_arrays(self.k, self.addrs, self.constant)[1]

    def array_of(self, sym):
        return next((a for a in self.arrays if a.holds(sym)), None)

    # ------------------------------------------------------------- operands
    def constant(self, arg: str):
        """An operand's value if it is an immediate or a register set once, unguarded,
        to one (None otherwise)."""
        v = imm(arg)
        if v is not None:
            return v
        defs = self.k.defs_of(arg.strip())
        if len(defs) == 1 and defs[0].op.startswith("mov") and not defs[0].guard:
            return imm(defs[0].args[1])
        return None

    def aligned_to(self, arg: str) -> int:
        """The proven power of two of an operand (a register, an immediate, ``reg+off``)."""
        m = re.fullmatch(r"\s*\[?\s*([%\w$]+)\s*(?:\+\s*(-?\d+))?\s*\]?\s*", arg)
        if m is None:
            return 0
        base, off = m.group(1), int(m.group(2) or 0)
        v = imm(base)
        if v is not None:
            return _tz(v + off)
        if base.startswith("%"):
            k = self.align.get(base, 0)
        else:
            k = _tz(self.k.shared_align.get(base, 1))
        return min(k, _tz(off))

    # ------------------------------------------------------------- TMA
    def tma_sites(self):
        for ins in self.k.instrs:
            m = _TMA.match(ins.op)
            if m:
                yield ins, int(m.group(2))

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


def _tz(value: int) -> int:
    return INF if value == 0 else min((value & -value).bit_length() - 1, INF)
