"""``torch.ops.ts_moe.grouped_gemm``: its schema, kernels, fake and gradient.

``grouped_gemm(a, b, offs, out_dtype=None)`` has the semantics of
``torch.nn.functional.grouped_mm`` for 2-D ``a``:

- row-grouped, ``a`` (M, K) and ``b`` (E, K, N): rows ``[offs[e-1], offs[e])``
  of ``a`` (``offs[-1]`` read as 0) are multiplied by ``b[e]``; rows at or past
  ``offs[-1]`` are written as zeros (``grouped_mm`` leaves them undefined);
- k-grouped, ``a`` (K, M) and ``b`` (M, N): ``out[e] = a[:, rows e] @ b[rows
  e]``, (E, K, N), zeros for an expert without rows: the weight gradient
  ``grouped_gemm(x.t(), dy, offs)``.

Any K and N whose strides are 16-byte aligned; the output's rows are padded
to 16 bytes, as torch pads them.  Bad ``offs`` are not checked on the host
(that would be a sync); every backend reads ``cummax(clamp(offs, 0, M))`` as
the segment ends (:func:`ts_moe.reference.segment_ends`): no access is out of
bounds, segments never overlap, every output row is written.

A call: :func:`grouped_gemm` -> the op -> :func:`_cuda` (or :func:`_cpu`):
the device's capability (:func:`ts_moe.ops.paths.device_capability`), one validation
(:func:`ts_moe.checks.layout_ready`, else the full check and the op's views),
then :func:`dispatch`: the first backend of the call's paths whose ``choose_config``
takes it and whose kernel build is not refused (:func:`ts_moe.ops.paths.backends`,
:func:`ts_moe.ops.backend.take`), and its ``run``.  The gradient is made of the op itself
(:func:`grouped_gemm_backward`), so it runs on the forward's path, eagerly
and in compiled graphs, and double backward works.
"""

import torch

from ..checks import check_grouped_gemm_args, check_tensor_types, contiguous_dim, layout_ready
from ..reference import gather_rows as gather_rows_reference
from . import paths, routing
from .backend import Op, run_first, take
from .layout import aligned_rows, empty_output, one_segment, operand, row_pad, tma_view
from .library import below_autograd, define

SCHEMA = ("grouped_gemm(Tensor a, Tensor b, Tensor offs, ScalarType? out_dtype=None, *, "
          "Tensor? a_index=None, bool prefetch_weights=False) -> Tensor")


# ------------------------------------------------------------------ running
def run(capability, a, b, offs, out_dtype=None, a_index=None,
        prefetch_weights=False) -> torch.Tensor:
    """A validated call on a device of ``capability`` (None: the references): the empty
    sizes answered here, a broadcast weight as one matrix
    (:func:`ts_moe.ops.layout.one_segment`), the operands in the backends' layout
    (:func:`ts_moe.ops.layout.tma_view`), then :func:`dispatch`."""
    if b.dim() == 2:
        return _run_k(capability, a, b, offs, out_dtype)
    m, n = (a if a_index is None else a_index).shape[0], b.shape[2]
    dtype = out_dtype or a.dtype
    if m == 0 or n == 0 or a.shape[1] == 0 or b.shape[0] == 0:
        return empty_output(a, m, n, dtype).zero_()
    b, offs = one_segment(b, offs)
    a = tma_view(a, 1) if a_index is None else aligned_rows(a)
    return dispatch(capability, a, tma_view(b, contiguous_dim(b.shape, b.stride())), offs, dtype,
                    a_index, prefetch_weights)


def dispatch(capability, a, b, offs, dtype, a_index=None, prefetch_weights=False) -> torch.Tensor:
    """The row-grouped form on the first backend of its paths that takes it; ``a[a_index]``
    gathered first for a backend that does not gather itself.  Operands validated, in
    the backends' layout, no empty dim."""
    m = (a if a_index is None else a_index).shape[0]
    out = empty_output(a, m, b.shape[2], dtype)

    def run_on(backend, config):
        if a_index is not None and not backend.gathers:
            # the row gather is the kernel ahead: offs and b are older (prefetch_weights)
            return backend.run(routing.gather_rows(a, a_index), b, offs, out, config,
                               prefetch_weights=True)
        return backend.run(a, b, offs, out, config, a_index=a_index,
                           prefetch_weights=prefetch_weights)

    return take(paths.backends(Op.GROUPED_GEMM, capability, a.dtype, dtype, b.shape[0]),
                (a, b, offs, out, a_index), run_on)


def _run_k(capability, a, b, offs, out_dtype=None) -> torch.Tensor:
    """The k-grouped form, a (K, M) and b (M, N) to (E, K, N), of a validated call."""
    dtype = out_dtype or a.dtype
    (k, m), n, num_experts = a.shape, b.shape[1], offs.shape[0]
    out = empty_output(a, k, n, dtype, experts=num_experts)
    if 0 in (num_experts, k, m, n):
        return out.zero_()
    a, b = tma_view(a, 0), tma_view(b, 1)
    return run_first(paths.backends(Op.GROUPED_GEMM_K, capability, a.dtype, dtype, num_experts),
                     a, b, offs, out)


def _cpu(a, b, offs, out_dtype=None, *, a_index=None, prefetch_weights=False):
    check_grouped_gemm_args(a, b, offs, out_dtype, a_index=a_index)
    return run(None, a, b, offs, out_dtype, a_index)


def _cuda(a, b, offs, out_dtype=None, *, a_index=None, prefetch_weights=False):
    capability = paths.device_capability(a)
    if a_index is None and layout_ready(a, b, offs, out_dtype, a.get_device()):
        # the hot path: valid, and already in the backends' layout
        return dispatch(capability, a, b, offs, out_dtype or a.dtype, None, prefetch_weights)
    check_grouped_gemm_args(a, b, offs, out_dtype, a_index=a_index)
    return run(capability, a, b, offs, out_dtype, a_index, prefetch_weights)


def _fake(a, b, offs, out_dtype=None, *, a_index=None, prefetch_weights=False):
    check_grouped_gemm_args(a, b, offs, out_dtype, fake=True, a_index=a_index)
    dtype = out_dtype or a.dtype
    if b.dim() == 2:  # k-grouped: (E, K, N)
        k, n = a.shape[0], b.shape[1]
        pad = row_pad(n, dtype)
        return a.new_empty_strided((offs.shape[0], k, n), (k * pad, pad, 1), dtype=dtype)
    n = b.shape[2]
    m = a.shape[0] if a_index is None else a_index.shape[0]
    return a.new_empty_strided((m, n), (row_pad(n, dtype), 1), dtype=dtype)


# ----------------------------------------------------------------- gradient
def scatter_rows(rows: torch.Tensor, a_index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The gradient of :func:`ts_moe.reference.gather_rows`: ``out[i]`` = the sum of
    ``rows[r]`` over ``a_index[r] == i``, (num_rows, K); indices outside
    ``[0, num_rows)`` (read as zero rows) get nothing: they are sent to a spare
    row past the end.  ``index_put_(accumulate=True)``: on CUDA torch's
    sort-based kernel (deterministic, no host sync; no fp32 copy of ``rows``,
    checked against an fp32 reference by the GPU tests)."""
    out = rows.new_zeros(num_rows + 1, rows.shape[1])
    if rows.shape[0]:
        index = a_index.long()
        outside = (index < 0) | (index >= num_rows)
        out.index_put_((index.masked_fill(outside, num_rows),), rows, accumulate=True)
    return out[:num_rows]


def weight_grad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor,
                like: torch.Tensor) -> torch.Tensor:
    """``dW[e] = x[rows e]^T @ dy[rows e]`` (E, K, N), by the k-grouped form, in the
    memory layout of the weight ``like`` (E, K, N): a K-contiguous weight (the
    transpose of an (E, N, K) ``nn.Linear`` stack) gets its gradient computed
    as (E, N, K) and transposed, so the optimiser sees the parameter's layout."""
    if like.stride(1) == 1 and like.shape[1] > 1:
        return grouped_gemm(dy.t(), x, offs).transpose(-2, -1)
    return grouped_gemm(x.t(), dy, offs)


def grouped_gemm_backward(dy, a, b, offs, a_index=None, need_a=True, need_b=True):
    """``(da, db)`` of ``grouped_gemm(a, b, offs, out_dtype, a_index=a_index)`` for
    the output's gradient ``dy``; each None where not needed.  Every product is
    the op itself, so each gradient runs on the forward's path (kernels, torch,
    reference), with no host sync:

    - row-grouped (b (E, K, N)): ``da = grouped_gemm(dy, b^T)`` (scattered back
      through ``a_index``), ``db = grouped_gemm(a.t(), dy)`` (k-grouped);
    - k-grouped (a (K, M), b (M, N), dy (E, K, N)): ``da^T = grouped_gemm(b,
      dy^T)``, ``db = grouped_gemm(a.t(), dy)`` (both row-grouped).

    Rows past ``offs[-1]`` (and experts without rows) get zero gradients.
    ``dy`` in float32 (``out_dtype``) is rounded to ``a.dtype`` first.
    """
    dy = operand(dy.to(a.dtype))
    da = db = None
    if b.dim() == 2:
        if need_a:
            da = grouped_gemm(b, dy.transpose(-2, -1), offs).t()
        if need_b:
            db = grouped_gemm(a.t(), dy, offs)
        return da, db
    if need_a:
        da = grouped_gemm(dy, b.transpose(-2, -1), offs)
        if a_index is not None:
            da = scatter_rows(da, a_index, a.shape[0])
    if need_b:
        x = a if a_index is None else gather_rows_reference(a, a_index)
        db = weight_grad(x, dy, offs, b)
    return da, db


class _GroupedGemmFunction(torch.autograd.Function):
    """``grouped_gemm`` under autograd: the forward below autograd, the backward
    :func:`grouped_gemm_backward` (itself made of ops, so double backward works)."""

    @staticmethod
    def forward(ctx, keyset, a, b, offs, out_dtype, a_index):
        ctx.save_for_backward(a, b, offs, a_index)
        return below_autograd(GROUPED_GEMM, keyset, a, b, offs, out_dtype, a_index=a_index)

    @staticmethod
    def backward(ctx, dy):
        a, b, offs, a_index = ctx.saved_tensors
        da, db = grouped_gemm_backward(dy, a, b, offs, a_index, *ctx.needs_input_grad[1:3])
        return None, da, db, None, None, None


def _with_grad(keyset, a, b, offs, out_dtype=None, *, a_index=None, prefetch_weights=False):
    # prefetch_weights is a hint about the launch order, not part of the math
    return _GroupedGemmFunction.apply(keyset, a, b, offs, out_dtype, a_index)


GROUPED_GEMM = define(SCHEMA, _cpu, _cuda, _fake, with_grad=_with_grad)


# --------------------------------------------------------------- the public
def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                 out_dtype: torch.dtype | None = None, *,
                 a_index: torch.Tensor | None = None,
                 prefetch_weights: bool = False) -> torch.Tensor:
    """``torch.ops.ts_moe.grouped_gemm``: ``out[r] = a[r] @ b[e]`` for the rows of expert ``e``.

    a: (M, K) bf16/fp16/fp32 (float64: reference path, for gradcheck); b:
    (E, K, N), either of its last two dims contiguous (``w.transpose(-2,
    -1)`` of an (E, N, K) nn.Linear weight works), other strides 16-byte
    aligned; offs: int32 (E,) cumulative row ends.  Returns (M, N) in
    ``out_dtype`` (default ``a.dtype``; float32 allowed), zeros past ``offs[-1]``.

    b 2-D: the k-grouped form, a (K, M) and b (M, N) to (E, K, N), ``out[e] =
    a[:, rows e] @ b[rows e]`` (the weight gradient ``grouped_gemm(x.t(), dy,
    offs)``; no ``a_index``).  Differentiable in ``a`` and ``b`` in both forms.

    ``a_index``: int32 (M',): gather the rows first, ``out[r] = a[a_index[r]]
    @ b[e(r)]``, (M', N) (the MoE layer's token rows in expert order, without
    a separate permuted copy).  Indices are read on the device only: one
    outside ``[0, M)`` reads as a zero row (its output row is zero), never
    out of bounds.  ``a``'s own strides are then free.

    ``prefetch_weights``: a promise about the kernel launched last on this
    stream before the op: it did not write ``offs`` or ``b``, and it lets its
    dependents launch only once everything before it has completed (every
    ts_moe kernel does; so does any kernel launched without programmatic
    dependent launch).  The sm_90 kernel may then start streaming the weights
    while that kernel still runs; tokens and output wait for it as always.
    The MoE block sets it for its down projection, whose ``offs`` the routing
    kernel wrote three launches earlier.  With ``a_index`` it holds anyway
    (the op's own row gather runs in between).  Not under ``torch.compile``
    (the compiler orders the launches); elsewhere a hint, ignored.
    """
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and isinstance(offs, torch.Tensor)):
        check_tensor_types(a=a, b=b, offs=offs)
    if prefetch_weights is not False:
        if not isinstance(prefetch_weights, bool):
            raise TypeError(f"prefetch_weights must be a bool, got "
                            f"{type(prefetch_weights).__name__}")
        if a_index is None:  # with a_index the op prefetches anyway
            return GROUPED_GEMM(a, b, offs, out_dtype, prefetch_weights=True)
    if a_index is None:
        return GROUPED_GEMM(a, b, offs, out_dtype)
    check_tensor_types(a_index=a_index)
    return GROUPED_GEMM(a, b, offs, out_dtype, a_index=a_index)
