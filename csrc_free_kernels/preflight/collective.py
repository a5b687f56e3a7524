"""Collectives, each at its own scope (:mod:`.preflight`): an instruction that every
thread of a warp, a warpgroup or a set of warps must execute together runs only under
control and guards that are uniform at that scope (``.sync.aligned``: PTX ISA, per
instruction; a thread that is left out is undefined behaviour: a hang or an illegal
instruction).  Notes: ``bench/notes/2026-12-06-preflight-rules.md``.

- ``warpgroup-uniform``: ``wgmma.*`` and ``setmaxnreg``;
- ``warp-uniform``: ``elect.sync``, ``shfl.sync``, ``vote.sync``, ``match.sync``,
  ``redux.sync``, ``bar.warp.sync``, ``ldmatrix``, ``stmatrix``, ``movmatrix``,
  ``mma.sync`` and the warp-wide ``tcgen05`` instructions (``alloc``, ``dealloc``,
  ``relinquish_alloc_permit``, ``ld``, ``st``, ``wait``); a member mask is a constant,
  and one other than all 32 lanes names exactly the lanes that run it;
- ``named-barrier``: ``bar``/``barrier`` (CTA scope): a barrier number that is a constant
  in 0..15; a thread count that is a constant multiple of 32, the same at every
  instruction on that barrier, and equal to the threads of one phase (the roles that
  reach it added up, per CTA); whole warps at each; ``bar.arrive`` only on a barrier
  some thread waits on; without a count, CTA-uniform control;
- ``raced-uniform``: any of these whose control is not uniform enough only because it
  depends on a load from a location other threads write concurrently (:mod:`.race`):
  the threads may read different values, whatever the address.
"""

import re

from .ptx import CTA, LEVEL_NAMES, WARP, WARPGROUP
from .race import blame

_WARP_OPS = ("elect.sync", "shfl.sync", "vote.sync", "match.", "redux.sync",
             "bar.warp.sync", "ldmatrix", "stmatrix", "movmatrix", "mma.sync",
             "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.relinquish_alloc_permit",
             "tcgen05.ld", "tcgen05.st", "tcgen05.wait")
_BAR = re.compile(r"^(bar|barrier)(\.cta)?\.(sync|arrive|red)\b")


def worst_control(pf, ins, flow=None) -> tuple:
    """``(level, why, (instruction, registers))``: the least uniform of ``ins``'s guard
    and the branches it is control dependent on (under ``flow``, :attr:`pf.flow` by
    default), and where that predicate is read."""
    flow = flow or pf.flow
    worst, why, at = CTA, "", (ins, ())
    if ins.guard:
        worst = flow.operand(ins, ins.guard)
        why, at = f"its guard {ins.guard}", (ins, (ins.guard.lstrip("!"),))
    for b in pf.k.cd.get(ins.block, ()):
        lvl = flow.branch_level.get(b, CTA)
        if lvl > worst:
            br = pf.k.branch(b)
            worst, why = lvl, f"the branch at PTX line {br.line} ({br.text[:80]})"
            at = (br, (br.guard.lstrip("!"),))
    return worst, why, at


def _uniform_enough(pf, ins, limit: int, rule: str, what: str, tail: str = "") -> bool:
    """Report ``ins`` (``what``: the instruction in words) where its control is less
    uniform than ``limit``: under ``raced-uniform`` where only a raced load makes it so
    (the control is uniform enough with loads trusted), else under ``rule``."""
    worst, why, (at, regs) = worst_control(pf, ins)
    if worst <= limit:
        return True
    if worst_control(pf, ins, pf.trusting_flow)[0] <= limit:
        load = blame(pf, at, regs)
        source = (f"the value loaded at PTX line {load.line}, which the write at PTX line "
                  f"{pf.races(load).line} may change concurrently"
                  if load is not None else "a raced load")
        pf.fail("raced-uniform", ins, f"{what} under {why}, which depends on {source}: "
                                      f"threads may read different values")
    else:
        pf.fail(rule, ins, f"{what} under {why}, which is only {LEVEL_NAMES[worst]}{tail}")
    return False


def check_warpgroup(pf) -> None:
    for ins in pf.k.instrs:
        if ins.op.startswith(("wgmma.", "setmaxnreg")):
            _uniform_enough(pf, ins, WARPGROUP, "warpgroup-uniform",
                            "a warpgroup instruction")


def _mask(ins):
    """A warp collective's member-mask operand (None: it takes none)."""
    op, a = ins.op, ins.args
    if op.startswith("elect.sync"):
        return a[1] if len(a) > 1 else None
    if op.startswith(("shfl.sync", "vote.sync", "match.", "redux.sync")):
        return a[-1]
    if op.startswith("bar.warp.sync"):
        return a[0] if a else None
    return None


def check_warp(pf) -> None:
    for ins in pf.k.instrs:
        if not ins.op.startswith(_WARP_OPS):
            continue
        mask_arg = _mask(ins)
        mask = pf.constant(mask_arg) if mask_arg is not None else -1
        if mask is None:
            pf.fail("warp-uniform", ins, f"the member mask {mask_arg} is not a constant")
            continue
        if mask & 0xFFFFFFFF != 0xFFFFFFFF:
            _check_partial(pf, ins, mask & 0xFFFFFFFF)
            continue
        _uniform_enough(pf, ins, WARP, "warp-uniform", "a warp collective")


def _check_partial(pf, ins, mask: int) -> None:
    """A partial mask: the lanes of each warp that run ``ins`` are exactly the mask's."""
    per_warp = {}
    for lane in pf.lanes.at(ins):
        per_warp.setdefault(lane // 32, 0)
        per_warp[lane // 32] |= 1 << (lane % pf.lanes.threads % 32)
    exact = ins.guard is None or pf.lanes.true_lanes(ins, ins.guard) is not None
    for warp, got in sorted(per_warp.items()):
        if got != mask or not exact:
            pf.fail("warp-uniform", ins, f"member mask {mask:#010x}, but lanes {got:#010x} "
                                         f"of warp {warp % (pf.lanes.threads // 32)} may "
                                         f"run it")
            return


def check_named(pf) -> None:
    sites = {}
    for ins in pf.k.instrs:
        m = _BAR.match(ins.op)
        if m is None:
            continue
        kind = m.group(3)
        args = [a for a in ins.args if not a.startswith(("%p", "!%p"))] \
            if kind != "red" else ins.args[1:-1]
        number = pf.constant(args[0]) if args else None
        if number is None or not 0 <= number <= 15:
            pf.fail("named-barrier", ins, f"barrier number {args[:1]} is not a constant "
                                          f"in 0..15")
            continue
        count = pf.constant(args[1]) if len(args) > 1 else None
        if len(args) > 1 and (count is None or count <= 0 or count % 32):
            pf.fail("named-barrier", ins, f"thread count {args[1]} is not a constant "
                                          f"multiple of 32 (the warp size)")
            continue
        if kind == "arrive" and count is None:
            pf.fail("named-barrier", ins, "bar.arrive without a thread count")
            continue
        if not _uniform_enough(pf, ins, CTA if count is None else WARP, "named-barrier",
                               f"barrier {number}",
                               ": every thread of the CTA must reach it" if count is None
                               else ": whole warps must"):
            continue
        sites.setdefault(number, []).append((ins, kind, count))
    for number, found in sorted(sites.items()):
        _check_count(pf, number, found)


def _check_count(pf, number: int, found: list) -> None:
    counts = {c for _, _, c in found}
    if len(counts) > 1:
        pf.fail("named-barrier", found[0][0], f"barrier {number} is used with thread "
                                              f"counts {sorted(counts, key=str)}")
        return
    (count,) = counts
    if not any(kind != "arrive" for _, kind, _ in found):
        pf.fail("named-barrier", found[0][0], f"barrier {number}: bar.arrive, but no "
                                              f"thread waits on it")
    if count is None:
        return
    roles = {}
    for ins, _, _ in found:
        roles.setdefault(pf.lanes.at(ins), []).append(ins)
    keys = list(roles)
    total = {}
    for i, lanes in enumerate(keys):
        if any(lanes & other for other in keys[i + 1:]):
            pf.fail("named-barrier", roles[lanes][0], f"barrier {number}: reached by "
                                                      f"overlapping but different thread "
                                                      f"sets; its phases cannot be told")
            return
        for r, n in pf.lanes.per_cta(lanes).items():
            total[r] = total.get(r, 0) + n
    for r, n in sorted(total.items()):
        if n != count:
            pf.fail("named-barrier", found[0][0], f"barrier {number} counts {count} "
                                                  f"threads, but {n} reach it per phase"
                                                  + (f" (CTA rank {r})" if r else ""))

