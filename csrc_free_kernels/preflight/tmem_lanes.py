"""``tcgen05-lanes`` (:mod:`.preflight`): which tensor-memory lanes a warp's ``tcgen05.ld``
and ``tcgen05.st`` may touch (sm_100a).

PTX ISA, tcgen05 "Access restrictions": the Tensor Memory of a CTA is split into four
chunks of 32 lanes, and warp ``w`` of a warpgroup (``w = warp index % 4``) reaches only
lanes ``32 w .. 32 w + 31`` (every column).  tcgen05.ld/st: all threads of the warp give
the same ``taddr``, the base of the collective access; a ``taddr`` holds the lane in bits
31-16 and the column in bits 15-0 ("Tensor Memory Addressing").  A ``.32x32b`` access
covers 32 lanes from its base, the ``.16x*`` shapes 16 ("Data Movement Shape").  A lane
outside the warp's chunk is undefined behaviour: wrong data or a fault.

The address is read symbolically (:mod:`.addr`): the tensor-memory base loaded from the
shared-memory slot a ``tcgen05.alloc`` wrote (lane 0, a column below 512: the
allocation spans every lane), plus terms known per thread (from ``%tid.x``,
:class:`~.uniform.ThreadValues`) and terms known by range (a stage counter, :mod:`.ranges`),
which must stay inside the column field.  Anything else is reported as not known.
"""

import re

from .ranges import interval

LANE_SHIFT = 16                 # taddr: the lane above bit 16, the column below
COLUMN_FIELD = 1 << LANE_SHIFT
TMEM_COLUMNS = 512
CHUNK_LANES = 32                # the lanes one warp of a warpgroup reaches
WARPS_PER_GROUP = 4
_ROWS = {"32x32b": 32, "16x64b": 16, "16x128b": 16, "16x256b": 16, "16x32bx2": 16}
_SHAPE = re.compile(r"\.(32x32b|16x64b|16x128b|16x256b|16x32bx2)\.")


def check_lanes(pf) -> None:
    sites = [ins for ins in pf.k.instrs if ins.op.startswith(("tcgen05.ld", "tcgen05.st"))]
    if not sites:
        return
    slots = {pf.addrs.operand(ins.args[0]).place for ins in pf.k.instrs
             if ins.op.startswith("tcgen05.alloc")}
    for ins in sites:
        shape = _SHAPE.search(ins.op)
        if shape is None:
            pf.fail("tcgen05-lanes", ins, "a tcgen05.ld/st shape this rule does not know")
            continue
        operand = next(a for a in ins.args if a.startswith("["))
        split = _split(pf, pf.addrs.operand(operand), ins, slots)
        if isinstance(split, str):
            pf.fail("tcgen05-lanes", ins, f"the lane of taddr {operand} is not known: {split}")
            continue
        _check_warps(pf, ins, _ROWS[shape.group(1)], *split)


def _is_base(pf, reg: str, slots: set) -> bool:
    """Whether ``reg`` is the tensor-memory base: a load of an allocation's slot."""
    defs = pf.k.writes.get(reg, [])
    return len(defs) == 1 and defs[0].op.startswith("ld.shared") and \
        pf.addrs.operand(defs[0].args[1]).place in slots


def _split(pf, sym, ins, slots):
    """``(per-lane offsets, (lo, hi) of the ranged terms)`` of a taddr, or why not."""
    if sym.symbols() or sym.const.denominator != 1:
        return "it is not a tensor-memory address"
    bases, lo, hi = 0, 0, 0
    offsets = [int(sym.const)] * pf.lanes.values.n
    for name, coef in sym.registers():
        if coef.denominator != 1:
            return f"{name} enters it scaled by {coef}"
        coef = int(coef)
        if _is_base(pf, name, slots):
            bases += coef
            continue
        per_lane = pf.lanes.values.at(name, ins)
        if per_lane is not None:
            offsets = [o + coef * v for o, v in zip(offsets, per_lane)]
            continue
        rng = interval(pf, name, ins)
        if rng is None:
            return f"{name} is neither the allocation's base, known per thread, nor bounded"
        lo, hi = lo + min(coef * rng[0], coef * rng[1]), hi + max(coef * rng[0], coef * rng[1])
    if bases != 1:
        return f"it holds the allocation's base {bases} times, not once"
    return offsets, (lo, hi)


def _check_warps(pf, ins, rows, offsets, ranged) -> None:
    lo, hi = ranged
    per_warp = {}
    for lane in pf.lanes.at(ins):
        value = offsets[lane] % (1 << 32)
        column = value % COLUMN_FIELD
        if column + lo < 0 or column + hi + TMEM_COLUMNS > COLUMN_FIELD:
            pf.fail("tcgen05-lanes", ins, f"the column part of taddr ({column} + [{lo}, {hi}] "
                                          f"+ the base's) may carry into its lane field")
            return
        warp = lane // 32
        per_warp.setdefault(warp, set()).add(value >> LANE_SHIFT)
    for warp, fields in sorted(per_warp.items()):
        in_cta = warp % (pf.lanes.threads // 32)
        if len(fields) > 1:
            pf.fail("tcgen05-lanes", ins, f"the threads of warp {in_cta} give taddr lanes "
                                          f"{sorted(fields)}: a warp's threads give one")
            return
        (first,) = fields
        chunk = CHUNK_LANES * (in_cta % WARPS_PER_GROUP)
        if not (chunk <= first and first + rows <= chunk + CHUNK_LANES):
            pf.fail("tcgen05-lanes", ins, f"warp {in_cta} (warp {in_cta % WARPS_PER_GROUP} "
                                          f"of its warpgroup) reaches TMEM lanes {chunk}-"
                                          f"{chunk + CHUNK_LANES - 1}, but its {rows}-lane "
                                          f"access starts at lane {first}")
            return
