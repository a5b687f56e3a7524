"""Activation quantization to e4m3 for the FP8 grouped GEMM (sm_90a), one launch.

``x`` (M, K) bf16 / fp16 / fp32, row-major -> ``q`` (M, K) ``float8_e4m3fn`` and fp32
dequantization scales, ``scale = amax / 448`` per group, ``q = satfinite_rn(x / scale)``
(a group of zeros: scale 0 and zeros, never NaN):

- ``blockwise_1x128``: a group is 128 consecutive elements of a row; the scales are
  written M-major, (M, K/128) with strides ``(1, Mp)``: the layout the GEMM's TMA reads
  (``grouped_gemm_fp8_sm90``'s module docstring);
- ``rowwise``: a group is a row, scales (M,);
- ``tensorwise``: one group; its amax comes in (a device tensor), the kernel divides by
  ``amax / 448`` and CTA 0 writes that scale (the scale returned is the divisor used:
  torch's ``amax / 448.0`` on CUDA multiplies by a rounded reciprocal instead, one ulp
  off for about half the amaxes; ``bench/notes/2026-12-06-fp8-first-gpu-pass.md``).

Every scale is ``div.rn.f32(amax, 448)`` and every element ``div.rn.f32(x, scale)``:
IEEE divisions, equal bit for bit to torch's tensor division on the CPU and on CUDA.

See :class:`QuantizeFp8Sm90` for how the threads share the work.
"""

import cutlass
import cutlass.cute as cute

from ..common import pdl
from ..common.formats import FORMATS

FP8_MAX = FORMATS["blockwise_1x128"].element_max  # e4m3's largest finite value
GROUP = FORMATS["blockwise_1x128"].block[1]  # blockwise group: elements of a row
VEC = 8       # elements a thread loads at once (16 bytes of bf16)
RECIPES = ("blockwise_1x128", "rowwise", "tensorwise")


class QuantizeFp8Sm90:
    """One pass over ``x``: each element read once from global memory (rowwise: twice,
    the second time from L1/L2), quantized and stored.

    ``blockwise_1x128``: 16 threads of a warp share a group, 8 elements each; the group's
    amax is a 16-lane butterfly of ``max |x|`` (4 shuffles), the first thread writes the
    scale.  A thread takes ``vecs`` groups' vectors (all loads first), ``threads * vecs
    / 16`` groups per CTA; past the last group the loads are clamped and the stores
    skipped, so every lane takes part in every shuffle.

    ``rowwise`` / ``tensorwise``: a CTA per row (a grid-stride loop over rows), its
    threads striding the row's 16-byte vectors: the row's amax (warp butterflies, then
    across warps through shared memory), then the row again, quantized.  Tensorwise
    takes the whole tensor's amax as an input and skips the first sweep.

    Launched with programmatic dependent launch (:mod:`csrc_free_kernels.common.pdl`), as the
    forward kernels are: it waits for the stream ahead before touching memory.
    """

    def __init__(self, recipe: str, threads: int = 256, vecs: int = 4):
        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
        self.recipe = recipe
        self.threads = threads
        self.vecs = vecs
        self.lanes = GROUP // VEC  # threads per blockwise group
        self.warps = threads // 32

    # ---------------------------------------------------------------- host
    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mScale: cute.Tensor,
                 mAmax: cute.Tensor, max_ctas: cutlass.Int32, stream):
        """mX (M, K), mQ (M, K) e4m3; mScale: blockwise (M, K/128) M-major, rowwise (M,),
        tensorwise (1,) (written by CTA 0); mAmax: tensorwise (1,) amax, else unused."""
        # (VEC, (M, K / VEC)): mode 1 indexes 16-byte vectors
        gX = cute.zipped_divide(mX, (1, VEC))
        gQ = cute.zipped_divide(mQ, (1, VEC))
        m = cute.size(mX, mode=[0])
        k_vec = cute.size(mX, mode=[1]) // VEC
        if cutlass.const_expr(self.recipe == "blockwise_1x128"):
            total = m * k_vec  # vectors
            per_cta = self.threads * self.vecs
            grid = (total + per_cta - 1) // per_cta
        else:
            total = m  # rows
            grid = cutlass.min(m, max_ctas)
        self.kernel(gX, gQ, mScale, mAmax, k_vec, total).launch(
            grid=(grid, 1, 1), block=(self.threads, 1, 1), stream=stream,
            use_pdl=pdl.ENABLED)

    # -------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, gX: cute.Tensor, gQ: cute.Tensor, mScale: cute.Tensor,
               mAmax: cute.Tensor, k_vec: cutlass.Int32, total: cutlass.Int32):
        pdl.enter()  # before the first global access
        if cutlass.const_expr(self.recipe == "blockwise_1x128"):
            self.blockwise(gX, gQ, mScale, k_vec, total)
        else:
            self.per_row(gX, gQ, mScale, mAmax, k_vec, total)

    @cute.jit
    def vector_amax(self, x):
        """``max |x|`` over a vector (fp32 registers)."""
        amax = cutlass.Float32(0.0)
        for i in cutlass.range_constexpr(VEC):
            amax = cute.arch.fmax(amax, cute.math.abs(x[i]))
        return amax

    @cute.jit
    def quantized(self, x, scale):
        """``satfinite_rn(x / scale)`` as e4m3 (a true division, as torch's ``x / scale``);
        zeros where ``scale`` is 0."""
        denom = cutlass.Float32(1.0)
        keep = cutlass.Float32(0.0)
        if scale > 0.0:
            denom = scale
            keep = cutlass.Float32(1.0)
        q = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        for i in cutlass.range_constexpr(VEC):
            q[i] = x[i] / denom * keep
        return q.load().to(cutlass.Float8E4M3FN)

    @cute.jit
    def load(self, gX, row, col):
        """Vector ``col`` of row ``row``, in fp32 registers."""
        x = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        x.store(gX[(None, (row, col))].load().to(cutlass.Float32))
        return x

    @cute.jit
    def blockwise(self, gX, gQ, mScale, k_vec, total):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        base = bidx * (self.threads * self.vecs) + tidx
        last = total - 1
        rows, cols, xs = [], [], []
        for j in cutlass.range_constexpr(self.vecs):  # loads first: all in flight
            v = cutlass.min(base + j * self.threads, last)
            row = v // k_vec
            col = v - row * k_vec
            rows.append(row)
            cols.append(col)
            xs.append(self.load(gX, row, col))
        for j in cutlass.range_constexpr(self.vecs):
            amax = cute.arch.warp_reduction_max(self.vector_amax(xs[j]),
                                                threads_in_group=self.lanes)
            scale = amax / FP8_MAX
            q = self.quantized(xs[j], scale)
            if base + j * self.threads <= last:
                gQ[(None, (rows[j], cols[j]))].store(q)
                if cols[j] % self.lanes == 0:
                    mScale[rows[j], cols[j] // self.lanes] = scale

    @cute.jit
    def per_row(self, gX, gQ, mScale, mAmax, k_vec, total):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        smem = cutlass.utils.SmemAllocator()
        partial = smem.allocate_tensor(cutlass.Float32, cute.make_layout(self.warps + 1))
        if cutlass.const_expr(self.recipe == "tensorwise"):
            if bidx == 0:
                if tidx == 0:  # the divisor of every row below, computed the same way
                    mScale[0] = mAmax[0] / FP8_MAX
        for row in cutlass.range(bidx, total, grid, unroll=1):
            if cutlass.const_expr(self.recipe == "tensorwise"):
                amax = mAmax[0]
            else:
                amax = cutlass.Float32(0.0)
                for col in cutlass.range(tidx, k_vec, self.threads, unroll=1):
                    x = self.load(gX, row, col)
                    amax = cute.arch.fmax(amax, self.vector_amax(x))
                amax = cute.arch.warp_reduction_max(amax)
                if lane == 0:
                    partial[warp] = amax
                cute.arch.sync_threads()
                if warp == 0:
                    amax = partial[cutlass.min(lane, self.warps - 1)]
                    amax = cute.arch.warp_reduction_max(amax)
                    if lane == 0:
                        partial[self.warps] = amax
                cute.arch.sync_threads()
                amax = partial[self.warps]
                if tidx == 0:
                    mScale[row] = amax / FP8_MAX
            scale = amax / FP8_MAX
            for col in cutlass.range(tidx, k_vec, self.threads, unroll=1):
                x = self.load(gX, row, col)
                gQ[(None, (row, col))].store(self.quantized(x, scale))
            if cutlass.const_expr(self.recipe != "tensorwise"):
                cute.arch.sync_threads()  # partial[] is rewritten by the next row
