"""The small kernels around the expert GEMMs of a MoE block (SIMT; built for sm_90a).

- :class:`RouterLogits`: the router's ``logits = x @ w.T`` of a decode batch in
  one launch with fp32 sums and one rounding (cuBLAS takes two for these
  shapes: a split-K GEMM and its reduction).
- :class:`RouteSlots`: Mixtral routing (softmax, top-k, renormalise) of a small
  batch and the expert order of its (token, k) slots, in one CTA and one launch,
  where ``torch`` takes a dozen (softmax, sort, slicing, a second sort,
  searchsorted, scatter, ...).  Or, from given expert ids, the slot order alone.
  :class:`RouteTopK`: its routing alone, a warp a token on many CTAs (for
  batches whose top-k rounds would keep one CTA busy).
- :class:`WeightedRowSum`: ``out[t] = sum_j w[t, j] * src[index[t * k + j]]`` in
  fp32 with one rounding: the MoE combine in one pass (torch: a gather, a
  product and a sum over (T, k, H), then a cast), and, unweighted with ``k =
  1``, the token-row gather before the first grouped GEMM.

All are deterministic (no atomics), read everything on the device (no host
sync) and capture into CUDA graphs.  The plain-torch references are
``ts_moe.routing.router_logits_reference``/``route``/
``sort_slots``/``combine`` and ``ts_moe.reference.gather_rows``.
"""

import functools

import cutlass
import cutlass.cute as cute
import torch

from . import compile as kcompile
from . import pdl

LOG2E = 1.4426950408889634
# one CTA holds the slots' expert ids in shared memory; each lane holds
# MAX_EXPERTS / 32 logits of a token
MAX_EXPERTS = 256
MAX_SLOTS = 1024
LANE_WIDTHS = (1, 2, 4, 8)  # builds of RouteSlots: up to 32, 64, 128, 256 experts
# RouterLogits: a CTA's tile of experts x tokens (its grid's y dimension
# bounds the tokens)
ROUTER_EXPERTS_PER_CTA = 2
ROUTER_TOKENS_PER_CTA = 8
ROUTER_MAX_TOKENS = 65535 * ROUTER_TOKENS_PER_CTA


class RouterLogits:
    """``out[t, e] = sum_h x[t, h] * w[e, h]``: fp32 sums in a fixed order, one rounding.

    The router GEMV of a decode batch, x (T, H) and w (E, H) bf16/fp16 with
    16-byte rows, out (T, E) in their dtype.  Every CTA reads its experts' and
    its tokens' rows (:func:`router_read_bytes`), so the rows of x are read
    ``E / experts_per_cta`` times: a kernel for small T (larger batches are
    cuBLAS's, on tensor cores; ``ts_moe.ops`` chooses).

    CTA ``(b, g)`` computes experts ``b * experts_per_cta + i`` for tokens
    ``g * tokens_per_cta + j``: a tile of ``experts_per_cta * tokens_per_cta``
    dot products.  Its threads split H into 16-byte vectors (thread ``i``:
    vectors ``i, i + threads, ...``); each loads a vector of each of its
    experts' rows once and of each token's row once, and keeps the tile's
    partial sums in registers.  Then each warp adds its lanes' sums by
    butterfly shuffles, and thread ``i`` of the tile adds the warps' sums in
    warp order and stores the result.  No roles, no pipeline: every thread
    streams, and the grid of ``ceil(E / experts_per_cta) x ceil(T /
    tokens_per_cta)`` CTAs spreads the weight rows over the SMs.
    """

    def __init__(self, experts_per_cta: int = ROUTER_EXPERTS_PER_CTA,
                 tokens_per_cta: int = ROUTER_TOKENS_PER_CTA, warps: int = 8):
        for name, value in (("experts_per_cta", experts_per_cta),
                            ("tokens_per_cta", tokens_per_cta), ("warps", warps)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if experts_per_cta * tokens_per_cta > 32 * warps:
            raise ValueError("the tile's dot products must not outnumber the CTA's threads")
        self.experts_per_cta = experts_per_cta
        self.tokens_per_cta = tokens_per_cta
        self.warps = warps
        self.threads = 32 * warps

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, stream):
        """mX (T, H), mW (E, H): rows of 16-byte vectors; mOut (T, E)."""
        vec = 128 // mX.element_type.width
        gX = cute.zipped_divide(mX, (1, vec))
        gW = cute.zipped_divide(mW, (1, vec))
        n_vec = cute.size(mX, mode=[1]) // vec
        tokens = cute.size(mOut, mode=[0])
        experts = cute.size(mOut, mode=[1])
        grid = ((experts + self.experts_per_cta - 1) // self.experts_per_cta,
                (tokens + self.tokens_per_cta - 1) // self.tokens_per_cta, 1)
        self.kernel(gX, gW, mOut, n_vec).launch(
            grid=grid, block=(self.threads, 1, 1), stream=stream, use_pdl=pdl.ENABLED)

    @cute.kernel
    def kernel(self, gX: cute.Tensor, gW: cute.Tensor, mOut: cute.Tensor,
               n_vec: cutlass.Int32):
        pdl.enter()
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        b, g, _ = cute.arch.block_idx()
        tokens, experts = mOut.shape
        n_e, n_t = self.experts_per_cta, self.tokens_per_cta
        e0 = b * n_e
        t0 = g * n_t
        frag = gX[(None, (0, 0))].shape
        acc = cute.make_rmem_tensor((n_e * n_t,), cutlass.Float32)
        acc.fill(0.0)
        w_vecs = [cute.make_rmem_tensor(frag, cutlass.Float32) for _ in range(n_e)]
        x_vec = cute.make_rmem_tensor(frag, cutlass.Float32)
        for c in cutlass.range(tidx, n_vec, self.threads, unroll=2):
            for i in cutlass.range_constexpr(n_e):  # the experts' vectors, then each token's
                w_vecs[i].fill(0.0)
                if e0 + i < experts:
                    w_vecs[i].store(gW[(None, (e0 + i, c))].load().to(cutlass.Float32))
            for j in cutlass.range_constexpr(n_t):
                if t0 + j < tokens:
                    x_vec.store(gX[(None, (t0 + j, c))].load().to(cutlass.Float32))
                    for i in cutlass.range_constexpr(n_e):
                        s = acc[i * n_t + j]
                        for v in cutlass.range_constexpr(cute.size(frag)):
                            s += w_vecs[i][v] * x_vec[v]
                        acc[i * n_t + j] = s

        smem = cutlass.utils.SmemAllocator()
        partial = smem.allocate_tensor(cutlass.Float32,
                                       cute.make_layout((n_e * n_t, self.warps)), 16)
        for d in cutlass.range_constexpr(n_e * n_t):
            if e0 + d // n_t < experts and t0 + d % n_t < tokens:  # uniform in the CTA
                s = acc[d]
                for r in cutlass.range_constexpr(5):
                    s += cute.arch.shuffle_sync_bfly(s, 1 << r)
                if lane == 0:
                    partial[d, warp] = s
        cute.arch.sync_threads()
        if tidx < n_e * n_t:
            e = e0 + tidx // n_t
            t = t0 + tidx % n_t
            if e < experts and t < tokens:
                total = cutlass.Float32(0.0)
                for w in cutlass.range_constexpr(self.warps):
                    total += partial[tidx, w]
                mOut[t, e] = total.to(mOut.element_type)


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
    other experts than torch's ``topk`` would (every weight is NaN either way).  Measured: bench/RESULTS.md, "Issue 21,
    third pass".
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


class RouteTopK(TokenRouting):
    """:class:`RouteSlots`'s routing phase alone, on ``ceil(T / warps)`` CTAs.

    Warp ``w`` of CTA ``b`` routes token ``b * warps + w`` (softmax, top-k,
    renormalise: :meth:`TokenRouting.route_token`, so the experts and weights
    are bit for bit those of :class:`RouteSlots`) and writes ``mWeights`` and
    ``mExperts``.  The slot order then comes from :class:`RouteSlots` on the
    ids (``from_logits=False``): two launches, where one CTA's top-k rounds
    would keep one SM issue-bound for many tokens (bench/RESULTS.md, "Issue
    21, fourth pass": about 900 warp instructions a token at E = 128).
    """

    def __init__(self, per_lane: int = MAX_EXPERTS // 32, warps: int = 4):
        super().__init__(per_lane)
        if not 1 <= warps <= 32:
            raise ValueError(f"warps must be in [1, 32] (a CTA's threads), got {warps}")
        self.warps = warps
        self.threads = 32 * warps

    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mWeights: cute.Tensor, mExperts: cute.Tensor,
                 stream):
        """mLogits (T, E) float, mWeights (T, k) fp32, mExperts (T, k) int64 (outputs)."""
        tokens = cute.size(mExperts, mode=[0])
        self.kernel(mLogits, mWeights, mExperts).launch(
            grid=((tokens + self.warps - 1) // self.warps, 1, 1), block=(self.threads, 1, 1),
            stream=stream, use_pdl=pdl.ENABLED)

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mWeights: cute.Tensor, mExperts: cute.Tensor):
        pdl.enter()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        b, _, _ = cute.arch.block_idx()
        tokens, top_k = mExperts.shape
        vals = cute.make_rmem_tensor((self.per_lane,), cutlass.Float32)
        keys = cute.make_rmem_tensor((self.per_lane,), cutlass.Int32)
        chosen = cute.make_rmem_tensor((self.per_lane,), cutlass.Int32)
        t = b * self.warps + warp
        if t < tokens:
            self.route_token(mLogits, mWeights, mExperts, None, vals, keys, chosen, t, lane,
                             top_k, mLogits.shape[1])


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


# ------------------------------------------------------------------ torch side
_TORCH_TO_CUTE = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
                  torch.float32: cutlass.Float32, torch.int32: cutlass.Int32,
                  torch.int64: cutlass.Int64}


def _compact(dtype, *shape):
    return cute.runtime.make_fake_compact_tensor(
        dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
        assumed_align=dtype.width // 8)


def _rows(dtype, n, h):
    """(n, h) rows of 16-byte vectors with a free row stride."""
    return cute.runtime.make_fake_tensor(
        dtype, (n, h), (cute.sym_int64(divisibility=128 // dtype.width), 1), assumed_align=16)


def router_fake_args(dtype) -> tuple:
    """x (T, H) and w (E, H) rows with free 16-byte strides; out (T, E) compact."""
    t, e, h = kcompile.sym_dims(3)
    return _rows(dtype, t, h), _rows(dtype, e, h), _compact(dtype, t, e), kcompile.fake_stream()


def route_fake_args(dtype, from_logits: bool) -> tuple:
    """Symbolic T, E, k, and T k (checked against each other on the host);
    ``dtype``: the logits' (``from_logits``) or the input ids'."""
    t, e, k, s = kcompile.sym_dims(4)
    experts = _compact(cutlass.Int64 if from_logits else dtype, t, k)
    logits = _compact(dtype, t, e) if from_logits else None
    weights = _compact(cutlass.Float32, t, k) if from_logits else None
    return (logits, weights, experts, _compact(cutlass.Int32, s), _compact(cutlass.Int32, e),
            _compact(cutlass.Int64, s), kcompile.fake_stream())


def topk_fake_args(dtype) -> tuple:
    """Symbolic T, E, k: logits (T, E) of ``dtype``, weights and experts (T, k)."""
    t, e, k = kcompile.sym_dims(3)
    return (_compact(dtype, t, e), _compact(cutlass.Float32, t, k), _compact(cutlass.Int64, t, k),
            kcompile.fake_stream())


def rowsum_fake_args(dtype, index_dtype, weighted: bool) -> tuple:
    """(M, H) source and (T, H) output rows with free 16-byte strides; (R,) index;
    (T, k) weights when ``weighted`` (else R = T)."""
    m, h, t = kcompile.sym_dims(3)
    r, k = kcompile.sym_dims(2) if weighted else (t, None)
    weights = _compact(cutlass.Float32, t, k) if weighted else None
    return (_rows(dtype, m, h), _compact(index_dtype, r), weights, _rows(dtype, t, h),
            kcompile.fake_stream())


def lane_width(num_experts: int) -> int:
    """The :class:`RouteSlots` build for ``num_experts``: logits per lane."""
    return next(w for w in LANE_WIDTHS if 32 * w >= num_experts)


@functools.cache
def _router_kernel(dtype: torch.dtype):
    key = ("RouterLogits", str(dtype), "sm_90a")
    return kcompile.get_compiled(key, lambda: (RouterLogits(),
                                               router_fake_args(_TORCH_TO_CUTE[dtype])))


@functools.cache
def _route_kernel(from_logits: bool, dtype: torch.dtype, per_lane: int = 1):
    key = ("RouteSlots", from_logits, str(dtype), per_lane, "sm_90a")

    def build():
        return (RouteSlots(from_logits, per_lane),
                route_fake_args(_TORCH_TO_CUTE[dtype], from_logits))

    return kcompile.get_compiled(key, build)


@functools.cache
def _topk_kernel(dtype: torch.dtype, per_lane: int):
    key = ("RouteTopK", str(dtype), per_lane, "sm_90a")
    return kcompile.get_compiled(key, lambda: (RouteTopK(per_lane),
                                               topk_fake_args(_TORCH_TO_CUTE[dtype])))


@functools.cache
def _rowsum_kernel(weighted: bool, dtype: torch.dtype, index_dtype: torch.dtype):
    key = ("WeightedRowSum", weighted, str(dtype), str(index_dtype), "sm_90a")

    def build():
        return WeightedRowSum(weighted), rowsum_fake_args(
            _TORCH_TO_CUTE[dtype], _TORCH_TO_CUTE[index_dtype], weighted)

    return kcompile.get_compiled(key, build)


def fits(slots: int, num_experts: int) -> bool:
    """Whether :func:`route_slots` / :func:`sort_slots` take a batch of this size."""
    return 0 < slots <= MAX_SLOTS and 0 < num_experts <= MAX_EXPERTS


def _check_fits(slots: int, num_experts: int) -> None:
    """The one CTA holds every slot and expert in shared memory: a batch past
    that would run off its tables (the ops check :func:`fits` and take the torch
    path instead; this guards the module's own entries)."""
    if not fits(slots, num_experts):
        raise ValueError(f"the routing kernel takes 1 to {MAX_SLOTS} slots and 1 to "
                         f"{MAX_EXPERTS} experts, got {slots} slots and {num_experts} experts")


def _check_top_k(top_k: int, num_experts: int) -> None:
    """Each top-k round takes a new expert."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the experts), got {top_k}")


def router_read_bytes(tokens: int, experts: int, hidden: int) -> int:
    """The bytes :class:`RouterLogits`'s CTAs read (from L2 and HBM): each its
    experts' rows and its tokens' rows, of 16-bit elements."""
    ctas_e = -(-experts // ROUTER_EXPERTS_PER_CTA)
    ctas_t = -(-tokens // ROUTER_TOKENS_PER_CTA)
    rows = (min(experts, ROUTER_EXPERTS_PER_CTA) + min(tokens, ROUTER_TOKENS_PER_CTA))
    return ctas_e * ctas_t * rows * hidden * 2


def router_logits(x: torch.Tensor, weight: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` (T, E) in x's dtype: x (T, H) and weight (E, H) bf16/fp16
    with 16-byte rows (H a multiple of 8, row strides too), ``out`` (T, E)
    contiguous or None; on the current stream."""
    tokens, hidden = x.shape
    if not 0 < tokens <= ROUTER_MAX_TOKENS:
        raise ValueError(f"the router kernel takes 1 to {ROUTER_MAX_TOKENS} tokens, "
                         f"got {tokens}")
    if hidden % 8 or weight.shape[1] != hidden:
        raise ValueError(f"x (T, H) and weight (E, H) need one H, a multiple of 8: got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if out is None:
        out = torch.empty(tokens, weight.shape[0], dtype=x.dtype, device=x.device)
    if weight.shape[0]:
        _router_kernel(x.dtype)(x, weight, out)
    return out


def route_slots(logits: torch.Tensor, top_k: int):
    """(weights, experts, token_index, offs, inverse) of a batch that :func:`fits`;
    ``logits`` (T, E) contiguous, on the current stream.  ``ts_moe.route`` and
    ``ts_moe.sort_slots`` in one launch."""
    tokens, num_experts = logits.shape
    _check_fits(tokens * top_k, num_experts)
    _check_top_k(top_k, num_experts)
    dev = logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=dev)
    experts = torch.empty(tokens, top_k, dtype=torch.int64, device=dev)
    token_index = torch.empty(tokens * top_k, dtype=torch.int32, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    inverse = torch.empty(tokens * top_k, dtype=torch.int64, device=dev)
    _route_kernel(True, logits.dtype, lane_width(num_experts))(
        logits, weights, experts, token_index, offs, inverse)
    return weights, experts, token_index, offs, inverse


def route_topk(logits: torch.Tensor, top_k: int, weights: torch.Tensor | None = None,
               experts: torch.Tensor | None = None):
    """(weights (T, k) fp32, experts (T, k) int64): ``ts_moe.route`` of ``logits``
    (T, E) contiguous, E <= MAX_EXPERTS, a warp a token on many CTAs; the
    experts and weights of :func:`route_slots`, bit for bit.  ``weights`` and
    ``experts``: contiguous outputs to write, or None."""
    tokens, num_experts = logits.shape
    if not 0 < num_experts <= MAX_EXPERTS:
        raise ValueError(f"the routing kernel takes 1 to {MAX_EXPERTS} experts, "
                         f"got {num_experts}")
    _check_top_k(top_k, num_experts)
    dev = logits.device
    if weights is None:
        weights = torch.empty(tokens, top_k, dtype=torch.float32, device=dev)
    if experts is None:
        experts = torch.empty(tokens, top_k, dtype=torch.int64, device=dev)
    if tokens:
        _topk_kernel(logits.dtype, lane_width(num_experts))(logits, weights, experts)
    return weights, experts


def sort_slots(experts: torch.Tensor, num_experts: int):
    """(token_index, offs, inverse) of ``experts`` (T, k) int32/int64 contiguous,
    a batch that :func:`fits`: ``ts_moe.sort_slots`` in one launch."""
    slots = experts.numel()
    _check_fits(slots, num_experts)
    dev = experts.device
    token_index = torch.empty(slots, dtype=torch.int32, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    inverse = torch.empty(slots, dtype=torch.int64, device=dev)
    _route_kernel(False, experts.dtype)(None, None, experts, token_index, offs, inverse)
    return token_index, offs, inverse


def weighted_row_sum(src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None,
                     out: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * src[index[t * k + j]]`` (``weights`` None:
    ``out[t] = src[index[t]]``); rows 16-byte aligned, H a multiple of 8."""
    if out.shape[0] and out.shape[1]:
        _rowsum_kernel(weights is not None, src.dtype, index.dtype)(src, index, weights, out)
    return out
