"""SwiGLU activation and its gradient as one memory-bound elementwise kernel (sm_90a).

``h = [gate | up]`` is the (M, 2I) pre-activation of a SwiGLU MLP, ``g = h[:, :I]``,
``u = h[:, I:]``:

- forward:  ``out = silu(g) * u``                                   (M, I)
- backward: ``s = sigmoid(g)``, ``dh[:, :I] = dy * u * s * (1 + g * (1 - s))``,
  ``dh[:, I:] = dy * g * s``                                         (M, 2I)

bf16 or fp16 in and out, fp32 math, one rounding.  See
:class:`SwigluElementwise` for the design, :func:`swiglu_forward` and
:func:`swiglu_backward` for the torch entry points (the plain-torch
references are ``ts_moe.reference.swiglu`` / ``swiglu_backward``).
"""

import functools

import cutlass
import cutlass.cute as cute
import torch

from . import compile as kcompile

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


# ------------------------------------------------------------------ torch side
_TORCH_TO_CUTE = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}


def fake_args(dtype, backward: bool) -> tuple:
    """Symbolic (M, 2I) h, (M, I) out or (M, 2I) dh, (M, I) dy or None, and the
    stream: M, I and every row stride free (strides multiples of 16 bytes, I of
    8 elements), the last dim contiguous; M and the widths shared, so the
    compiled function checks that they agree."""
    vec = 128 // dtype.width
    m = cute.sym_int()
    two_i = cute.sym_int(divisibility=2 * vec)
    one_i = cute.sym_int(divisibility=vec)

    def t(cols):
        return cute.runtime.make_fake_tensor(
            dtype, (m, cols), (cute.sym_int64(divisibility=vec), 1), assumed_align=16)

    if backward:
        return t(two_i), t(two_i), t(one_i), kcompile.fake_stream()
    return t(two_i), t(one_i), None, kcompile.fake_stream()


@functools.cache
def compiled_kernel(dtype: torch.dtype, backward: bool):
    """The compiled kernel for torch ``dtype`` (memoized: it is on every call's path)."""
    key = ("SwigluElementwise", "backward" if backward else "forward", str(dtype), "sm_90a")

    def build():
        return SwigluElementwise(backward), fake_args(_TORCH_TO_CUTE[dtype], backward)

    return kcompile.get_compiled(key, build)


def _check_layout(name: str, t: torch.Tensor) -> None:
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor")
    if t.shape[0] > 1 and t.stride(0) * t.element_size() % 16 or t.data_ptr() % 16:
        raise ValueError(f"{name}: rows must start on 16-byte boundaries "
                         f"(stride {t.stride()}, address {t.data_ptr():#x})")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride {t.stride()})")


def _normalized(t: torch.Tensor) -> torch.Tensor:
    """A view the compiled signature accepts: a one-row tensor may carry any row
    stride, so give it a 16-byte one (the kernel never uses it)."""
    if t.shape[0] == 1 and t.stride(0) * t.element_size() % 16:
        return t.as_strided(t.shape, (t.shape[1], 1))
    return t


def _validate(h: torch.Tensor, *others) -> tuple:
    if h.dim() != 2 or h.dtype not in _TORCH_TO_CUTE:
        raise ValueError(f"h must be (M, 2I) bfloat16 or float16, got {tuple(h.shape)} {h.dtype}")
    m, two_i = h.shape
    inter = two_i // 2
    if two_i % 16:
        raise ValueError(f"I = {two_i / 2} must be a multiple of 8")
    if m * (inter // 8) > MAX_VECTORS:
        raise ValueError(f"M * I = {m * inter} elements is too many for one launch")
    tensors = (("h", h, two_i), *others)
    for name, t, width in tensors:
        if tuple(t.shape) != (m, width) or t.dtype != h.dtype:
            raise ValueError(f"{name}: expected {(m, width)} {h.dtype}, "
                             f"got {tuple(t.shape)} {t.dtype}")
    if m and inter:  # else nothing is launched
        for name, t, _ in tensors:
            _check_layout(name, t)
    return m, inter


def swiglu_forward(h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = silu(h[:, :I]) * h[:, I:]`` on the current stream; returns ``out``.

    h (M, 2I), out (M, I): bf16 or fp16, rows on 16-byte boundaries, last dim
    contiguous, I a multiple of 8.  No host sync; CUDA-graph capturable."""
    m, inter = _validate(h, ("out", out, h.shape[1] // 2))
    if m == 0 or inter == 0:
        return out
    compiled_kernel(h.dtype, False)(_normalized(h), _normalized(out), None)
    return out


def swiglu_backward(dy: torch.Tensor, h: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """``dh`` (M, 2I), the gradient of :func:`swiglu_forward` at ``h`` for the
    output gradient ``dy`` (M, I); same layout rules; returns ``dh``."""
    m, inter = _validate(h, ("dy", dy, h.shape[1] // 2), ("dh", dh, h.shape[1]))
    if m == 0 or inter == 0:
        return dh
    compiled_kernel(h.dtype, True)(_normalized(h), _normalized(dh), _normalized(dy))
    return dh
