"""The mbarrier protocol, per barrier (:mod:`.preflight`); a broken one hangs (a phase
that never completes) or releases early (wrong data).  PTX ISA, mbarrier and
cp.async.bulk(.tensor); notes: ``bench/notes/2026-12-06-preflight-rules.md``.

Each barrier is named symbolically (:mod:`.addr`): the allocation's symbol,
a constant offset and the stage register times 8, so a load that completes on another
stage's (or another pipeline's) barrier names a different one.  Rules:

- ``mbarrier-align``: every mbarrier operand (``init``, ``arrive``, ``expect_tx``,
  ``try_wait``, a TMA's or bulk copy's, ``tcgen05.commit``'s) is 8-byte aligned;
- ``mbarrier-init``: every barrier an instruction names is one an ``mbarrier.init``
  sets up (at a constant place), with a constant count in [1, 2^20 - 1]; the arrivals
  one phase gets (threads x count, per CTA of the cluster they land in, the roles that
  arrive summed; threads the kernel declared as groups taking turns, ``turn_groups``,
  count once a group) equal that count; a barrier someone waits on gets arrivals;
- ``expect-tx``: per barrier, the bytes armed (``expect_tx``, constants <= 2^20 - 1)
  equal the bytes the loads completing on it deliver, per pass through the CFG with
  back edges cut (alternative passes must agree); a load completes only on an armed
  barrier;
- ``stage-range``: a barrier named through a stage register (``base + 8 x stage``) stays
  inside its array over the register's known range (a modular counter's ``[0, N - 1]``);
- ``mbarrier-fence``: in a cluster launch, a barrier that another CTA signals
  (a multicast or pair load, a remote arrive, a multicast commit) is initialised, then
  ``fence.mbarrier_init.release.cluster``, then the cluster barrier
  (``barrier.cluster.arrive``, then ``barrier.cluster.wait``: the cluster-scope acquire
  the release fence pairs with, PTX ISA fence.mbarrier_init), before the signal, on the
  signaller's path; a fence after the cluster barrier orders nothing the peer sees.
"""

import re
from fractions import Fraction

from .lanes import dag_order, pass_sums
from .ranges import sym_range

TX_MAX = (1 << 20) - 1
_WAIT = ("mbarrier.try_wait", "mbarrier.test_wait")
_ARM = ("mbarrier.arrive.expect_tx", "mbarrier.expect_tx")


def barrier_operand(ins):
    """The mbarrier operand of an instruction that names one (else None)."""
    op = ins.op
    if op.startswith("mbarrier.") or op.startswith("tcgen05.commit") or \
            op.startswith("cp.async.mbarrier.arrive"):
        return next((a for a in ins.args if a.startswith("[")), None)
    if op.startswith(("cp.async.bulk", "cp.reduce.async.bulk")) and "mbarrier::" in op:
        brackets = [a for a in ins.args if a.startswith("[")]
        return brackets[2] if len(brackets) >= 3 else None
    return None


def _loads(pf):
    """``[(instruction, bytes)]``: the copies that complete bytes on an mbarrier."""
    found = []
    for ins in pf.k.instrs:
        if "complete_tx" not in ins.op or barrier_operand(ins) is None:
            continue
        if ".tensor" in ins.op:
            tmap = pf.tensor_map(ins)
            if tmap is not None:
                found.append((ins, tmap.box_bytes))
        else:
            size = pf.constant(ins.args[2]) if len(ins.args) > 2 else None
            found.append((ins, size))
    return found


def target(pf, ins, lane: int, sym) -> tuple:
    """The CTA ranks an mbarrier signal from ``lane`` lands in (symmetric model for a
    multicast copy: what every CTA of the group sends lands in each, so its own)."""
    own = pf.lanes.rank(lane)
    if "multicast" in ins.op and "tcgen05.commit" in ins.op:
        mask = _lane_value(pf, ins.args[-1], lane, ins)
        return None if mask is None else tuple(r for r in range(16) if mask >> r & 1)
    kind = sym.rank[0]
    if kind == "own" or "multicast" in ins.op:
        return (own,)
    if kind == "and":
        return (own & sym.rank[1],)
    value = _lane_value(pf, sym.rank[1], lane, pf.k.instrs[sym.rank[2]])
    return None if value is None else (value,)


def _lane_value(pf, arg: str, lane: int, ins):
    c = pf.constant(arg)
    if c is not None:
        return c & 0xFFFF
    values = pf.lanes.values.at(arg, ins)
    return None if values is None else values[lane]


# ------------------------------------------------------------------ alignment
def check_align(pf) -> None:
    for ins in pf.k.instrs:
        bar = barrier_operand(ins)
        if bar is not None and pf.aligned_to(bar) < 3:
            pf.fail("mbarrier-align", ins, f"the mbarrier {bar} is not provably 8-byte "
                                           f"aligned")


# ------------------------------------------------------------------ init and arrivals
def _arrivals(pf, ins):
    """The arrivals one execution of ``ins`` makes on its barrier (None: not known;
    0: not an arrival)."""
    op = ins.op
    if op.startswith("mbarrier.arrive"):
        if ".expect_tx" in op:
            return 1
        args = [a for a in ins.args if not a.startswith("[")]
        return pf.constant(args[1]) if len(args) > 1 else 1
    if op.startswith("cp.async.mbarrier.arrive"):
        return 1 if ".noinc" in op else 0
    if op.startswith("tcgen05.commit"):
        return 1
    return 0


def check_init(pf) -> None:
    for ins in pf.unplaced_inits:
        pf.fail("mbarrier-init", ins, "an mbarrier.init at an address that is not a "
                                      "shared symbol plus a constant: which barrier it "
                                      "sets up cannot be told")
    for arr in pf.arrays:
        if arr.count is None or not 1 <= arr.count <= TX_MAX:
            pf.fail("mbarrier-init", arr.inits[0], f"init count {arr.inits[0].args[1]} "
                                                   f"is not a constant in [1, 2^20 - 1]")
    sites, waited = {}, set()
    for ins in pf.k.instrs:
        bar = barrier_operand(ins)
        if bar is None or ins.op.startswith("mbarrier.init"):
            continue
        sym = pf.addrs.operand(bar)
        arr = pf.array_of(sym)
        if arr is None:
            pf.fail("mbarrier-init", ins, f"{bar} names no barrier an mbarrier.init sets "
                                          f"up ({_place(sym)})")
            continue
        _check_stage(pf, ins, sym, arr)
        if ins.op.startswith(_WAIT):
            waited.add(id(arr))
        n = _arrivals(pf, ins)
        if n is None:
            pf.fail("mbarrier-init", ins, "the arrival count is not a constant")
        elif n:
            sites.setdefault(id(arr), (arr, []))[1].append((ins, sym, n))
    for arr in pf.arrays:
        if id(arr) in waited and id(arr) not in sites:
            pf.fail("mbarrier-init", arr.inits[0], f"{arr}: waited on, but nothing arrives "
                                                   f"on it (the wait never completes)")
    for arr, found in sites.values():
        if arr.count is not None:
            _check_phase(pf, arr, found)


def _check_stage(pf, ins, sym, arr) -> None:
    """``stage-range``: a barrier named through a stage register stays inside its array
    over the register's range (a ring counter that wraps one step late names a barrier
    past the last stage: another pipeline's, or none)."""
    if not sym.registers():
        return
    rng = sym_range(pf, sym, ins)
    if rng is None:
        return  # a register with no known range: the array's stages are all it can name
    last = arr.start + 8 * (arr.size - 1)
    if rng[0] < arr.start or rng[1] > last:
        pf.fail("stage-range", ins, f"names barriers at +{int(rng[0])}..+{int(rng[1])} "
                                    f"over its stage registers' range, outside {arr} "
                                    f"(+{arr.start}..+{last})")


def _check_phase(pf, arr, found) -> None:
    """The arrivals per phase, per CTA they land in: sites run by the same lanes are
    alternatives (another loop, another branch: each a phase's worth), sites run by
    disjoint lanes are roles that add up."""
    roles = {}
    turns = getattr(pf.facts, "turn_groups", None)  # [first thread, threads, groups]
    for ins, sym, n in found:
        lanes = pf.lanes.at(ins)
        per_rank = {}
        for lane in lanes:
            ranks = target(pf, ins, lane, sym)
            if ranks is None:
                pf.fail("mbarrier-init", ins, "which CTA's barrier this arrival lands in "
                                              "is not known per thread")
                return
            share = n
            if turns and 0 <= lane % pf.lanes.threads - turns[0] < turns[1]:
                share = Fraction(n, turns[2])  # one group of them a phase
            for r in ranks:
                per_rank[r] = per_rank.get(r, 0) + share
        roles.setdefault(lanes, []).append((ins, per_rank))
    keys = list(roles)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            if a & b:
                ins = roles[b][0][0]
                pf.fail("mbarrier-init", ins, f"{arr}: arrivals from overlapping but "
                                              f"different thread sets: the arrivals per "
                                              f"phase cannot be told")
                return
    total = {}
    for alternatives in roles.values():
        first = alternatives[0][1]
        for ins, per_rank in alternatives[1:]:
            if per_rank != first:
                pf.fail("mbarrier-init", ins, f"{arr}: the same threads arrive "
                                              f"{_counts(per_rank)} here and "
                                              f"{_counts(first)} elsewhere")
        for r, n in first.items():
            total[r] = total.get(r, 0) + n
    for r, n in sorted(total.items()):
        if n != arr.count:
            ins = next(i for alts in roles.values() for i, pr in alts if r in pr)
            pf.fail("mbarrier-init", ins, f"{arr}: init count {arr.count}, but a phase "
                                          f"gets {n} arrivals in CTA rank {r}")


def _counts(per_rank: dict) -> str:
    return ", ".join(f"{n} in rank {r}" for r, n in sorted(per_rank.items())) or "none"


def _place(sym) -> str:
    parts = [f"{c}*{n}" for n, c in sym.terms]
    return " + ".join(parts + [str(sym.const)])


# ------------------------------------------------------------------ bytes
def check_expect_tx(pf) -> None:
    arms = [ins for ins in pf.k.instrs if ins.op.startswith(_ARM)]
    loads = _loads(pf)
    armed_const = {}
    for ins in arms:
        value = pf.constant(ins.args[-1])
        if value is None:
            pf.fail("expect-tx", ins, f"the armed byte count {ins.args[-1]} is not a "
                                      f"constant")
        elif not 0 <= value <= TX_MAX:
            pf.fail("expect-tx", ins, f"arms {value} bytes, outside [0, 2^20 - 1]")
        else:
            armed_const[ins.index] = value
    for ins, size in loads:
        if size is None:
            pf.fail("expect-tx", ins, f"the bulk copy's size {ins.args[2]} is not a "
                                      f"constant")
    sites = [(ins, armed_const[ins.index], "armed") for ins in arms
             if ins.index in armed_const]
    sites += [(ins, size, "loaded") for ins, size in loads if size is not None]
    if not sites:
        return
    totals, where = _per_barrier(pf, sites)
    if totals is None:
        return
    for key in sorted(totals, key=str):
        armed, loaded = totals[key].get("armed", 0), totals[key].get("loaded", 0)
        if armed == loaded:
            continue
        ins = where[key]
        if not armed:
            pf.fail("expect-tx", ins, f"loads complete {loaded} bytes on a barrier that "
                                      f"no expect_tx arms (rank {key[1]})")
        elif not loaded:
            pf.fail("expect-tx", ins, f"arms {armed} bytes on a barrier that no load "
                                      f"completes on (rank {key[1]})")
        else:
            pf.fail("expect-tx", ins, f"arms {armed} bytes; the loads that complete on "
                                      f"this barrier deliver {loaded} (rank {key[1]})")


def _per_barrier(pf, sites):
    """``({(barrier, rank): {"armed"/"loaded": bytes}}, {key: an instruction})`` over
    one pass per lane, the lanes' passes added up."""
    lanes = pf.lanes
    info = {}
    for ins, amount, kind in sites:
        sym = pf.addrs.operand(barrier_operand(ins))
        info[ins.index] = (ins, amount, kind, sym, lanes.at(ins))
    signature = {}
    for idx, (ins, amount, kind, sym, at) in info.items():
        for lane in at:
            ranks = target(pf, ins, lane, sym)
            if ranks is None:
                pf.fail("expect-tx", ins, "which CTA's barrier these bytes land in is not "
                                          "known per thread")
                return None, None
            signature.setdefault(lane, []).append((idx, ranks))
    edges_of = {lane: edges for edges, members in lanes.classes() for lane in members}
    groups = {}
    for lane, sig in signature.items():
        groups.setdefault((edges_of.get(lane, frozenset()), tuple(sig)), []).append(lane)
    order = dag_order(pf.k)
    totals, where = {}, {}
    for (edges, sig), members in groups.items():
        gains = {}
        for idx, ranks in sig:
            ins, amount, kind, sym, _ = info[idx]
            for r in ranks:
                key = (sym.place, r, kind)
                gains.setdefault(ins.block, {})[key] = \
                    gains.get(ins.block, {}).get(key, 0) + amount
                where.setdefault((sym.place, r), ins)
        passes = pass_sums(pf.k, edges, gains, order)
        per_key = {}
        for p in passes:
            for key, amount in p:
                per_key.setdefault(key, set()).add(amount)
        for (place, r, kind), amounts in per_key.items():
            if len(amounts) > 1:
                pf.fail("expect-tx", where[place, r], f"a thread {kind} "
                                                      f"{sorted(amounts)} bytes on this "
                                                      f"barrier on different passes")
            entry = totals.setdefault((place, r), {})
            entry[kind] = entry.get(kind, 0) + max(amounts) * len(members)
    return totals, where


# ------------------------------------------------------------------ fence
def _cluster_scope(pf, ins) -> bool:
    op = ins.op
    if "multicast::cluster" in op or (".cta_group::2" in op and "complete_tx" in op):
        return True
    if op.startswith("tcgen05.commit") and ".cta_group::2" in op:
        return True
    bar = barrier_operand(ins)
    return bar is not None and pf.addrs.operand(bar).rank != ("own",)


def check_fence(pf) -> None:
    if pf.cluster is not None and pf.cluster_size == 1:
        return
    uses = {ins.index for ins in pf.k.instrs if barrier_operand(ins) is not None
            and not ins.op.startswith("mbarrier.init") and _cluster_scope(pf, ins)}
    if not uses:
        return
    init_of = {id(i): arr for arr in pf.arrays for i in arr.inits}
    # the barriers each path holds: initialised but not fenced, fenced but the cluster
    # barrier not arrived at since, arrived at but not waited on
    state_in = {0: (frozenset(), frozenset(), frozenset())}
    work = list(range(len(pf.k.blocks)))
    flagged = set()
    while work:
        b = work.pop(0)
        if b not in state_in:
            continue
        unfenced, fenced, arrived = state_in[b]
        for i in pf.k.blocks[b]:
            ins = pf.k.instrs[i]
            if id(ins) in init_of:
                unfenced = unfenced | {id(init_of[id(ins)])}
            elif ins.op.startswith("fence.mbarrier_init"):
                unfenced, fenced = frozenset(), fenced | unfenced
            elif ins.op.startswith("barrier.cluster.arrive"):
                fenced, arrived = frozenset(), arrived | fenced
            elif ins.op.startswith("barrier.cluster.wait"):
                arrived = frozenset()  # the acquire the release fence pairs with
            elif ins.index in uses and ins.index not in flagged:
                arr = pf.array_of(pf.addrs.operand(barrier_operand(ins)))
                step = None if arr is None else (
                    "fence.mbarrier_init.release.cluster" if id(arr) in unfenced else
                    "the cluster barrier (barrier.cluster.arrive, then wait)"
                    if id(arr) in fenced | arrived else None)
                if step:
                    flagged.add(ins.index)
                    pf.fail("mbarrier-fence", ins, f"another CTA of the cluster signals "
                                                   f"{arr} before {step} follows its init")
        for s in pf.k.succ[b]:
            if s == pf.k.exit:
                continue
            old = state_in.get(s)
            new = (unfenced, fenced, arrived) if old is None else \
                (old[0] | unfenced, old[1] | fenced, old[2] | arrived)
            if new != old:
                state_in[s] = new
                work.append(s)
