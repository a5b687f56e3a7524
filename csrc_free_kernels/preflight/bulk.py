"""Bulk copies, shared-memory bounds, clusters and the proxy fence (:mod:`.preflight`).
Notes: ``bench/notes/2026-12-06-preflight-rules.md``.

- ``bulk-copy``: a non-tensor ``cp.async.bulk`` moves a multiple of 16 bytes between
  16-byte aligned addresses (PTX ISA, cp.async.bulk); the global address's alignment
  comes from what the launch promises of the tensor (its base and strides);
- ``tma-smem``: a TMA box (load destination, store source) lies inside the
  shared memory it names: offset >= 0 and offset + box bytes <= the allocation, over
  the stage counter's range (the stage that names the box's barrier) and the threads'
  known values;
- ``cluster``: the cluster has at most 8 CTAs (portable size, CUDA programming guide);
  a multicast ``ctaMask`` names only CTAs of the cluster, and is not empty; ``mapa``
  ranks stay below the cluster size;
- ``proxy-fence``: shared memory that threads write (``st.shared``, ``stmatrix``,
  ``cp.async``, atomics: the generic proxy) and a TMA or bulk store or a ``tcgen05.mma``
  then reads (the async proxy: an MMA's operands by their descriptors, the allocation
  each descriptor's start falls in), or that ``cp.async`` writes and a ``wgmma`` reads
  (a ring stage filled by threads), has a ``fence.proxy.async`` between them
  (PTX ISA, memory consistency model: proxies), after the writes are done: on the
  writer's path (a ``cp.async``'s at ``cp.async.wait_group``/``wait_all``: a fence
  before that orders nothing), or on the reader's after the barrier that the write
  reaches it through (a named barrier, or an mbarrier), for writes done when it was
  reached: copies still in flight at a plain arrive or a named barrier stay in flight
  for the reader (no fence of its orders them), while ``cp.async.mbarrier.arrive``
  arrives only once the copies have landed.
"""

import re

from .mbarrier import barrier_operand
from .ranges import allocation_at, footprint, operand_range, shared_size, sym_range

PORTABLE_CLUSTER = 8


# ------------------------------------------------------------------ bulk copies
def check_bulk(pf) -> None:
    for ins in pf.k.instrs:
        if not ins.op.startswith(("cp.async.bulk.", "cp.reduce.async.bulk.")) or \
                ".tensor" in ins.op or "commit_group" in ins.op or "wait_group" in ins.op:
            continue
        if ".prefetch" in ins.op:
            addrs, size = ins.args[:1], ins.args[1] if len(ins.args) > 1 else None
        else:
            addrs, size = ins.args[:2], ins.args[2] if len(ins.args) > 2 else None
        if size is None or pf.aligned_to(size) < 4:
            pf.fail("bulk-copy", ins, f"size {size} is not provably a multiple of 16 bytes")
        for a in addrs:
            if pf.aligned_to(a) < 4:
                pf.fail("bulk-copy", ins, f"address {a} is not provably 16-byte aligned")


# ------------------------------------------------------------------ bounds
def _stage_ranges(pf, ins) -> dict:
    """The registers of a TMA load's barrier operand that index its barrier array:
    their range is the array's stages."""
    bar = barrier_operand(ins)
    if bar is None:
        return {}
    sym = pf.addrs.operand(bar)
    arr = pf.array_of(sym)
    if arr is None:
        return {}
    first = (sym.const - arr.start) // 8
    return {name: (0, (arr.size - 1 - first) // max(int(coef) // 8, 1))
            for name, coef in sym.registers()}


def box_region(pf, ins, tmap):
    """``(symbol, lo, hi, size)`` of a TMA's shared-memory box, or a reason string."""
    store = ".global.shared" in ins.op
    operand = ins.args[1] if store else ins.args[0]
    sym = pf.addrs.operand(operand)
    symbols = sym.symbols()
    if len(symbols) != 1 or symbols[0][1] != 1:
        return f"its shared-memory operand {operand} is not one shared symbol plus offsets"
    name = symbols[0][0]
    rng = sym_range(pf, sym, ins, _stage_ranges(pf, ins)) or operand_range(pf, operand, ins)
    if rng is None:
        return f"its shared-memory operand {operand} has an offset with no known range"
    return name, rng[0], rng[1], tmap.box_bytes


def check_bounds(pf) -> None:
    for ins, _ in pf.tma_sites():
        tmap = pf.tensor_map(ins)
        if tmap is None:
            continue  # tma-coordinate reports it
        region = box_region(pf, ins, tmap)
        if isinstance(region, str):
            pf.fail("tma-smem", ins, region)
            continue
        name, lo, hi, size = region
        limit = shared_size(pf, name)
        if limit is None:
            pf.fail("tma-smem", ins, f"the size of shared symbol {name} is not known")
        elif lo < 0 or hi + size > limit:
            pf.fail("tma-smem", ins, f"the box spans bytes [{lo}, {hi + size}) of "
                                            f"{name}, which has {limit}")


# ------------------------------------------------------------------ clusters
def _values(pf, arg: str, ins):
    c = pf.constant(arg)
    if c is not None:
        return {c}
    values = pf.lanes.values.at(arg, ins)
    if values is None:
        return None
    lanes = pf.lanes.at(ins)
    return {values[lane] for lane in lanes} if lanes else set()


def check_cluster(pf) -> None:
    if pf.cluster is None:
        return  # missing-fact reports it where clusters are used
    size = pf.cluster_size
    if size > PORTABLE_CLUSTER:
        pf.fail("cluster", pf.k.name, f"cluster {tuple(pf.cluster)} has {size} CTAs, over "
                                      f"the portable {PORTABLE_CLUSTER}")
    for ins in pf.k.instrs:
        if "multicast::cluster" in ins.op:
            arg = _cta_mask(ins)
            masks = _values(pf, arg, ins) if arg else None
            if masks is None:
                pf.fail("cluster", ins, f"the ctaMask {arg} is not known")
                continue
            for m in sorted(masks):
                m &= 0xFFFF
                if m == 0 or m >> size:
                    pf.fail("cluster", ins, f"ctaMask {m:#06x} names CTAs outside a "
                                            f"cluster of {size}" if m else "an empty ctaMask")
                    break
        elif ins.op.startswith("mapa"):
            ranks = _values(pf, ins.args[2], ins)
            if ranks is None:
                pf.fail("cluster", ins, f"the rank {ins.args[2]} is not known")
            elif any(not 0 <= r < size for r in ranks):
                pf.fail("cluster", ins, f"ranks {sorted(ranks)} outside a cluster of {size}")


def _cta_mask(ins):
    """The ``ctaMask`` operand: after the barrier of a TMA load, last of a commit."""
    if ins.op.startswith("tcgen05.commit"):
        return ins.args[-1] if len(ins.args) > 1 else None
    brackets = [i for i, a in enumerate(ins.args) if a.startswith("[")]
    after = brackets[-1] + 1 if brackets else len(ins.args)
    return ins.args[after] if after < len(ins.args) else None


# ------------------------------------------------------------------ proxy fence
_GENERIC_WRITE = re.compile(r"^(st\.shared|stmatrix|atom\.shared|red\.shared|"
                            r"cp\.async\.(ca|cg)\.shared)")
# a wgmma's stage, by the threads' loads into it (the epilogue's stmatrix and st.shared
# name addresses the model cannot place, and never a ring stage)
_STAGE_WRITE = re.compile(r"^cp\.async\.(ca|cg)\.shared")
_ASYNC_READ = re.compile(r"^cp(\.reduce)?\.async\.bulk(\.tensor\.\dd)?\.global\.shared")
_BAR_SITE = re.compile(r"^(bar|barrier)(\.cta)?\.(sync|arrive|red)")
WRITTEN, PENDING = 1, 2  # a path's writes: done and not fenced; cp.async not yet waited


def _read_region(pf, ins):
    """``(symbol, lo, hi)`` a store reads (``lo``/``hi`` None: anywhere), or None."""
    if ".tensor" in ins.op:
        tmap = pf.tensor_map(ins)
        size = tmap.box_bytes if tmap is not None else None
    else:
        size = pf.constant(ins.args[2])
    return footprint(pf, pf.addrs.operand(ins.args[1]), ins, size, ins.args[1])


def _write_overlaps(pf, ins, region) -> bool:
    m = re.match(r"\[[^\]]*\]", ins.args[0])
    if region is None or m is None:
        return True
    wrote = footprint(pf, pf.addrs.operand(m.group(0)), ins, 16, m.group(0))
    if wrote is None:
        return True
    if wrote[0] != region[0]:
        return False
    if None in wrote[1:] or None in region[1:]:
        return True
    return not (wrote[2] <= region[1] or region[2] <= wrote[1])


def check_proxy_fence(pf) -> None:
    readers = {}  # (region, the writes that count for it) -> its async-proxy readers
    for ins in pf.k.instrs:
        if _ASYNC_READ.match(ins.op):
            readers.setdefault((_read_region(pf, ins), _GENERIC_WRITE), []).append(ins)
        elif ins.op.startswith(("tcgen05.mma", "wgmma.mma_async")):
            kinds = _GENERIC_WRITE if ins.op.startswith("tcgen05") else _STAGE_WRITE
            for region in _mma_regions(pf, ins):
                readers.setdefault((region, kinds), []).append(ins)
    flagged = set()  # a reader reported once, whichever region it reads
    for (region, kinds), found in readers.items():
        _check_region(pf, region, found, flagged, kinds)


def _mma_regions(pf, ins) -> list:
    """The shared memory a ``tcgen05.mma``'s descriptors read (the async proxy): for each
    descriptor, the allocation its start address falls in (left out if not known)."""
    from .wgmma import _fields, _operands

    found = []
    for reg, _, _ in _operands(ins):
        sym = pf.addrs.value(reg)
        symbols = sym.symbols()
        if len(symbols) != 1 or sym.const.denominator != 1:
            continue
        sm100 = ins.op.startswith("tcgen05")
        alloc = allocation_at(pf, symbols[0][0], _fields(int(sym.const), sm100)["start"])
        if alloc:
            found.append((symbols[0][0], *alloc))
    return found


def _check_region(pf, region, stores, flagged, kinds) -> None:
    writes = {ins.index for ins in pf.k.instrs
              if kinds.match(ins.op) and _write_overlaps(pf, ins, region)}
    if not writes:
        return
    store_ids = {ins.index for ins in stores}
    carry = {}
    classes = pf.lanes.classes()
    for _ in range(8):  # until what the barriers carry settles
        before = dict(carry)
        for edges, lanes in classes:
            _walk(pf, edges, set(lanes), writes, store_ids, carry, flagged)
        if carry == before:
            return


def _walk(pf, edges, lanes, writes, store_ids, carry, flagged) -> None:
    k = pf.k
    dirty_in, work = {0: 0}, [0]
    while work:
        b = work.pop()
        dirty = dirty_in[b]
        for i in k.blocks[b]:
            ins = k.instrs[i]
            if not lanes & pf.lanes.at(ins):
                continue
            if i in writes:
                dirty |= PENDING if ins.op.startswith("cp.async.") else WRITTEN
            elif ins.op.startswith(("cp.async.wait_group", "cp.async.wait_all")):
                done = ins.op.startswith("cp.async.wait_all") or pf.constant(ins.args[0]) == 0
                if dirty & PENDING:  # the copies' writes are done: now they need the fence
                    dirty = (dirty & ~PENDING if done else dirty) | WRITTEN
            elif ins.op.startswith("fence.proxy.async"):
                dirty &= ~WRITTEN
            elif i in store_ids and dirty and i not in flagged:
                flagged.add(i)
                pf.fail("proxy-fence", ins, "reads shared memory that threads wrote with "
                                            "no fence.proxy.async after the writes: it may "
                                            "read stale data")
            key = _meeting_point(pf, ins)
            if key is not None:
                if dirty and (".arrive" in ins.op or "sync" in ins.op):
                    carry[key] = carry.get(key, 0) | _handed_over(ins, dirty)
                if not ins.op.startswith("mbarrier.arrive") and ".arrive" not in ins.op:
                    dirty |= carry.get(key, 0)
        for s in k.succ[b]:
            if (b, s) in edges and s != k.exit and \
                    (s not in dirty_in or dirty & ~dirty_in[s]):
                dirty_in[s] = dirty_in.get(s, 0) | dirty
                work.append(s)


def _handed_over(ins, dirty: int) -> int:
    """What a thread's writes are to the threads it meets at ``ins``: copies still in
    flight stay in flight (a fence on the other side orders nothing then), except at a
    ``cp.async.mbarrier.arrive``, which fires once the thread's copies have landed."""
    if ins.op.startswith("cp.async.mbarrier.arrive") and dirty & PENDING:
        return (dirty & ~PENDING) | WRITTEN
    return dirty


def _meeting_point(pf, ins):
    """Where a thread's writes meet another thread: a named barrier's number, or an
    mbarrier array (arrive, wait)."""
    m = _BAR_SITE.match(ins.op)
    if m:
        n = pf.constant(ins.args[0]) if ins.args else None
        return ("bar", n)
    if ins.op.startswith(("mbarrier.arrive", "mbarrier.try_wait", "mbarrier.test_wait",
                          "cp.async.mbarrier.arrive")):
        arr = pf.array_of(pf.addrs.operand(barrier_operand(ins)))
        return ("mbar", id(arr)) if arr is not None else None
    return None

