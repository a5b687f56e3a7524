"""The small kernels around the expert GEMMs of a MoE block (SIMT; built for sm_90a).

- :class:`RouteSlots`: Mixtral routing (softmax, top-k, renormalise) of a small
  batch and the expert order of its (token, k) slots, in one CTA and one launch,
  where ``torch`` takes a dozen (softmax, sort, slicing, a second sort,
  searchsorted, scatter, ...).  Or, from given expert ids, the slot order alone.
- :class:`WeightedRowSum`: ``out[t] = sum_j w[t, j] * src[index[t * k + j]]`` in
  fp32 with one rounding: the MoE combine in one pass (torch: a gather, a
  product and a sum over (T, k, H), then a cast), and, unweighted with ``k =
  1``, the token-row gather before the first grouped GEMM.

Both are deterministic (no atomics), read everything on the device (no host
sync) and capture into CUDA graphs.  The plain-torch references are
``ts_moe.routing.route``/``sort_slots``/``combine`` and
``ts_moe.reference.gather_rows``.
"""

import functools
import math

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


class RouteSlots:
    """Routing and slot order of a small batch in one CTA of ``threads`` threads.

    ``T`` tokens, ``E <= MAX_EXPERTS`` experts, ``k`` experts per token, ``T * k
    <= MAX_SLOTS`` slots (slot ``s`` is token ``s // k``'s ``s % k``-th choice).

    1. ``from_logits``: warp ``w`` routes tokens ``w, w + warps, ...``: each
       lane holds ``E / 32`` of the token's logits in fp32; the max and the
       softmax sum by butterfly shuffles; then ``k`` rounds of a warp argmax
       over the logits not yet taken (ties: the lower expert, as
       ``ts_moe.route``); weight = softmax probability / the sum of the
       chosen ones.  Selecting on the logits, not on the rounded
       probabilities, is exact.  Otherwise the ids are read from ``experts``.
       The ids go to shared memory.
    2. ``offs[e]`` = the number of slots with id ``<= e`` (one thread per expert).
    3. slot ``s`` with id ``e`` goes to position ``#{ids < e} + #{earlier slots
       with id e}``: a stable sort of the ids (ids ``>= E`` land after
       ``offs[-1]``); ``token_index[pos] = s // k``, ``inverse[s] = pos``.

    Phases 2 and 3 scan the ids in shared memory (every thread reads the same
    entry: a broadcast): ``O(T k (E + T k) / threads)`` steps, a few
    microseconds at the largest batch.
    """

    def __init__(self, from_logits: bool, threads: int = 512):
        self.from_logits = from_logits
        self.threads = threads
        self.per_lane = MAX_EXPERTS // 32

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
        tokens, top_k = mExperts.shape
        num_experts = mOffs.shape[0]
        slots = mInverse.shape[0]
        smem = cutlass.utils.SmemAllocator()
        ids = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_SLOTS), 16)

        if cutlass.const_expr(self.from_logits):
            vals = cute.make_rmem_tensor((self.per_lane,), cutlass.Float32)
            for t in cutlass.range(warp, tokens, self.threads // 32, unroll=1):
                self.route_token(mLogits, mWeights, mExperts, ids, vals, t, lane, top_k,
                                 num_experts)
        else:
            for s in cutlass.range(tidx, slots, self.threads, unroll=1):
                e = mExperts[s // top_k, s % top_k]
                # the comparisons below are in 32 bits: clamp (ids are >= 0 and
                # sentinels >= E in every caller)
                e = cutlass.max(cutlass.min(e, 2**31 - 1), -(2**31))
                ids[s] = cutlass.Int32(e)
        cute.arch.sync_threads()

        for e in cutlass.range(tidx, num_experts, self.threads, unroll=1):
            count = cutlass.Int32(0)
            for s in cutlass.range(slots, unroll=1):
                if ids[s] <= e:
                    count += 1
            mOffs[e] = count

        for s in cutlass.range(tidx, slots, self.threads, unroll=1):
            e = ids[s]
            pos = cutlass.Int32(0)
            for s2 in cutlass.range(slots, unroll=1):
                other = ids[s2]
                if other < e:
                    pos += 1
                if other == e:
                    if s2 < s:
                        pos += 1
            mTokenIndex[pos] = s // top_k
            mInverse[s] = cutlass.Int64(pos)

    @cute.jit
    def route_token(self, mLogits, mWeights, mExperts, ids, vals, t, lane, top_k, num_experts):
        """One warp: token ``t``'s top-k experts and weights (lane 0 writes them)."""
        neg_inf = -math.inf
        best = cutlass.Float32(neg_inf)
        for j in cutlass.range_constexpr(self.per_lane):
            v = cutlass.Float32(neg_inf)
            if lane + 32 * j < num_experts:
                v = mLogits[t, lane + 32 * j].to(cutlass.Float32)
            vals[j] = v
            best = cutlass.max(best, v)
        for d in cutlass.range_constexpr(5):
            best = cutlass.max(best, cute.arch.shuffle_sync_bfly(best, 1 << d))
        denom = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(self.per_lane):
            if lane + 32 * j < num_experts:
                denom += cute.math.exp2((vals[j] - best) * LOG2E)
        for d in cutlass.range_constexpr(5):
            denom += cute.arch.shuffle_sync_bfly(denom, 1 << d)

        taken = cutlass.Int32(0)
        total = cutlass.Float32(0.0)
        for r in cutlass.range(top_k, unroll=1):
            # this lane's best logit not yet taken (the lower expert on ties) ...
            bv = cutlass.Float32(neg_inf)
            be = num_experts
            for j in cutlass.range_constexpr(self.per_lane):
                if lane + 32 * j < num_experts:
                    if (taken >> j) & 1 == 0:
                        if be == num_experts or vals[j] > bv:
                            bv = vals[j]
                            be = lane + 32 * j
            # ... then the warp's
            for d in cutlass.range_constexpr(5):
                ov = cute.arch.shuffle_sync_bfly(bv, 1 << d)
                oe = cute.arch.shuffle_sync_bfly(be, 1 << d)
                if oe < num_experts:
                    if be == num_experts or ov > bv or (ov == bv and oe < be):
                        bv = ov
                        be = oe
            if lane == be % 32:
                taken = taken | (1 << (be // 32))
            prob = cute.math.exp2((bv - best) * LOG2E) / denom
            total += prob
            if lane == 0:
                mWeights[t, r] = prob
                mExperts[t, r] = cutlass.Int64(be)
                ids[t * top_k + r] = be
        if lane == 0:
            for r in cutlass.range(top_k, unroll=1):
                mWeights[t, r] = mWeights[t, r] / total


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


def route_fake_args(dtype, from_logits: bool) -> tuple:
    """Symbolic T, E, k, and T k (checked against each other on the host);
    ``dtype``: the logits' (``from_logits``) or the input ids'."""
    t, e, k, s = kcompile.sym_dims(4)
    experts = _compact(cutlass.Int64 if from_logits else dtype, t, k)
    logits = _compact(dtype, t, e) if from_logits else None
    weights = _compact(cutlass.Float32, t, k) if from_logits else None
    return (logits, weights, experts, _compact(cutlass.Int32, s), _compact(cutlass.Int32, e),
            _compact(cutlass.Int64, s), kcompile.fake_stream())


def rowsum_fake_args(dtype, index_dtype, weighted: bool) -> tuple:
    """(M, H) source and (T, H) output rows with free 16-byte strides; (R,) index;
    (T, k) weights when ``weighted`` (else R = T)."""
    m, h, t = kcompile.sym_dims(3)
    r, k = kcompile.sym_dims(2) if weighted else (t, None)

    def rows(n):
        return cute.runtime.make_fake_tensor(
            dtype, (n, h), (cute.sym_int64(divisibility=128 // dtype.width), 1), assumed_align=16)

    weights = _compact(cutlass.Float32, t, k) if weighted else None
    return rows(m), _compact(index_dtype, r), weights, rows(t), kcompile.fake_stream()


@functools.cache
def _route_kernel(from_logits: bool, dtype: torch.dtype):
    key = ("RouteSlots", from_logits, str(dtype), "sm_90a")

    def build():
        return RouteSlots(from_logits), route_fake_args(_TORCH_TO_CUTE[dtype], from_logits)

    return kcompile.get_compiled(key, build)


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


def route_slots(logits: torch.Tensor, top_k: int):
    """(weights, experts, token_index, offs, inverse) of a batch that :func:`fits`;
    ``logits`` (T, E) contiguous, on the current stream.  ``ts_moe.route`` and
    ``ts_moe.sort_slots`` in one launch."""
    tokens, num_experts = logits.shape
    dev = logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=dev)
    experts = torch.empty(tokens, top_k, dtype=torch.int64, device=dev)
    token_index = torch.empty(tokens * top_k, dtype=torch.int32, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    inverse = torch.empty(tokens * top_k, dtype=torch.int64, device=dev)
    _route_kernel(True, logits.dtype)(logits, weights, experts, token_index, offs, inverse)
    return weights, experts, token_index, offs, inverse


def sort_slots(experts: torch.Tensor, num_experts: int):
    """(token_index, offs, inverse) of ``experts`` (T, k) int32/int64 contiguous,
    a batch that :func:`fits`: ``ts_moe.sort_slots`` in one launch."""
    slots = experts.numel()
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
