"""``wgmma-smem-release`` (:mod:`.preflight`): a pipeline stage is not given back to its
producers while a ``wgmma.mma_async`` that reads it may still be pending (sm_90a).

PTX ISA, wgmma.mma_async: the A (by descriptor) and B operands are read from shared
memory asynchronously, and "the contents of the shared memory ... must not be modified
until the wgmma.mma_async has completed", which only a ``wgmma.wait_group`` that
retires the instruction's wgmma-group establishes (wgmma.wait_group: it waits until at
most ``N`` of the most recent groups are pending; ``wgmma.commit_group`` closes the
MMAs issued since the last one into a group, and an MMA not yet committed is in no
group).  Giving a stage back (the consumer's ``mbarrier.arrive`` on the stage's empty
barrier) lets the producer's TMA overwrite it: before the wait, an MMA may read the
next k-tile's data (wrong results, silently).

The model, on every path of each thread that issues MMAs and releases stages (a
forward dataflow over its lane class's edges, :meth:`.lanes.Lanes.classes`): the
stages it holds, oldest first, in the order the pipeline hands them out and takes them
back (a ring's consumer acquires and releases in order).  A parity wait on a barrier
that TMA loads complete on (a full barrier) acquires the next stage; a
``wgmma.mma_async`` reads the newest stage held; ``commit_group`` ages every pending
stage by one group; ``wait_group N`` retires the stages whose newest reading MMA is
``N`` or more groups old; a plain ``mbarrier.arrive`` (not ``expect_tx``) gives back
the oldest stage held, which must have no pending MMA.  So the sm90 mainloops' order
(MMAs of stage ``s``, commit, ``wait_group 1``, release of stage ``s - 1``) passes; a
release of stage ``s`` there, a shallower wait, or a release before the wait does not.
"""

from .mbarrier import _loads, barrier_operand
from .values import CounterValues, taken

_MMA = "wgmma.mma_async"
OPEN = -1          # a stage read by an MMA not yet committed
MAX_AGE = 16       # groups counted past this stay pending
MAX_HELD = 16      # stages held past this: the oldest forgotten
MAX_STATES = 256   # per block; more: the counters forgotten


def check_wgmma_release(pf) -> None:
    k = pf.k
    if not any(ins.op.startswith(_MMA) for ins in k.instrs):
        return
    full = {id(a) for a in (pf.array_of(pf.addrs.operand(barrier_operand(ins)))
                            for ins, _ in _loads(pf)) if a is not None}
    acquires, releases = set(), set()
    for ins in k.instrs:
        bar = barrier_operand(ins)
        if bar is None:
            continue
        if ins.op.startswith(("mbarrier.try_wait", "mbarrier.test_wait")):
            arr = pf.array_of(pf.addrs.operand(bar))
            if arr is not None and id(arr) in full:
                acquires.add(ins.index)
        elif ins.op.startswith("mbarrier.arrive") and ".expect_tx" not in ins.op:
            releases.add(ins.index)
    if not acquires or not releases:
        return
    # the counters that decide whether a release runs (``if k > 0``: the first trip
    # holds one stage and gives none back), told apart as 0, 1 or more
    cv = CounterValues(pf, small=2)
    counters = set()
    for i in releases:
        for b in k.cd[k.instrs[i].block]:
            br = k.branch(b)
            if br is not None and br.guard:
                counters |= cv.deps(br.guard.lstrip("!"))
    defs = {d.index: d.defs[0] for c in counters for d in k.writes.get(c, ())}
    found = {}
    for edges, lanes in pf.lanes.classes():
        lanes = frozenset(lanes)
        runs = [i for i in releases | {ins.index for ins in k.instrs
                                       if ins.op.startswith(_MMA)}
                if lanes & pf.lanes.at(k.instrs[i])]
        if any(i in releases for i in runs) and any(i not in releases for i in runs):
            _walk(pf, cv, defs, edges, lanes, acquires, releases, found)
    for i in sorted(found):
        ins, (mma, age) = k.instrs[i], found[i]
        pending = ("is not yet committed" if age == OPEN else
                   f"is in a group with {age} newer group{'s' if age != 1 else ''} "
                   f"committed and no wgmma.wait_group {age} or lower since")
        pf.fail("wgmma-smem-release", ins,
                f"gives back the oldest stage held while the wgmma.mma_async at PTX line "
                f"{k.instrs[mma].line} that reads it {pending}: the producer may "
                f"overwrite its operands before the MMA has read them")


def _walk(pf, cv, defs, edges, lanes, acquires, releases, found) -> None:
    """A state: the counters' values, and per stage held ``(age, mma)`` of its newest
    reading MMA (age None: none pending)."""
    k = pf.k
    start = (tuple(sorted((c, None) for c in set(defs.values()))), ())
    seen, work = {0: {start}}, [(0, start)]
    cv.restrict(lanes)
    while work:
        b, (env_t, held) = work.pop()
        env = dict(env_t)
        for i in k.blocks[b]:
            ins = k.instrs[i]
            if not lanes & pf.lanes.at(ins):
                continue
            if i in acquires:
                held = (held + ((None, None),))[-MAX_HELD:]
            elif ins.op.startswith(_MMA):
                if held:
                    held = held[:-1] + ((OPEN, i),)
            elif ins.op.startswith("wgmma.commit_group"):
                held = tuple((None, m) if a is None else (min(a + 1, MAX_AGE), m)
                             for a, m in held)
            elif ins.op.startswith("wgmma.wait_group"):
                keep = int(ins.args[0])
                held = tuple((None, m) if a is not None and a >= keep else (a, m)
                             for a, m in held)
            elif i in releases and held:
                age, mma = held[0]
                if age is not None and (i not in found or age < found[i][1]):
                    found[i] = (mma, age)
                held = held[1:]
            if i in defs:
                env[defs[i]] = cv.step(ins, env)
        held = tuple((a, m if a is not None else None) for a, m in held)
        out = (tuple(sorted(env.items())), held)
        for s in taken(cv, k, b, env):
            if s == k.exit or (b, s) not in edges:
                continue
            states = seen.setdefault(s, set())
            if len(states) >= MAX_STATES:  # the counters forgotten: every branch taken
                out = (tuple((c, None) for c, _ in out[0]), out[1])
            if out not in states:
                states.add(out)
                work.append((s, out))
