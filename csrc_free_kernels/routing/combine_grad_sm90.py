"""The combine's two gradients in one pass (SIMT; built for sm_90a).

The layer's combine is ``out[t] = sum_j w[t, j] * y[inverse[t * k + j]]``.  Its
backward, per sorted row ``r`` of slot ``s = order[r]`` (token ``t = s // k``,
``order`` the inverse permutation of ``inverse``):

- ``dy[r] = w[t, s % k] * dout[t]``, fp32 product, one rounding;
- ``dw[r] = sum_h dout[t, h] * y[r, h]``, fp32 sums (the routing weight's gradient,
  in sorted order: the caller reads it back through ``inverse``).

torch's autograd of the same formula writes the gathered, weighted gradient rows
(T k, H), then sorts them by destination and adds them into ``dy`` (index_put with
accumulate), and makes an fp32 (T k, H) product for ``dw``.  Here ``dout`` rows are
read (from L2 where tokens repeat), ``y`` once and ``dy`` written once.

One warp per sorted row: each lane takes every 32nd 16-byte vector of the row, so a
row's loads are coalesced, and the dot product ends in a 5-step butterfly (no shared
memory, no atomics: deterministic).  An ``order`` entry outside ``[0, T k)`` is a
row no slot reads: ``dy[r] = 0``, ``dw[r] = 0``.
"""

import cutlass
import cutlass.cute as cute

from ..common import pdl


class CombineGrad:
    """``(dy, dw)`` of the combine for ``dout`` (module docstring).  ``warps`` rows a CTA."""

    def __init__(self, warps: int = 4):
        if not 1 <= warps <= 32:
            raise ValueError(f"warps must be in [1, 32] (a CTA's threads), got {warps}")
        self.warps = warps

    @cute.jit
    def __call__(self, mDout: cute.Tensor, mY: cute.Tensor, mWeights: cute.Tensor,
                 mOrder: cute.Tensor, mDy: cute.Tensor, mDw: cute.Tensor, stream):
        """mDout (T, H), mY (M, H), mDy (M, H): rows of 16-byte vectors; mWeights (T, k)
        fp32; mOrder (M,) int; mDw (M,) fp32."""
        vec = 128 // mY.element_type.width
        gDout = cute.zipped_divide(mDout, (1, vec))
        gY = cute.zipped_divide(mY, (1, vec))
        gDy = cute.zipped_divide(mDy, (1, vec))
        n_vec = cute.size(mY, mode=[1]) // vec
        rows = cute.size(mY, mode=[0])
        self.kernel(gDout, gY, mWeights, mOrder, gDy, mDw, n_vec).launch(
            grid=((rows + self.warps - 1) // self.warps, 1, 1), block=(32 * self.warps, 1, 1),
            stream=stream, use_pdl=pdl.ENABLED)

    @cute.kernel
    def kernel(self, gDout: cute.Tensor, gY: cute.Tensor, mWeights: cute.Tensor,
               mOrder: cute.Tensor, gDy: cute.Tensor, mDw: cute.Tensor, n_vec: cutlass.Int32):
        pdl.enter()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        b, _, _ = cute.arch.block_idx()
        r = b * self.warps + warp
        tokens, top_k = mWeights.shape
        frag = gY[(None, (0, 0))].shape
        dtype = gY.element_type
        if r < mOrder.shape[0]:
            slot = mOrder[r]
            dot = cutlass.Float32(0.0)
            if slot >= 0 and slot < tokens * top_k:  # uniform in the warp
                t = cutlass.Int32(slot // top_k)
                w = mWeights[t, cutlass.Int32(slot - t * top_k)]
                g = cute.make_rmem_tensor(frag, cutlass.Float32)
                y = cute.make_rmem_tensor(frag, cutlass.Float32)
                for c in cutlass.range(lane, n_vec, 32, unroll=2):
                    g.store(gDout[(None, (t, c))].load().to(cutlass.Float32))
                    y.store(gY[(None, (r, c))].load().to(cutlass.Float32))
                    gDy[(None, (r, c))].store((g.load() * w).to(dtype))
                    for v in cutlass.range_constexpr(cute.size(frag)):
                        dot += g[v] * y[v]
            else:
                zero = cute.make_rmem_tensor(frag, dtype)
                zero.fill(0.0)
                for c in cutlass.range(lane, n_vec, 32, unroll=1):
                    gDy[(None, (r, c))].store(zero.load())
            for d in cutlass.range_constexpr(5):
                dot += cute.arch.shuffle_sync_bfly(dot, 1 << d)
            if lane == 0:
                mDw[r] = dot
