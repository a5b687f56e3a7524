"""``wgmma-order`` (:mod:`.preflight`): a ``wgmma.mma_async``'s registers are the
asynchronous MMA's until a ``wgmma.wait_group`` retires its group (sm_90a).

PTX ISA, wgmma.mma_async and wgmma.wait_group: "Accessing the accumulator register or
the input register containing the fragments of matrix A of a wgmma.mma_async
instruction without first performing a wgmma.wait_group instruction that waits on a
wgmma-group including that wgmma.mma_async instruction is undefined behavior";
``wgmma.commit_group`` closes the MMAs issued since the last one into a group (an empty
group when there are none), and ``wgmma.wait_group N`` waits until at most the ``N``
newest groups are pending (MMAs not yet committed are in no group and stay pending).
And wgmma.fence: registers an earlier non-wgmma instruction wrote (an accumulator
zeroed, an A fragment loaded) may be read by a ``wgmma.mma_async`` only after a
``wgmma.fence``.  Accesses by other ``wgmma.mma_async`` instructions (the same
accumulator, MMA after MMA) are ordered by the hardware and not counted.

So, on every path (a forward dataflow over the CFG, the pending groups merged from the
newest back): an instruction other than ``wgmma.mma_async`` that reads or writes a
register of a pending or uncommitted MMA breaks the rule (the accumulators read too
early: wrong results), and so does an MMA whose registers were written since the last
``wgmma.fence``.
"""

import re

from .ptx import REG

_MMA = "wgmma.mma_async"
MAX_GROUPS = 16   # deeper pending lists keep their oldest groups merged (more stays pending)


def _mma_registers(ins) -> frozenset:
    """The accumulator registers of an MMA and, register-sourced, its A fragment's."""
    regs = set(REG.findall(ins.args[0])) if ins.args else set()
    if len(ins.args) > 1 and ins.args[1].startswith("{"):
        regs |= set(REG.findall(ins.args[1]))
    return frozenset(regs)


def check_wgmma_order(pf) -> None:
    k = pf.k
    mmas = {ins.index: _mma_registers(ins) for ins in k.instrs if ins.op.startswith(_MMA)}
    if not mmas:
        return
    operands = frozenset().union(*mmas.values())
    found = {}  # access -> the MMAs whose registers it touches too early
    start, work = {0: ((), frozenset())}, [0]
    while work:
        b = work.pop()
        pending, open_ = start[b]
        for i in k.blocks[b]:
            ins = k.instrs[i]
            if i in mmas:
                open_ = open_ | {(r, i) for r in mmas[i]}
                continue
            if ins.op.startswith("wgmma.commit_group"):
                pending, open_ = _capped(pending + (open_,)), frozenset()
            elif ins.op.startswith("wgmma.wait_group"):
                keep = int(ins.args[0])
                pending = pending[len(pending) - keep:] if keep else ()
            touched = (set(ins.uses) | set(ins.defs)) & operands
            if touched:
                early = {m for r, m in open_.union(*pending) if r in touched}
                if early:
                    found.setdefault(i, set()).update(early)
        for s in k.succ[b]:
            if s == k.exit:
                continue
            old = start.get(s)
            new = (pending, open_) if old is None else _merge(old, (pending, open_))
            if new != old:
                start[s] = new
                work.append(s)
    _report(pf, found)


def _capped(groups: tuple) -> tuple:
    while len(groups) > MAX_GROUPS:
        groups = (groups[0] | groups[1],) + groups[2:]
    return groups


def _merge(a, b):
    """Two paths' states: pending groups aligned at the newest (a group pending on either
    path is pending), the uncommitted MMAs' registers united."""
    pa, pb = a[0], b[0]
    n = max(len(pa), len(pb))
    pa, pb = (frozenset(),) * (n - len(pa)) + pa, (frozenset(),) * (n - len(pb)) + pb
    return tuple(x | y for x, y in zip(pa, pb)), a[1] | b[1]


def _report(pf, found) -> None:
    """One violation per access that is the first to touch some MMA's registers early:
    the first after that MMA in the text, or, reached only around a loop, the first."""
    by_mma = {}
    for i, mmas in found.items():
        for mma in mmas:
            by_mma.setdefault(mma, []).append(i)
    first = {}
    for mma, accesses in by_mma.items():
        after = [i for i in accesses if i > mma]
        first.setdefault(min(after or accesses), []).append(mma)
    for i in sorted(first):
        ins, mma = pf.k.instrs[i], pf.k.instrs[min(first[i])]
        regs = sorted((set(ins.uses) | set(ins.defs)) & _mma_registers(mma))
        pf.fail("wgmma-order", ins, f"touches {', '.join(regs[:3])}"
                                    f"{' ...' if len(regs) > 3 else ''}, registers of the "
                                    f"wgmma.mma_async at PTX line {mma.line}, before a "
                                    f"wgmma.wait_group retires its group")
