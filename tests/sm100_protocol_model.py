"""An exhaustive model of the sm_100 grouped GEMM's barrier protocol (both CTAs).

The kernel has never run (no Blackwell GPU here), so its barrier protocol is
checked by exploring every interleaving of its roles on a small problem, with
the mbarrier semantics that matter: a phase bit per barrier, pending arrivals
reset to the barrier's count at each phase, a signed transaction count, waits
by parity, and the pipelines' producer/consumer phase bookkeeping.

``cutlass.experimental.task_scheduling``'s exhaustive checker models pipelines
as credits: it has no arrival counts, phases or second CTA, so a wrong
arrival count (the bug class that matters here) cannot be planted in it.  This
is the smallest model that can.

Roles, per the kernel (``csrc_free_kernels/sm100/grouped_gemm_sm100.py``):

- ``G0``, ``G1``: the gather threads of each CTA (one actor per CTA, arriving
  with the weight of its 128 threads): wait the local empty barrier, write the
  A stage, arrive on the *leader's* full barrier;
- ``B0``, ``B1``: the weight producer of each CTA: wait the local empty
  barrier; the leader arms the leader's full barrier once (one arrival, both
  halves' bytes); each issues its TMA, whose completion (a separate step, in
  any order) writes the stage and counts its bytes on the leader's barrier;
- ``M``: the leader's MMA: per tile, wait the accumulator's empty barrier; per
  k-tile wait both full barriers, read both CTAs' stages, release them by
  ``tcgen05.commit`` multicast to both CTAs' empty barriers; commit the
  accumulator to both CTAs' full barriers;
- ``E0``, ``E1``: the epilogue of each CTA: wait the local accumulator full
  barrier, read it, arrive on the leader's empty barrier (weight 4 warps).

Errors found: a deadlock (work left, nothing can move), a race (a stage or
accumulator written while another actor reads or writes it), a stale read (a
consumer reads a stage whose producer has not finished this use), and an
over-arrival.
"""

from collections import deque
from dataclasses import dataclass

GATHER_WEIGHT = 128   # gather threads per CTA
EPILOGUE_WEIGHT = 4   # epilogue warps per CTA (one elected arrival each)


@dataclass(frozen=True)
class Counts:
    a_full: int
    a_empty: int
    b_full: int
    b_empty: int
    acc_full: int
    acc_empty: int


@dataclass(frozen=True)
class Shape:
    stages: int = 2
    acc_stages: int = 1
    tiles: int = 2
    k_tiles: int = 2


def _pipeline_uses(n_uses, stages, producer):
    """(stage index, phase) of each use, as PipelineState advances them."""
    phase = 1 if producer else 0
    out = []
    for i in range(n_uses):
        s = i % stages
        out.append((s, phase))
        if s == stages - 1:
            phase ^= 1
    return out


def programs(shape: Shape, gather_commit_cta=lambda c: 0):
    """Each actor's straight-line program of steps.  ``gather_commit_cta(c)``: the
    CTA whose full barrier CTA ``c``'s gather threads arrive on (the leader's,
    0; a plain arrive on the thread's own barrier would be ``c``)."""
    steps = shape.tiles * shape.k_tiles
    prog = {}
    for c in (0, 1):
        g = []
        for i, (s, ph) in enumerate(_pipeline_uses(steps, shape.stages, True)):
            g += [("wait", ("Ae", c, s), ph), ("write", ("A", c, s)),
                  ("done_write", ("A", c, s),
                   [(("Af", gather_commit_cta(c), s), GATHER_WEIGHT, 0)])]
        prog[f"G{c}"] = g
        b = []
        for i, (s, ph) in enumerate(_pipeline_uses(steps, shape.stages, True)):
            b.append(("wait", ("Be", c, s), ph))
            if c == 0:
                b.append(("arrive", [(("Bf", 0, s), 1, 2)]))  # one arrival, two halves' tx
            b.append(("tma", ("B", c, s), ("Bf", 0, s)))
        prog[f"B{c}"] = b
        e = []
        for t, (a, ph) in enumerate(_pipeline_uses(shape.tiles, shape.acc_stages, False)):
            e += [("wait", ("Cf", c, a), ph), ("read", [("C", c, a)]),
                  ("done_read", [("C", c, a)], [(("Ce", 0, a), EPILOGUE_WEIGHT, 0)])]
        prog[f"E{c}"] = e
    m = []
    ab = _pipeline_uses(steps, shape.stages, False)
    for t, (a, ph) in enumerate(_pipeline_uses(shape.tiles, shape.acc_stages, True)):
        m += [("wait", ("Ce", 0, a), ph), ("write", ("C", 0, a)), ("write", ("C", 1, a))]
        for k in range(shape.k_tiles):
            s, cph = ab[t * shape.k_tiles + k]
            m += [("wait", ("Af", 0, s), cph), ("wait", ("Bf", 0, s), cph),
                  ("read", [("A", 0, s), ("A", 1, s), ("B", 0, s), ("B", 1, s)]),
                  ("done_read", [("A", 0, s), ("A", 1, s)],
                   [(("Ae", 0, s), 1, 0), (("Ae", 1, s), 1, 0)]),
                  ("done_read", [("B", 0, s), ("B", 1, s)],
                   [(("Be", 0, s), 1, 0), (("Be", 1, s), 1, 0)])]
        m += [("done_write", ("C", 0, a), []),
              ("done_write", ("C", 1, a), [(("Cf", 0, a), 1, 0), (("Cf", 1, a), 1, 0)])]
    prog["M"] = m
    return prog


class ProtocolError(Exception):
    pass


def check(counts: Counts, shape: Shape = Shape(), max_states: int = 2_000_000,
          **program_options) -> int:
    """Explore every interleaving; returns the number of states, or raises
    ProtocolError naming the first deadlock, race, stale read or over-arrival."""
    prog = programs(shape, **program_options)
    actors = sorted(prog)
    expected = {"Af": counts.a_full, "Ae": counts.a_empty, "Bf": counts.b_full,
                "Be": counts.b_empty, "Cf": counts.acc_full, "Ce": counts.acc_empty}
    names = set()
    for steps in prog.values():
        for op in steps:
            for item in op[1:]:
                for x in (item if isinstance(item, list) else [item]):
                    if isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple):
                        names.add(x[0])
                    elif isinstance(x, tuple) and len(x) == 3 and x[0] in expected:
                        names.add(x)
    barriers = sorted(names)
    bidx = {b: i for i, b in enumerate(barriers)}
    # barrier state: (parity, pending, tx)
    init_bar = tuple((0, expected[b[0]], 0) for b in barriers)
    # resource state: frozenset of (resource, actor, mode) holds; gens: dict resource -> writes
    start = (tuple(0 for _ in actors), init_bar, frozenset(), (), frozenset())
    # uses: how many times each consumer has read a resource -> stale-read check via gens
    seen = {start}
    queue = deque([start])

    def arrive(bars, target, weight, tx):
        bars = list(bars)
        i = bidx[target]
        parity, pending, cur_tx = bars[i]
        pending -= weight
        cur_tx += tx
        if pending < 0:
            raise ProtocolError(f"over-arrival on {target}")
        if pending == 0 and cur_tx == 0:
            parity, pending = parity ^ 1, expected[target[0]]
        bars[i] = (parity, pending, cur_tx)
        return tuple(bars)

    def tx_done(bars, target):
        bars = list(bars)
        i = bidx[target]
        parity, pending, cur_tx = bars[i]
        cur_tx -= 1
        if pending == 0 and cur_tx == 0:
            parity, pending = parity ^ 1, expected[target[0]]
        bars[i] = (parity, pending, cur_tx)
        return tuple(bars)

    def race(holds, resource, actor, mode):
        for r, who, m in holds:
            if r == resource and who != actor and ("w" in (m, mode)):
                raise ProtocolError(f"race on {resource}: {actor} {mode} while {who} {m}")

    while queue:
        pcs, bars, holds, tmas, gens = queue.popleft()
        gens_d = dict(gens)
        moved = False
        successors = []
        for ai, actor in enumerate(actors):
            pc = pcs[ai]
            if pc == len(prog[actor]):
                continue
            op = prog[actor][pc]
            kind = op[0]
            nb, nh, nt, ng = bars, holds, tmas, gens_d
            if kind == "wait":
                parity = bars[bidx[op[1]]][0]
                if parity == op[2]:  # try_wait.parity(p) passes once phase p completed
                    continue
            elif kind == "write":
                race(holds, op[1], actor, "w")
                nh = holds | {(op[1], actor, "w")}
            elif kind == "done_write":
                nh = holds - {(op[1], actor, "w")}
                ng = dict(gens_d)
                ng[op[1]] = ng.get(op[1], 0) + 1
                for target, w, tx in op[2]:
                    nb = arrive(nb, target, w, tx)
            elif kind == "read":
                for r in op[1]:
                    race(holds, r, actor, "r")
                    # this consumer's use u of r must read the u-th write
                    reads = dict(gens_d).get(("reads", actor, r), 0)
                    if gens_d.get(r, 0) != reads + 1:
                        raise ProtocolError(f"stale read of {r} by {actor}: "
                                            f"{gens_d.get(r, 0)} writes, read {reads + 1}")
                nh = holds | {(r, actor, "r") for r in op[1]}
                ng = dict(gens_d)
                for r in op[1]:
                    ng[("reads", actor, r)] = ng.get(("reads", actor, r), 0) + 1
            elif kind == "done_read":
                nh = holds - {(r, actor, "r") for r in op[1]}
                for target, w, tx in op[2]:
                    nb = arrive(nb, target, w, tx)
            elif kind == "arrive":
                for target, w, tx in op[1]:
                    nb = arrive(nb, target, w, tx)
            elif kind == "tma":  # issue: the bytes land later, in any order
                race(holds, op[1], actor, "w")
                nh = holds | {(op[1], "TMA", "w")}
                nt = tmas + ((op[1], op[2]),)
            new_pcs = pcs[:ai] + (pc + 1,) + pcs[ai + 1:]
            successors.append((new_pcs, nb, nh, nt, frozenset(ng.items())))
            moved = True
        for ti, (resource, target) in enumerate(tmas):  # a TMA completes
            nh = holds - {(resource, "TMA", "w")}
            ng = dict(gens_d)
            ng[resource] = ng.get(resource, 0) + 1
            successors.append((pcs, tx_done(bars, target), nh, tmas[:ti] + tmas[ti + 1:],
                               frozenset(ng.items())))
            moved = True
        if not moved:
            if any(pcs[i] < len(prog[a]) for i, a in enumerate(actors)) or tmas:
                stuck = {a: prog[a][pcs[i]] for i, a in enumerate(actors)
                         if pcs[i] < len(prog[a])}
                raise ProtocolError(f"deadlock: {stuck}")
            continue
        for state in successors:
            if state not in seen:
                seen.add(state)
                queue.append(state)
                if len(seen) > max_states:
                    raise ProtocolError(f"more than {max_states} states: shrink the shape")
    return len(seen)
