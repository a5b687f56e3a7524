"""``tcgen05-order`` (:mod:`.preflight`): the order of tensor-memory work around a thread
synchronisation (sm_100a), from the PTX ISA's "Memory Consistency Model for 5th
generation of TensorCore operations": the asynchronous tcgen05 operations (``mma``,
``cp``, ``shift``, ``ld``, ``st``) are not ordered by program order, an mbarrier or a CTA
barrier alone.  On every path of every thread (the lanes' own edges, :mod:`.lanes`):

- *after a synchronisation*: between a wait (``mbarrier.try_wait``/``test_wait``,
  ``bar.sync``/``bar.red``/``barrier.sync``, ``barrier.cluster.wait``) and the next
  asynchronous tcgen05 operation, a ``tcgen05.fence::after_thread_sync`` (canonical
  patterns, non-pipelined and pipelined instructions in different threads; without it
  the operation may be performed before the wait: an MMA reading a stage not yet
  filled, a ``tcgen05.ld`` reading an accumulator not yet written);
- *before a signal*: between an asynchronous tcgen05 operation and the next arrive
  (``mbarrier.arrive``, ``bar.arrive``/``bar.sync``/``bar.red``,
  ``barrier.cluster.arrive``), a ``tcgen05.fence::before_thread_sync``; a
  ``tcgen05.commit`` performs it for the MMAs, copies and shifts before it (canonical
  patterns, non-pipelined instructions in the same thread), not for ``ld``/``st``;
- *loads and stores complete*: between a ``tcgen05.ld`` and the next signal, or the next
  ``mma``/``cp``/``shift``/``st``/``dealloc`` of the thread (which may overwrite or free
  what it reads), a ``tcgen05.wait::ld``; between a ``tcgen05.st`` and the next signal,
  ``ld``, ``mma`` or ``cp``, a ``tcgen05.wait::st`` (tcgen05.wait; canonical patterns,
  "Register dependencies, same thread").

Reading a ``tcgen05.ld``'s destination registers before ``tcgen05.wait::ld`` is not a
fault and is not flagged: the ISA respects a true register dependency on
``tcgen05.ld`` whatever else is there ("Register dependencies, same thread"); the wait
orders the load's *memory access*, which is what the rules above require before the
tensor memory is handed on.
"""

import re

_ASYNC = ("tcgen05.mma", "tcgen05.cp", "tcgen05.shift", "tcgen05.ld", "tcgen05.st")
_COMMITTED = ("tcgen05.mma", "tcgen05.cp", "tcgen05.shift")  # what tcgen05.commit tracks
_WAIT = re.compile(r"^(mbarrier\.(try|test)_wait|bar(rier)?(\.cta)?\.(sync|red)|"
                   r"barrier\.cluster\.wait)")
_SIGNAL = re.compile(r"^(mbarrier\.arrive|bar(rier)?(\.cta)?\.(arrive|sync|red)|"
                     r"barrier\.cluster\.arrive)")
_OVERWRITES_LD = ("tcgen05.mma", "tcgen05.cp", "tcgen05.shift", "tcgen05.st",
                  "tcgen05.dealloc")
_AFTER_ST = ("tcgen05.ld", "tcgen05.mma", "tcgen05.cp")

# the pending conditions a path carries: each maps to the instruction that opened it
SYNCED = "a synchronisation with no tcgen05.fence::after_thread_sync since"
UNFENCED = "an asynchronous tcgen05 operation with no tcgen05.fence::before_thread_sync since"
UNCOMMITTED = "a tcgen05 MMA/copy/shift with no tcgen05.commit or before_thread_sync since"
LOADING = "a tcgen05.ld with no tcgen05.wait::ld since"
STORING = "a tcgen05.st with no tcgen05.wait::st since"


def check_order(pf) -> None:
    if not any(ins.op.startswith(_ASYNC) for ins in pf.k.instrs):
        return
    found = {}  # (opener, condition) -> (the first instruction that breaks it, the need)
    for edges, lanes in pf.lanes.classes():
        _walk(pf, edges, frozenset(lanes), found)
    for (opener, cond), (ins, need) in sorted(found.items(), key=lambda f: f[1][0].index):
        pf.fail("tcgen05-order", ins, f"after {cond.split(' with ')[0]} (PTX line "
                                      f"{pf.k.instrs[opener].line}): needs {need}")


def _step(ins, state: dict) -> list:
    """Apply one instruction to a path's pending conditions (``{condition: opening
    instruction}``); return the ``(condition, what it needs)`` it breaks."""
    op, broken = ins.op, []
    if op.startswith(_ASYNC):
        if SYNCED in state:
            broken.append((SYNCED, "tcgen05.fence::after_thread_sync between the wait and "
                                   "this asynchronous tcgen05 operation"))
        if op.startswith(_OVERWRITES_LD) and LOADING in state:
            broken.append((LOADING, "tcgen05.wait::ld before this may overwrite what the "
                                    "load reads"))
        if op.startswith(_AFTER_ST) and STORING in state:
            broken.append((STORING, "tcgen05.wait::st before this"))
    elif op.startswith("tcgen05.dealloc") and LOADING in state:
        broken.append((LOADING, "tcgen05.wait::ld before the tensor memory is freed"))
    if _SIGNAL.match(op):
        for cond, need in ((LOADING, "tcgen05.wait::ld"), (STORING, "tcgen05.wait::st"),
                           (UNFENCED, "tcgen05.fence::before_thread_sync"),
                           (UNCOMMITTED, "tcgen05.commit or tcgen05.fence::before_thread_sync")):
            if cond in state:
                broken.append((cond, f"{need} before this signal hands the tensor memory on"))
    # then the instruction's own effect
    if op.startswith("tcgen05.fence::after_thread_sync"):
        state.pop(SYNCED, None)
    elif op.startswith("tcgen05.fence::before_thread_sync"):
        state.pop(UNFENCED, None)
        state.pop(UNCOMMITTED, None)
    elif op.startswith("tcgen05.commit"):
        state.pop(UNCOMMITTED, None)
    elif op.startswith("tcgen05.wait::ld"):
        state.pop(LOADING, None)
    elif op.startswith("tcgen05.wait::st"):
        state.pop(STORING, None)
    elif op.startswith(_COMMITTED):
        state[UNCOMMITTED] = ins
    elif op.startswith("tcgen05.ld"):
        state[LOADING], state[UNFENCED] = ins, ins
    elif op.startswith("tcgen05.st"):
        state[STORING], state[UNFENCED] = ins, ins
    if _WAIT.match(op):
        state[SYNCED] = ins
    return broken


def _walk(pf, edges, lanes, found) -> None:
    """One lane class's paths, to a fixed point of the conditions each block starts with
    (a condition any path brings: each remembers the instruction that opened it); what
    breaks one is kept in ``found``, the earliest instruction per opener."""
    k = pf.k
    start, work = {0: {}}, [0]
    while work:
        b = work.pop()
        state = dict(start[b])
        for i in k.blocks[b]:
            ins = k.instrs[i]
            if not lanes & pf.lanes.at(ins):
                continue
            for cond, need in _step(ins, state):
                key = (state[cond].index, cond)
                if key not in found or i < found[key][0].index:
                    found[key] = (ins, need)
        for s in k.succ[b]:
            if (b, s) not in edges or s == k.exit:
                continue
            old = start.get(s)
            new = dict(state) if old is None else {**state, **old}
            if old is None or new.keys() != old.keys():
                start[s] = new
                work.append(s)
