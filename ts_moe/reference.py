"""Plain-torch versions of the ops: their CPU kernels, their fallbacks, and the
tests' yardstick.  ``ts_moe.route``, ``ts_moe.sort_slots``, ``ts_moe.combine``
and ``ts_moe.permute`` are the ops (kernels where the path has them); the
functions of the same names here are plain torch, on any device.

- grouped GEMMs (:func:`grouped_gemm_reference` and its k-grouped and SwiGLU
  forms): a loop over the experts that reads ``offs`` on the host (a sync on
  a GPU);
- routing (:func:`route`, :func:`sort_slots`, :func:`permute`,
  :func:`combine`): on the device, no host sync, no shape that depends on
  the data, differentiable where it makes sense, so they run under
  ``torch.compile(fullgraph=True)`` and inside CUDA graphs.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .checks import (check_combine_args, check_experts, check_flag, check_permute_args,
                     check_route_args)


def segment_ends(offs: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The row ends the kernels actually use: ``cummax(clamp(offs, 0, num_rows))``.

    For valid ``offs`` (non-decreasing, ``offs[-1] <= num_rows``) this is
    ``offs`` itself.  For invalid ``offs`` it is the defined, memory-safe
    meaning of the op: a segment never starts before the previous one ends
    and never runs past the last row, so experts never overlap and no row
    outside ``a`` is read or written.
    """
    ends = offs.to(torch.int64).clamp(0, num_rows)
    return torch.cummax(ends, dim=0).values if ends.numel() else ends


def gather_rows(a: torch.Tensor, a_index: torch.Tensor) -> torch.Tensor:
    """``a[a_index]`` on the device, rows padded to 16 bytes; an index outside
    ``[0, M)`` reads as a zero row (no host sync: the range is never checked
    on the host, and no access is out of bounds)."""
    m, k = a.shape
    rows = a_index.shape[0]
    align = 16 // a.element_size()
    pad = -(-k // align) * align
    if m == 0:
        return a.new_zeros((rows, pad))[:, :k]
    index = a_index.long()
    out = a.index_select(0, index.clamp(0, m - 1))
    if pad != k:
        out = a.new_empty((rows, pad))[:, :k].copy_(out)
    return out.masked_fill_(((index < 0) | (index >= m)).unsqueeze(1), 0)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of the references: fp32, fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def grouped_gemm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out[r] = a[r] @ b[e]`` for rows ``r`` of expert ``e``; zeros after the last expert.

    fp32 accumulation, like the kernels.  Reads ``offs`` on the host: a sync
    when it is on the GPU (a reference, not a fast path); a CPU ``offs`` with
    GPU ``a`` and ``b`` needs none, so it can run inside a CUDA-graph capture.
    """
    if b.dim() == 2:
        return grouped_gemm_k_reference(a, b, offs, out_dtype)
    acc = acc_dtype(a.dtype)
    out = torch.zeros(a.shape[0], b.shape[-1], dtype=out_dtype or a.dtype, device=a.device)
    start = 0
    for e, end in enumerate(segment_ends(offs, a.shape[0]).tolist()):
        if end > start:
            out[start:end] = (a[start:end].to(acc) @ b[e].to(acc)).to(out.dtype)
        start = end
    return out


def grouped_gemm_k_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The k-grouped form: a (K, M), b (M, N) -> (E, K, N), ``out[e] = a[:, rows e] @ b[rows e]``.

    The experts split the shared dim M (``offs`` as in :func:`grouped_gemm_reference`);
    an expert without rows gets zeros, rows past ``offs[-1]`` count nowhere.
    This is the weight gradient of the row-grouped form: ``dW = grouped(x.t(), dy)``.
    """
    acc = acc_dtype(a.dtype)
    out = torch.zeros(offs.shape[0], a.shape[0], b.shape[1], dtype=out_dtype or a.dtype,
                      device=a.device)
    start = 0
    for e, end in enumerate(segment_ends(offs, b.shape[0]).tolist()):
        if end > start:
            out[e] = (a[:, start:end].to(acc) @ b[start:end].to(acc)).to(out.dtype)
        start = end
    return out


def swiglu(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``silu(gate) * up`` of ``h = [gate | up]`` (..., 2I), in h's precision
    (fp32 in every caller), rounded once to ``dtype``."""
    inter = h.shape[-1] // 2
    return (F.silu(h[..., :inter]) * h[..., inter:]).to(dtype)


def swiglu_backward(dy: torch.Tensor, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """d/dh of :func:`swiglu`: ``[dy * up * silu'(gate) | dy * silu(gate)]`` (..., 2I).

    ``silu'(g) = s * (1 + g * (1 - s))`` with ``s = sigmoid(g)``; computed in
    fp32 (fp64 for fp64 inputs), rounded once to ``dtype``.
    """
    acc = acc_dtype(h.dtype)
    inter = h.shape[-1] // 2
    gate, up = h[..., :inter].to(acc), h[..., inter:].to(acc)
    dy = dy.to(acc)
    s = torch.sigmoid(gate)
    dh = torch.empty(h.shape, dtype=dtype, device=h.device)
    dh[..., inter:] = dy * gate * s
    dh[..., :inter] = dy * up * s * (1 + gate * (1 - s))
    return dh


def swiglu_double_backward(grad: torch.Tensor, dy: torch.Tensor,
                           h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`swiglu_backward` ``dh(dy, h)`` for ``grad`` = d/d(dh)
    (M, 2I): ``(d dy (M, I), d h (M, 2I))``.  With ``grad = [g_g | g_u]``,
    ``s = sigmoid(gate)``, ``silu' = s (1 + gate (1 - s))`` and ``silu'' =
    s (1 - s) (2 + gate (1 - 2 s))``:

    - ``d dy = g_g * up * silu' + g_u * silu``;
    - ``d gate = dy * (g_g * up * silu'' + g_u * silu')``;
    - ``d up = g_g * dy * silu'``.

    fp32 (fp64 for fp64 inputs), each rounded once to its input's dtype; plain
    torch, so differentiable again.
    """
    acc = acc_dtype(h.dtype)
    inter = h.shape[-1] // 2
    gate, up = h[..., :inter].to(acc), h[..., inter:].to(acc)
    g_gate, g_up = grad[..., :inter].to(acc), grad[..., inter:].to(acc)
    d = dy.to(acc)
    s = torch.sigmoid(gate)
    silu = gate * s
    d_silu = s * (1 + gate * (1 - s))
    dd_silu = s * (1 - s) * (2 + gate * (1 - 2 * s))
    d_dy = g_gate * up * d_silu + g_up * silu
    d_h = torch.cat([d * (g_gate * up * dd_silu + g_up * d_silu), g_gate * d * d_silu], dim=-1)
    return d_dy.to(dy.dtype), d_h.to(h.dtype)


def grouped_gemm_swiglu_reference(a: torch.Tensor, gate_up: torch.Tensor,
                                  offs: torch.Tensor) -> torch.Tensor:
    """``silu(a @ gate^T) * (a @ up^T)`` per expert; ``gate_up`` is (E, 2I, H), gate rows first.

    The activation is applied in fp32, before the single rounding to ``a.dtype``.
    """
    acc = acc_dtype(a.dtype)
    inter = gate_up.shape[1] // 2
    out = torch.zeros(a.shape[0], inter, dtype=a.dtype, device=a.device)
    start = 0
    for e, end in enumerate(segment_ends(offs, a.shape[0]).tolist()):
        if end > start:
            out[start:end] = swiglu(a[start:end].to(acc) @ gate_up[e].to(acc).t(), out.dtype)
        start = end
    return out


# ------------------------------------------------------------------ routing
def route(logits: torch.Tensor, top_k: int,
          renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral routing: softmax over all experts in fp32 (fp64 for fp64 logits), top-k,
    renormalise.

    logits: (T, E), any float dtype.  Returns ``(weights, experts)``, both
    (T, top_k): ``weights`` float32 (float64 for float64 logits, so that a float64
    layer is float64-accurate through its router) summing to 1 per token (``renormalize``
    False: the chosen experts' softmax probabilities as they are, as Qwen-MoE
    routes with ``norm_topk_prob`` false; :func:`route_weights`), ``experts``
    int64, in decreasing order of logit, so of probability.

    The experts are ranked by their logits, not by the rounded probabilities:
    softmax keeps the order, and the logits keep it where fp32 probabilities
    collapse (those ~100 below the largest all underflow to 0 and would tie).
    Tie rule: among equal logits the lower expert index comes first (and is the
    one kept at the top-k boundary).  ``torch.topk`` has no such rule (on CPU
    it returns the *higher* indices of equal values first), so the selection is
    a stable descending sort of the logits.  The routing kernel
    (``csrc_free_kernels.routing.route_sm90``) ranks the same way.
    """
    check_route_args(logits, top_k)
    check_flag("renormalize", renormalize)
    experts = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    return route_weights(logits, experts, renormalize), experts


def route_weights(logits: torch.Tensor, experts: torch.Tensor,
                  renormalize: bool = True) -> torch.Tensor:
    """The combine weights of the ``experts`` (T, k) chosen from ``logits`` (T, E): their
    softmax probabilities over all E experts in fp32 (fp64 for fp64 logits:
    :func:`acc_dtype`), divided by their sum per token where ``renormalize``."""
    top = torch.softmax(logits.to(acc_dtype(logits.dtype)), dim=-1).gather(-1, experts)
    return top / top.sum(dim=-1, keepdim=True) if renormalize else top


class SlotOrder(NamedTuple):
    """The (token, k) slots of a batch in expert order, without the token rows.

    token_index: int32 (T * top_k,), the token of each slot in expert order
    (the ``a_index`` of the first grouped GEMM); offs: int32 (E,) cumulative
    row ends per expert; inverse: int64 (T * top_k,), ``inverse[t * top_k + k]``
    is the position of slot (t, k) in that order.
    """

    token_index: torch.Tensor
    offs: torch.Tensor
    inverse: torch.Tensor


class Dispatch(NamedTuple):
    """The (token, k) slots of a batch in expert order, with the token rows.

    x_sorted: (T * top_k, H) token rows, expert 0's first; offs: int32 (E,)
    cumulative row ends per expert (the ``offs`` of :func:`ts_moe.grouped_gemm`);
    inverse: int64 (T * top_k,), ``inverse[t * top_k + k]`` is the row of
    slot (t, k) in ``x_sorted``.
    """

    x_sorted: torch.Tensor
    offs: torch.Tensor
    inverse: torch.Tensor


def sort_slots(experts: torch.Tensor, num_experts: int) -> SlotOrder:
    """The expert order of the slots of ``experts`` (T, top_k), on the device.

    The slots are ordered by a stable sort of the flattened expert ids, so
    within an expert they keep (token, k) order and the result is deterministic.
    ``offs`` comes from a binary search of the sorted ids (no bincount, whose
    CUDA kernel reads the maximum id on the host).

    Dropped slots: an id outside ``[0, num_experts)`` (``-1``, an
    expert-parallel sentinel ``>= num_experts``) counts for no expert; its
    slot sorts after ``offs[-1]`` (in slot order), where the grouped GEMMs
    write zeros, so it contributes nothing.  Decided on the device: no sync.
    """
    check_experts(experts, num_experts)
    top_k = experts.shape[1]
    ids = experts.reshape(-1)
    ids = ids.masked_fill((ids < 0) | (ids >= num_experts), num_experts)
    sorted_ids, order = torch.sort(ids, stable=True)
    ids = torch.arange(num_experts, device=experts.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, ids, right=True, out_int32=True)
    inverse = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=experts.device))
    return SlotOrder((order // top_k).to(torch.int32), offs, inverse)


def permute(x: torch.Tensor, experts: torch.Tensor, num_experts: int) -> Dispatch:
    """The token rows of ``x`` (T, H) gathered into the expert order of :func:`sort_slots`."""
    check_permute_args(x, experts, num_experts)
    slots = sort_slots(experts, num_experts)
    return Dispatch(x.index_select(0, slots.token_index), slots.offs, slots.inverse)


class _GatherPermutation(torch.autograd.Function):
    """``rows.index_select(0, perm)`` for a permutation ``perm``, whose backward
    is the gather through the inverse permutation: no scatter-add (the
    backward of ``index_select``), so no atomics, and no host sync."""

    @staticmethod
    def forward(ctx, rows, perm):
        ctx.save_for_backward(perm)
        return rows.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (perm,) = ctx.saved_tensors
        undo = torch.empty_like(perm).scatter_(
            0, perm, torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype))
        return grad.index_select(0, undo), None


def gather_permutation(rows: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``rows.index_select(0, perm)`` for a permutation ``perm`` of the rows; under
    autograd its gradient is the gather through the inverse permutation."""
    if torch.is_grad_enabled() and rows.requires_grad:
        return _GatherPermutation.apply(rows, perm)
    return rows.index_select(0, perm)


class _GatherSummed(torch.autograd.Function):
    """``rows.index_select(0, index)`` for any ``index`` into the rows, repeated and
    missing rows included, whose backward is the gather's exact adjoint: each row
    gets the sum of the gradient rows gathered from it (zero where none was), by
    ``index_put_(accumulate=True)`` into zeros (on CUDA torch's sort-based kernel:
    deterministic, no atomics, no host sync)."""

    @staticmethod
    def forward(ctx, rows, index):
        ctx.save_for_backward(index)
        ctx.num_rows = rows.shape[0]
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.num_rows, *grad.shape[1:])
        return out.index_put_((index.long(),), grad, accumulate=True), None


def combine(y_sorted: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * y_sorted[inverse[t * top_k + k]]``.

    y_sorted: (T * top_k, H) expert outputs in expert order; weights: (T, top_k).
    The K rows of each token are gathered into a (T, top_k, H) view and summed
    over K in fp32 with the weights in fp32 (fp64 for fp64 ``y_sorted``:
    :func:`acc_dtype`), then rounded once to ``y_sorted.dtype``: deterministic,
    no atomics, forward and backward.
    ``inverse`` need not be a permutation (as :func:`sort_slots` makes it):
    ``y_sorted``'s gradient is the exact adjoint of the gather for any indices
    into its rows (:class:`_GatherSummed`), zero for a row no slot reads.  An
    index outside ``[0, T * top_k)`` reads as a zero row, as the sm_90 kernel
    reads it (no host sync: the range is never checked on the host).
    """
    check_combine_args(y_sorted, weights, inverse)
    tokens, top_k = weights.shape
    rows = y_sorted.shape[0]
    inside = (inverse >= 0) & (inverse < rows)
    index = inverse.clamp(0, max(rows - 1, 0))
    if torch.is_grad_enabled() and y_sorted.requires_grad:
        y = _GatherSummed.apply(y_sorted, index)
    else:
        y = y_sorted.index_select(0, index)
    y = y.view(tokens, top_k, y_sorted.shape[1]).masked_fill(~inside.view(tokens, top_k, 1), 0)
    # bf16 * fp32 promotes inside the multiply: no fp32 copy of y (at T=4096
    # on the H200 that copy was 2 % of the Mixtral layer's time); fp64 stays fp64
    out = (y * weights.to(acc_dtype(y_sorted.dtype)).unsqueeze(-1)).sum(dim=1)
    return out.to(y_sorted.dtype)


def combine_grad(dout: torch.Tensor, y_sorted: torch.Tensor, weights: torch.Tensor,
                 order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both gradients of :func:`combine` for the output gradient ``dout`` (T, H), per
    sorted row ``r`` of ``y_sorted`` (M, H), whose slot is ``s = order[r]`` (token ``t =
    s // top_k``; ``order`` the inverse permutation of :func:`combine`'s ``inverse``):

    - ``dy[r] = weights[t, s % top_k] * dout[t]``: the gradient of ``y_sorted`` (M, H)
      in its dtype, the product in fp32 (fp64 for fp64 rows), one rounding;
    - ``dw[r] = sum_h dout[t, h] * y_sorted[r, h]`` (M,), fp32 sums (fp64): the
      gradient of ``weights[t, s % top_k]``, in sorted order (``dw[inverse]`` is in
      slot order).

    An ``order`` entry outside ``[0, T * top_k)`` is a row no slot reads: zeros in both.
    Where ``order`` and ``inverse`` are each other's inverse (as :func:`sort_slots`
    makes them), these are the gradients autograd gives :func:`combine`."""
    acc = acc_dtype(y_sorted.dtype)
    slots, top_k = weights.numel(), weights.shape[1]
    inside = (order >= 0) & (order < slots)
    slot = order.long().clamp(0, max(slots - 1, 0))
    rows = dout.index_select(0, slot // top_k) if slots else dout.new_zeros(y_sorted.shape)
    w = weights.reshape(-1).index_select(0, slot).to(acc) if slots else \
        weights.new_zeros(y_sorted.shape[0], dtype=acc)
    g = rows.to(acc)
    dy = (g * w.unsqueeze(1)).to(y_sorted.dtype).masked_fill_(~inside.unsqueeze(1), 0)
    dw = (g * y_sorted.to(acc)).sum(dim=1).masked_fill_(~inside, 0)
    return dy, dw
