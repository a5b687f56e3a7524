"""SwiGLU activation and its gradient as one memory-bound elementwise kernel (sm_90a).

``h = [gate | up]`` is the (M, 2I) pre-activation of a SwiGLU MLP, ``g = h[:, :I]``,
``u = h[:, I:]``:

- forward:  ``out = silu(g) * u``                                   (M, I)
- backward: ``s = sigmoid(g)``, ``dh[:, :I] = dy * u * s * (1 + g * (1 - s))``,
  ``dh[:, I:] = dy * g * s``                                         (M, 2I)

bf16 or fp16 in and out, fp32 math, one rounding.  See
:class:`SwigluElementwise` for the design; :mod:`.swiglu_sm90_launch` holds
the torch entry points ``swiglu_forward`` and ``swiglu_backward`` (the
plain-torch references are ``ts_moe.reference.swiglu`` / ``swiglu_backward``).
"""

import cutlass
import cutlass.cute as cute

LOG2E = 1.4426950408889634
# the flat vector index is an Int32
MAX_VECTORS = 2**31 - 2**20


class SwigluElementwise:
    """One elementwise pass: ``backward=False`` the activation, ``True`` its gradient.

    Work unit: a *vector*, 16 bytes (8 elements) of a row of g, the matching
    vector of u ``I`` columns further on (and of dy, backward).  The ``M * I / 8``
    vectors are numbered row-major (``v = row * I/8 + col``) and dealt out
    ``threads * vecs`` per CTA: thread ``t`` of CTA ``b`` takes vectors
    ``b * threads * vecs + k * threads + t`` for ``k < vecs``, so each of a
    warp's 16-byte accesses is contiguous with its neighbours' (a row break
    just starts the next row), and any I (multiple of 8) and M use every
    thread, with no tail CTA column.

    Each thread first issues all its loads (``vecs`` x 2 or 3 16-byte
    ``ld.global.v4``), then computes in fp32 and stores (``st.global.v4``),
    so ``vecs * 32`` (forward) or ``vecs * 48`` (backward) bytes per thread are
    in flight.  Past the end, the vector index is clamped to the last
    vector for the loads (always in bounds, no predicates on them) and only
    the stores are skipped.

    Row strides are free multiples of 16 bytes (the compiled signature's
    symbolic strides), the last dim contiguous.
    """

    def __init__(self, backward: bool, threads: int = 256, vecs: int = 4):
        self.backward = backward
        self.threads = threads
        self.vecs = vecs

    # ---------------------------------------------------------------- host
    @cute.jit
    def __call__(self, mH: cute.Tensor, mOut: cute.Tensor, mDy, stream):
        """mH (M, 2I); forward: mOut (M, I), mDy None; backward: mOut = dh (M, 2I), mDy (M, I)."""
        dtype = mH.element_type
        vec = 128 // dtype.width
        # (vec, (M, columns / vec)): mode 1 indexes 16-byte vectors
        gH = cute.zipped_divide(mH, (1, vec))
        gOut = cute.zipped_divide(mOut, (1, vec))
        gDy = gOut
        if cutlass.const_expr(self.backward):
            gDy = cute.zipped_divide(mDy, (1, vec))
        m = cute.size(mH, mode=[0])
        n_vec = cute.size(mH, mode=[1]) // (2 * vec)
        total = m * n_vec
        per_cta = self.threads * self.vecs
        self.kernel(gH, gOut, gDy, n_vec, total).launch(
            grid=((total + per_cta - 1) // per_cta, 1, 1), block=(self.threads, 1, 1),
            stream=stream)

    # -------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, gH: cute.Tensor, gOut: cute.Tensor, gDy: cute.Tensor,
               n_vec: cutlass.Int32, total: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        dtype = gH.element_type
        base = bidx * (self.threads * self.vecs) + tidx
        last = total - 1

        # loads first: every vector of the thread in flight at once
        rows, cols, gates, ups, dys = [], [], [], [], []
        for k in cutlass.range_constexpr(self.vecs):
            v = cutlass.min(base + k * self.threads, last)
            row = v // n_vec
            col = v - row * n_vec
            rows.append(row)
            cols.append(col)
            gates.append(gH[(None, (row, col))].load())
            ups.append(gH[(None, (row, col + n_vec))].load())
            if cutlass.const_expr(self.backward):
                dys.append(gDy[(None, (row, col))].load())

        for k in cutlass.range_constexpr(self.vecs):
            g = gates[k].to(cutlass.Float32)
            u = ups[k].to(cutlass.Float32)
            # sigmoid(g) = 1 / (1 + 2^(-g log2 e)): e = inf for g << 0 gives s = 0
            e = cute.math.exp2(g * (-LOG2E), fastmath=True)
            s = cute.math.rcp(e + 1.0, approx=True, ftz=True)
            row, col = rows[k], cols[k]
            if base + k * self.threads <= last:
                if cutlass.const_expr(self.backward):
                    dy = dys[k].to(cutlass.Float32)
                    dys_ = dy * s
                    d_gate = dys_ * u * (g * (1.0 - s) + 1.0)
                    d_up = dys_ * g
                    gOut[(None, (row, col))].store(d_gate.to(dtype))
                    gOut[(None, (row, col + n_vec))].store(d_up.to(dtype))
                else:
                    gOut[(None, (row, col))].store((g * s * u).to(dtype))
