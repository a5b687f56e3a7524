"""Budgets and the facts the other rules stand on (:mod:`.preflight`).  Notes:
``bench/notes/2026-12-06-preflight-rules.md``.

- ``missing-fact``: a fact a rule needs and the build does not give is a violation,
  never a rule skipped: ``.reqntid`` (the CTA's threads: uniformity, lanes, budgets),
  one ``.entry`` (the facts describe one kernel), the cubin's registers and stack frame,
  the cluster shape of a build that uses clusters;
- ``budget``: no local memory (a zero stack frame, no ``.local``); dynamic shared memory
  within 227 KB; the cubin's registers x threads within the SM's 65,536;
- ``setmaxnreg``: values multiples of 8 in [24, 256]; ``.inc`` only to at least and
  ``.dec`` only to at most the warpgroup's current count (PTX ISA, setmaxnreg: otherwise
  undefined); the largest count each warpgroup may reach (the cubin's where it reaches
  none), times 128 threads, summed within the CTA's pool: the registers it was launched
  with (cubin count x threads), not the SM's; ``inc`` blocks until the pool has enough.
"""

from .lanes import dag_order
from .ptx import imm

REGISTER_FILE = 65536            # 32-bit registers per SM (and so per CTA)
MAX_DYNAMIC_SMEM = 232448        # 227 KB: sm_90 and sm_100 with the opt-in attribute


def check_facts(pf) -> None:
    k, facts = pf.k, pf.facts
    if not k.declares_threads:
        pf.fail("missing-fact", k.name, "no .reqntid: the CTA's thread count is not "
                                        "known, so the rules that count threads cannot hold")
    if k.entries != 1:
        pf.fail("missing-fact", k.name, f"{k.entries} .entry kernels in one PTX: the "
                                        f"build's facts describe one")
    if facts.registers is None:
        pf.fail("missing-fact", k.name, "the cubin's register count is not known")
    if facts.frame_bytes is None:
        pf.fail("missing-fact", k.name, "the cubin's stack frame is not known")
    uses = pf.uses_clusters()
    if uses and pf.cluster is None:
        pf.fail("missing-fact", uses[0], "the build uses clusters, but the launch's "
                                         "cluster shape was not recorded")


def check_budget(pf) -> None:
    k, facts = pf.k, pf.facts
    if k.has_local or (facts.frame_bytes or 0) > 0:
        pf.fail("budget", k.name, f"local memory (a stack frame of {facts.frame_bytes} "
                                  f"bytes, or .local)")
    if facts.smem_bytes > MAX_DYNAMIC_SMEM:
        pf.fail("budget", k.name, f"{facts.smem_bytes} bytes of shared memory, over "
                                  f"{MAX_DYNAMIC_SMEM}")
    if facts.registers is not None and facts.registers * k.threads > REGISTER_FILE:
        pf.fail("budget", k.name, f"{facts.registers} registers x {k.threads} threads > "
                                  f"{REGISTER_FILE}")


def check_setmaxnreg(pf) -> None:
    k, regs = pf.k, pf.facts.registers
    sites = [ins for ins in k.instrs if ins.op.startswith("setmaxnreg")]
    good = []
    for ins in sites:
        n = imm(ins.args[0]) if ins.args else None
        if n is None or n % 8 or not 24 <= n <= 256:
            pf.fail("setmaxnreg", ins, f"setmaxnreg {ins.args} is not a multiple of 8 in "
                                       f"[24, 256]")
        else:
            good.append((ins, n))
    if not good or regs is None:
        return
    groups = range(-(-k.threads // 128))
    reached = {wg: set() for wg in groups}
    for ins, n in good:
        for w in pf.warps.get(ins.block, ()):
            reached[w // 4].add(n)
    largest = {wg: max(ns) if ns else regs for wg, ns in reached.items()}
    pool = regs * k.threads
    total = sum(largest.values()) * 128
    if total > pool:
        pf.fail("setmaxnreg", k.name, f"the warpgroups' largest counts {largest} x 128 "
                                      f"threads = {total} > the CTA's pool of {pool} "
                                      f"({regs} registers x {k.threads} threads): an inc "
                                      f"waits for registers that never come")
    _check_direction(pf, dict((ins.index, n) for ins, n in good), regs)


def _check_direction(pf, value: dict, regs: int) -> None:
    """Per warpgroup, the counts it may hold when it reaches each ``setmaxnreg``."""
    k = pf.k
    order, back = dag_order(k)
    flagged = set()
    for wg in range(-(-k.threads // 128)):
        mine = {b for b, ws in pf.warps.items() if any(w // 4 == wg for w in ws)}
        if not mine & {k.instrs[i].block for i in value}:
            continue
        held = {0: {regs}}
        changed = True
        while changed:  # a fixed point: loops carry a count around
            changed = False
            for b in order:
                if b not in held or b not in mine or b == k.exit:
                    continue
                now = set(held[b])
                for i in k.blocks[b]:
                    if i in value:
                        ins, n = k.instrs[i], value[i]
                        bad = sorted(c for c in now if (n < c if ".inc" in ins.op else n > c))
                        if bad and i not in flagged:
                            flagged.add(i)
                            verb = "inc" if ".inc" in ins.op else "dec"
                            pf.fail("setmaxnreg", ins, f"setmaxnreg.{verb} {n} while the "
                                                       f"warpgroup may hold {bad} registers")
                        now = {n}
                for s in k.succ[b]:
                    if s in mine and not now <= held.get(s, set()):
                        held[s] = held.get(s, set()) | now
                        changed = True
