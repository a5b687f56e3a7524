"""The opt-in router kernels (SIMT; built for sm_90a): inside the Mixtral block they made
no difference beyond the noise on an H100 (``scripts/router_ab.py``,
bench/notes/2026-12-06-h100-run.md); ``ts_moe.ops.use_router_kernel`` switches them on.

- :class:`RouterLogits`: the router's ``logits = x @ w.T`` of a decode batch in
  one launch with fp32 sums and one rounding (cuBLAS takes two for these
  shapes: a split-K GEMM and its reduction).
- :class:`RouteTopK`: the routing of :class:`csrc_free_kernels.routing.route_sm90.RouteSlots`
  alone, a warp a token on many CTAs (for batches whose top-k rounds would
  keep one CTA busy).

Deterministic, no host sync, graph-capturable; the plain-torch reference of the
logits is ``x @ w.T`` in float64 (``tests/helpers.py``).  The torch entry points are
in :mod:`.router_sm90_launch`.
"""

import cutlass
import cutlass.cute as cute

from ..common import pdl
from .route_sm90 import MAX_EXPERTS, TokenRouting

# RouterLogits: a CTA's tile of experts x tokens (its grid's y dimension
# bounds the tokens)
ROUTER_EXPERTS_PER_CTA = 2
ROUTER_TOKENS_PER_CTA = 8
ROUTER_MAX_TOKENS = 65535 * ROUTER_TOKENS_PER_CTA


class RouterLogits:
    """``out[t, e] = sum_h x[t, h] * w[e, h]``: fp32 sums in a fixed order, one rounding.

    The router GEMV of a decode batch, x (T, H) and w (E, H) bf16/fp16 with
    16-byte rows, out (T, E) in their dtype.  Every CTA reads its experts' and
    its tokens' rows (:func:`.router_sm90_launch.router_read_bytes`), so the rows of x are read
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


class RouteTopK(TokenRouting):
    """:class:`.route_sm90.RouteSlots`'s routing phase alone, on ``ceil(T / warps)`` CTAs.

    Warp ``w`` of CTA ``b`` routes token ``b * warps + w`` (softmax, top-k,
    renormalise: :meth:`TokenRouting.route_token`, so the experts and weights
    are bit for bit those of :class:`.route_sm90.RouteSlots`) and writes ``mWeights`` and
    ``mExperts``.  The slot order then comes from :class:`.route_sm90.RouteSlots` on the
    ids (``from_logits=False``): two launches, where one CTA's top-k rounds
    would keep one SM issue-bound for many tokens (about 900 warp
    instructions a token at E = 128: bench/notes/2026-12-04-routing-packed-topk.md).
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
