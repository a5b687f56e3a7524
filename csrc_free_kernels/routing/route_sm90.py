"""The small kernels around the expert GEMMs of a MoE block (SIMT; built for sm_90a).

- :class:`RouteSlots`: Mixtral routing (softmax, top-k, renormalise) of a small
  batch and the expert order of its (token, k) slots, in one CTA and one launch,
  where ``torch`` takes a dozen (softmax, sort, slicing, a second sort,
  searchsorted, scatter, ...).  Or, from given expert ids, the slot order alone.
- :class:`WeightedRowSum`: ``out[t] = sum_j w[t, j] * src[index[t * k + j]]`` in
  fp32 with one rounding: the MoE combine in one pass (torch: a gather, a
  product and a sum over (T, k, H), then a cast), and, unweighted with ``k =
  1``, the token-row gather before the first grouped GEMM.

All are deterministic (no atomics), read everything on the device (no host
sync) and capture into CUDA graphs.  The plain-torch references are
``ts_moe.reference.route``/``sort_slots``/``combine`` and
``ts_moe.reference.gather_rows``; the torch entry points are in
:mod:`.route_sm90_launch`.  The opt-in router kernels (the logits GEMV, and
the routing alone on many CTAs) are in :mod:`.router_sm90`.
"""

import cutlass
import cutlass.cute as cute

from ..common import pdl
LOG2E = 1.4426950408889634
# one CTA holds the slots' expert ids in shared memory; each lane holds
# MAX_EXPERTS / 32 logits of a token
MAX_EXPERTS = 256
MAX_SLOTS = 1024
LANE_WIDTHS = (1, 2, 4, 8)  # builds of RouteSlots: up to 32, 64, 128, 256 experts


class TokenRouting:
    """Mixtral routing of one token by one warp (:meth:`route_token`), as the
    routing kernels run it: ``per_lane`` logits per lane, so ``E <= 32 *
    per_lane`` (each top-k round scans them all)."""

    def __init__(self, per_lane: int):
        if per_lane not in LANE_WIDTHS:
            raise ValueError(f"per_lane must be one of {LANE_WIDTHS}, got {per_lane}")
        self.per_lane = per_lane

    @cute.jit
    def route_token(self, mLogits, mWeights, mExperts, ids, vals, keys, chosen, t, lane,
                    top_k, num_experts):
        """One warp: token ``t``'s top-k experts and weights.

        Each logit becomes an order-preserving int32 key (-0.0 as +0.0: the two
        tie), so a round's argmax is a warp reduction (``redux.sync``).  bf16
        logits: a key's low 16 bits carry nothing (an fp32 made from a bf16
        has zeros there, or ones once ordered), so the key's top half and
        ``0xFFFF - expert`` pack into one int32 whose maximum is the largest
        logit and, on ties, the lowest expert: one reduction per round.  Other
        dtypes: two (the largest key, then the lowest expert holding it).
        Round ``r``'s choice stays with lane ``r % 32`` (register ``r // 32``);
        the weights are computed from them once all rounds are done."""
        packed = cutlass.const_expr(mLogits.element_type == cutlass.BFloat16)
        low = -(2**31)  # below every key: an expert past E, or one taken
        lane_max = cutlass.Int32(low)
        for j in cutlass.range_constexpr(self.per_lane):
            key = cutlass.Int32(low)
            if lane + 32 * j < num_experts:
                v = mLogits[t, lane + 32 * j].to(cutlass.Float32)
                key = _ordered_key(v.bitcast(cutlass.Int32))
                if cutlass.const_expr(packed):
                    key = (key & _KEY_TOP) | (0xFFFF - (lane + 32 * j))
            keys[j] = key
            lane_max = cutlass.max(lane_max, key)
        top = cute.arch.warp_redux_sync(lane_max, "max")  # the largest logit's key
        best = _key_value(top, packed)
        denom = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(self.per_lane):
            if lane + 32 * j < num_experts:
                denom += cute.math.exp2((_key_value(keys[j], packed) - best) * LOG2E)
        for d in cutlass.range_constexpr(5):
            denom += cute.arch.shuffle_sync_bfly(denom, 1 << d)

        for r in cutlass.range(top_k, unroll=1):
            choice = cutlass.Int32(0)  # packed: the key; else the expert
            value = cutlass.Float32(0.0)  # not packed: the chosen logit
            if cutlass.const_expr(packed):
                if r > 0:
                    lane_max = cutlass.Int32(low)
                    for j in cutlass.range_constexpr(self.per_lane):
                        lane_max = cutlass.max(lane_max, keys[j])
                    top = cute.arch.warp_redux_sync(lane_max, "max")
                choice = top
                for j in cutlass.range_constexpr(self.per_lane):  # unique: it holds e
                    if keys[j] == top:
                        keys[j] = cutlass.Int32(low)
            else:
                # this lane's largest key (the lower expert on ties) ...
                lane_key = cutlass.Int32(low)
                lane_expert = cutlass.Int32(2**31 - 1)
                for j in cutlass.range_constexpr(self.per_lane):
                    if keys[j] > lane_key:
                        lane_key = keys[j]
                        lane_expert = lane + 32 * j
                # ... then the warp's, and the lowest expert that holds it
                key = cute.arch.warp_redux_sync(lane_key, "max")
                if lane_key != key:
                    lane_expert = cutlass.Int32(2**31 - 1)
                choice = cute.arch.warp_redux_sync(lane_expert, "min")
                if lane == choice % 32:
                    for j in cutlass.range_constexpr(self.per_lane):
                        if choice // 32 == j:
                            keys[j] = cutlass.Int32(low)
                value = _key_value(key, packed)
            if r < 32:  # warp-uniform; k <= 32 in every model
                if lane == r:
                    chosen[0] = choice
                    vals[0] = value
            elif lane == r % 32:
                for j in cutlass.range_constexpr(1, self.per_lane):
                    if r // 32 == j:
                        chosen[j] = choice
                        vals[j] = value

        total = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(self.per_lane):
            if lane + 32 * j < top_k:
                v = vals[j]
                if cutlass.const_expr(packed):
                    v = _key_value(chosen[j], True)
                    chosen[j] = 0xFFFF - (chosen[j] & 0xFFFF)
                vals[j] = cute.math.exp2((v - best) * LOG2E) / denom
                total += vals[j]
        for d in cutlass.range_constexpr(5):
            total += cute.arch.shuffle_sync_bfly(total, 1 << d)
        for j in cutlass.range_constexpr(self.per_lane):
            r = lane + 32 * j
            if r < top_k:
                mWeights[t, r] = vals[j] / total
                mExperts[t, r] = cutlass.Int64(chosen[j])
                if cutlass.const_expr(ids is not None):
                    ids[t * top_k + r] = chosen[j]


class RouteSlots(TokenRouting):
    """Routing and slot order of a small batch in one CTA of ``threads`` threads.

    ``T`` tokens, ``E <= MAX_EXPERTS`` experts, ``k`` experts per token, ``T * k
    <= MAX_SLOTS`` slots (slot ``s`` is token ``s // k``'s ``s % k``-th choice).

    1. ``from_logits``: warp ``w`` routes tokens ``w, w + warps, ...``: each
       lane holds ``E / 32`` of the token's logits as order-preserving int32
       keys; the softmax max and sum by warp reductions; then ``k`` rounds of
       a warp argmax over the keys not yet taken, two ``redux.sync`` each (the
       largest key, then the lowest expert holding it: ties go to the lower
       expert, as in ``ts_moe.route``).  Round ``r``'s expert stays in the
       registers of lane ``r % 32``, which writes weight = probability / the
       sum of the chosen ones once all rounds are done (no global round trip).
       Selecting on the logits, as ``ts_moe.route`` does, is exact (fp32
       probabilities can tie where the logits do not).
       Otherwise the ids are read from ``experts``.  The ids go to shared
       memory.
    2. Each warp takes chunks of 32 slots: a slot's rank among the earlier
       slots of its chunk with the same id (``match.any.sync``, ``popc``), and
       the chunk's count of each id (written by the id's last slot in the
       chunk).
    3. Thread ``e`` turns its column of chunk counts into an exclusive prefix
       over the chunks and the expert's total; a block scan of the totals
       gives ``offs[e]`` = the number of slots with id ``<= e``.
    4. Slot ``s`` with id ``e < E`` goes to position ``offs[e - 1] + (slots of
       id e in earlier chunks) + (its rank in its chunk)``: a stable sort of
       the ids.  Ids outside ``[0, E)`` (dropped slots: ``-1`` or
       expert-parallel sentinels) are read as ``E`` and sort after
       ``offs[-1]`` in slot order, by a scan of all the ids (rare), as
       ``ts_moe.reference.sort_slots`` orders them.
       ``token_index[pos] = s // k``, ``inverse[s] = pos``.

    Deterministic (no atomics); every phase is a few shuffles or a short scan
    of shared memory per thread.  Outside the contract: NaN logits choose
    other experts than torch's ``topk`` would (every weight is NaN either way).
    Measured: bench/notes/2026-12-04-routing-linear-scan.md.
    """

    def __init__(self, from_logits: bool, per_lane: int = MAX_EXPERTS // 32,
                 threads: int = 1024):
        super().__init__(per_lane)
        self.from_logits = from_logits
        self.threads = threads
        self.chunks = MAX_SLOTS // 32
        if threads < MAX_EXPERTS or threads % 32:
            raise ValueError(f"RouteSlots needs whole warps and a thread per expert "
                             f"(>= {MAX_EXPERTS}), got {threads} threads")

    @cute.jit
    def __call__(self, mLogits, mWeights, mExperts: cute.Tensor, mTokenIndex: cute.Tensor,
                 mOffs: cute.Tensor, mInverse: cute.Tensor, stream):
        """mLogits (T, E) float, mWeights (T, k) fp32, mExperts (T, k) int64 (outputs
        with ``from_logits``; else mLogits/mWeights None and mExperts the input ids),
        mTokenIndex (T k,) int32, mOffs (E,) int32, mInverse (T k,) int64."""
        self.kernel(mLogits, mWeights, mExperts, mTokenIndex, mOffs, mInverse).launch(
            grid=(1, 1, 1), block=(self.threads, 1, 1), stream=stream, use_pdl=pdl.ENABLED)

    @cute.kernel
    def kernel(self, mLogits, mWeights, mExperts: cute.Tensor, mTokenIndex: cute.Tensor,
               mOffs: cute.Tensor, mInverse: cute.Tensor):
        pdl.enter()
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        warps = self.threads // 32
        tokens, top_k = mExperts.shape
        num_experts = mOffs.shape[0]
        slots = mInverse.shape[0]
        smem = cutlass.utils.SmemAllocator()
        ids = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_SLOTS), 16)
        rank = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_SLOTS), 16)
        # (expert, chunk): the chunk's slots of the expert, then the expert's
        # slots in the chunks before
        hist = smem.allocate_tensor(cutlass.Int32,
                                    cute.make_layout((MAX_EXPERTS, self.chunks)), 16)
        excl = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_EXPERTS), 16)
        warp_total = smem.allocate_tensor(cutlass.Int32, cute.make_layout(32), 16)
        negative = smem.allocate_tensor(cutlass.Int32, cute.make_layout(self.chunks), 16)

        if cutlass.const_expr(self.from_logits):
            vals = cute.make_rmem_tensor((self.per_lane,), cutlass.Float32)
            keys = cute.make_rmem_tensor((self.per_lane,), cutlass.Int32)
            chosen = cute.make_rmem_tensor((self.per_lane,), cutlass.Int32)
            for t in cutlass.range(warp, tokens, warps, unroll=1):
                self.route_token(mLogits, mWeights, mExperts, ids, vals, keys, chosen, t,
                                 lane, top_k, num_experts)
        else:
            for s in cutlass.range(tidx, slots, self.threads, unroll=1):
                e = mExperts[s // top_k, s % top_k]
                # an id outside [0, E) is a dropped slot: all of them share the
                # id E, so they sort after offs[-1] in slot order
                eid = cutlass.Int32(num_experts)
                if e >= 0 and e < num_experts:
                    eid = cutlass.Int32(e)
                ids[s] = eid
        chunks = (slots + 31) // 32
        for i in cutlass.range(tidx, num_experts * chunks, self.threads, unroll=1):
            hist[i % num_experts, i // num_experts] = 0
        cute.arch.sync_threads()

        # 2. ranks within each chunk of 32 slots, and the chunks' counts
        for c in cutlass.range(warp, chunks, warps, unroll=1):
            s = c * 32 + lane
            e = cutlass.Int32(-1)
            if s < slots:
                e = ids[s]
            same = cute.arch.match_sync(0xFFFFFFFF, e, "any")  # lanes holding e
            before = cutlass.Int32(cute.arch.popc(same & cute.arch.lanemask_lt()))
            after = cutlass.Int32(cute.arch.popc(same & cute.arch.lanemask_gt()))
            below = cutlass.Int32(0)  # ids < 0 (invalid, but sorted as torch sorts them)
            if s < slots:
                rank[s] = before
                if e < 0:
                    below = cutlass.Int32(1)
                if e >= 0 and e < num_experts and after == 0:
                    hist[e, c] = before + 1
            for d in cutlass.range_constexpr(5):
                below += cute.arch.shuffle_sync_bfly(below, 1 << d)
            if lane == 0:
                negative[c] = below
        cute.arch.sync_threads()

        # 3. per expert: counts of the chunks before, the total; offs by a block scan
        count = cutlass.Int32(0)
        low = cutlass.Int32(0)
        for c in cutlass.range(chunks, unroll=1):
            low += negative[c]
        if tidx < num_experts:
            for c in cutlass.range(chunks, unroll=1):
                n = hist[tidx, c]
                hist[tidx, c] = count
                count += n
        incl = count
        for d in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(incl, 1 << d)
            if lane >= (1 << d):
                incl += other
        if lane == 31:
            warp_total[warp] = incl
        cute.arch.sync_threads()
        if tidx < num_experts:
            for w in cutlass.range(warp, unroll=1):
                incl += warp_total[w]
            mOffs[tidx] = low + incl
            excl[tidx] = low + incl - count
        cute.arch.sync_threads()

        # 4. positions
        for s in cutlass.range(tidx, slots, self.threads, unroll=1):
            e = ids[s]
            pos = cutlass.Int32(0)
            if e >= 0 and e < num_experts:
                pos = excl[e] + hist[e, s // 32] + rank[s]
            else:
                for s2 in cutlass.range(slots, unroll=1):
                    other = ids[s2]
                    if other < e:
                        pos += 1
                    if other == e:
                        if s2 < s:
                            pos += 1
            mTokenIndex[pos] = s // top_k
            mInverse[s] = cutlass.Int64(pos)

_KEY_TOP = -(1 << 16)  # 0xFFFF0000: a key's top half


@cute.jit
def _key_value(key: cutlass.Int32, packed: cutlass.Constexpr) -> cutlass.Float32:
    """The logit of an ordered key (``packed``: of a packed key's top half; the low
    half of an ordered bf16 key is all zeros, or all ones below zero)."""
    if cutlass.const_expr(packed):
        key = key & _KEY_TOP
        if key < 0:
            key = key | 0xFFFF
    return _ordered_key(key).bitcast(cutlass.Float32)


@cute.jit
def _ordered_key(bits: cutlass.Int32) -> cutlass.Int32:
    """An fp32's bits as an int32 that orders as the floats do (and back: the map
    is its own inverse); -0.0 maps to +0.0's 0."""
    key = bits
    if bits < 0:
        key = bits ^ (2**31 - 1)
        if bits == -(2**31):  # -0.0
            key = cutlass.Int32(0)
    return key


class WeightedRowSum:
    """``out[t] = sum_j w[t, j] * src[index[t * k + j]]``, fp32 sums, one rounding.

    ``weighted`` False: ``k = 1`` and no weights, a row gather (exact).  A row
    index outside ``[0, M)`` adds nothing (a gathered row of zeros).

    One thread per 16-byte vector of an output row: CTA ``(t, c)`` writes
    vectors ``c * threads ...`` of row ``t``; each thread loads its ``k``
    source vectors (``ld.global.v4``), sums them in fp32 and stores once.
    Rows are 16-byte aligned with a free stride, the last dim contiguous.
    """

    def __init__(self, weighted: bool, threads: int = 128):
        self.weighted = weighted
        self.threads = threads

    @cute.jit
    def __call__(self, mSrc: cute.Tensor, mIndex: cute.Tensor, mWeights, mOut: cute.Tensor,
                 stream):
        """mSrc (M, H), mIndex (T k,), mWeights (T, k) fp32 or None, mOut (T, H)."""
        vec = 128 // mSrc.element_type.width
        gSrc = cute.zipped_divide(mSrc, (1, vec))
        gOut = cute.zipped_divide(mOut, (1, vec))
        n_vec = cute.size(mOut, mode=[1]) // vec
        rows = cute.size(mOut, mode=[0])
        self.kernel(gSrc, mIndex, mWeights, gOut, cute.size(mSrc, mode=[0]), n_vec).launch(
            grid=(rows, (n_vec + self.threads - 1) // self.threads, 1),
            block=(self.threads, 1, 1), stream=stream, use_pdl=pdl.ENABLED)

    @cute.kernel
    def kernel(self, gSrc: cute.Tensor, mIndex: cute.Tensor, mWeights, gOut: cute.Tensor,
               m_rows: cutlass.Int32, n_vec: cutlass.Int32):
        pdl.enter()
        tidx, _, _ = cute.arch.thread_idx()
        t, c, _ = cute.arch.block_idx()
        col = c * self.threads + tidx
        dtype = gSrc.element_type
        if col < n_vec:
            if cutlass.const_expr(self.weighted):
                top_k = mWeights.shape[1]
                acc = cute.make_rmem_tensor(gOut[(None, (0, 0))].shape, cutlass.Float32)
                acc.fill(0.0)
                for j in cutlass.range(top_k, unroll=1):
                    row = mIndex[t * top_k + j]
                    if row >= 0 and row < m_rows:
                        v = gSrc[(None, (cutlass.Int32(row), col))].load()
                        acc.store(acc.load() + v.to(cutlass.Float32) * mWeights[t, j])
                gOut[(None, (t, col))].store(acc.load().to(dtype))
            else:
                frag = cute.make_rmem_tensor(gOut[(None, (0, 0))].shape, dtype)
                frag.fill(0.0)
                row = mIndex[t]
                if row >= 0 and row < m_rows:
                    frag.store(gSrc[(None, (cutlass.Int32(row), col))].load())
                gOut[(None, (t, col))].store(frag.load())
