"""Token routing for a top-k Mixture-of-Experts layer, entirely on the device.

The three stages of a MoE layer around its expert GEMMs:

* :func:`route`: router logits -> (fp32 weights, expert ids), Mixtral semantics.
* :func:`permute`: the (token, k) slots in expert order, the token rows gathered
  into that order, and the ``offs`` that :func:`ts_moe.grouped_gemm` takes.
* :func:`combine`: ``out[t] = sum_k weights[t, k] * y[slot(t, k)]``.

None of them syncs with the host: no ``.item()``, no boolean-mask indexing, no
shape that depends on the data (the permuted activation always has
``T * top_k`` rows), so they run under ``torch.compile(fullgraph=True)`` and
inside CUDA graphs.  Each has a plain-torch, per-token ``*_reference`` beside it
(with host syncs; for tests only).

:func:`nvtx_range` marks the stages for Nsight Systems in the ``ts_moe`` domain.
"""

import contextlib
import functools
from typing import NamedTuple

import torch

try:
    import nvtx
except ImportError:  # the ranges are optional
    nvtx = None

NVTX_DOMAIN = "ts_moe"


@functools.cache
def _annotation(name: str):
    return nvtx.annotate(name, domain=NVTX_DOMAIN)


def nvtx_range(name: str):
    """Context manager: an NVTX range ``name`` in the ``ts_moe`` domain.

    A no-op without the ``nvtx`` package and while ``torch.compile`` traces (a
    host-side range inside a compiled graph would break ``fullgraph=True``).
    """
    if nvtx is None or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _annotation(name)


def check_router_args(x, weight) -> None:
    """x (T, H) and weight (E, H), float tensors of one dtype on one device, else
    a TypeError/ValueError naming them."""
    _check_float_matrix("x", x, "(tokens, hidden)")
    _check_float_matrix("weight", weight, "(experts, hidden)")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be (E, H) with H = {x.shape[1]} (x's last dim), "
                         f"got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")


def router_logits_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (T, E): float64 products and sums, one rounding to x's dtype
    (the yardstick of ``ts_moe.ops.router_logits``)."""
    return (x.double() @ weight.double().t()).to(x.dtype)


def check_top_k(top_k, num_experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")


def _check_float_matrix(name: str, t, dims: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D {dims}, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {t.dtype}")


def check_logits(logits) -> None:
    _check_float_matrix("logits", logits, "(tokens, experts)")


def check_route_args(logits, top_k) -> None:
    """(T, E) float logits and 1 <= top_k <= E, else a TypeError/ValueError naming them."""
    check_logits(logits)
    check_top_k(top_k, logits.shape[1])


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral routing: softmax over all experts in fp32, top-k, renormalise.

    logits: (T, E), any float dtype.  Returns ``(weights, experts)``, both
    (T, top_k): ``weights`` float32 summing to 1 per token, ``experts`` int64,
    in decreasing order of logit, so of probability.

    The experts are ranked by their logits, not by the rounded probabilities:
    softmax keeps the order, and the logits keep it where fp32 probabilities
    collapse (those ~100 below the largest all underflow to 0 and would tie).
    Tie rule: among equal logits the lower expert index comes first (and is the
    one kept at the top-k boundary).  ``torch.topk`` has no such rule (on CPU
    it returns the *higher* indices of equal values first), so the selection is
    a stable descending sort of the logits.  The routing kernel
    (``csrc_free_kernels.route_sm90``) ranks the same way.
    """
    check_logits(logits)
    check_top_k(top_k, logits.shape[1])
    probs = torch.softmax(logits.float(), dim=-1)
    experts = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    top = probs.gather(-1, experts)
    return top / top.sum(dim=-1, keepdim=True), experts


def route_reference(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route`, one token at a time in float64 with a Python sort (tests only)."""
    check_logits(logits)
    check_top_k(top_k, logits.shape[1])
    weights = torch.empty(logits.shape[0], top_k, dtype=torch.float32)
    experts = torch.empty(logits.shape[0], top_k, dtype=torch.int64)
    for t, row in enumerate(logits.double().cpu()):
        p = torch.exp(row - row.max())
        p = (p / p.sum()).tolist()
        chosen = sorted(range(len(p)), key=lambda e: (-row[e].item(), e))[:top_k]
        total = sum(p[e] for e in chosen)
        weights[t] = torch.tensor([p[e] / total for e in chosen])
        experts[t] = torch.tensor(chosen)
    return weights.to(logits.device), experts.to(logits.device)


class Dispatch(NamedTuple):
    """The (token, k) slots of a batch in expert order.

    x_sorted: (T * top_k, H) token rows, expert 0's first; offs: int32 (E,)
    cumulative row ends per expert (the ``offs`` of :func:`ts_moe.grouped_gemm`);
    inverse: int64 (T * top_k,), ``inverse[t * top_k + k]`` is the row of
    slot (t, k) in ``x_sorted``.
    """

    x_sorted: torch.Tensor
    offs: torch.Tensor
    inverse: torch.Tensor


def check_experts(experts, num_experts) -> None:
    if not isinstance(experts, torch.Tensor):
        raise TypeError(f"experts must be a torch.Tensor, got {type(experts).__name__}")
    if experts.dim() != 2:
        raise ValueError(f"experts must be 2-D, got shape {tuple(experts.shape)}")
    if experts.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"experts must be int32 or int64, got {experts.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")


def _check_permute_args(x, experts, num_experts) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    check_experts(experts, num_experts)
    if experts.shape[0] != x.shape[0]:
        raise ValueError(
            f"experts has {experts.shape[0]} rows (tokens) but x has {x.shape[0]}")
    if experts.device != x.device:
        raise ValueError(
            f"x and experts must be on one device, got {x.device} and {experts.device}")


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
    """Gather the token rows of ``x`` (T, H) into the expert order of :func:`sort_slots`.

    The MoE layer itself passes :func:`sort_slots`'s ``token_index`` to the
    first grouped GEMM as ``a_index`` instead (no separate permuted copy).
    """
    _check_permute_args(x, experts, num_experts)
    slots = sort_slots(experts, num_experts)
    return Dispatch(x.index_select(0, slots.token_index), slots.offs, slots.inverse)


def permute_reference(x: torch.Tensor, experts: torch.Tensor, num_experts: int) -> Dispatch:
    """:func:`permute` by a loop over the experts and their slots (tests only)."""
    _check_permute_args(x, experts, num_experts)
    top_k = experts.shape[1]
    flat = experts.reshape(-1).tolist()
    slots = [s for e in range(num_experts) for s in range(len(flat)) if flat[s] == e]
    slots += [s for s in range(len(flat)) if not 0 <= flat[s] < num_experts]  # dropped
    counts = [sum(1 for v in flat if v == e) for e in range(num_experts)]
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    inverse = torch.empty(len(flat), dtype=torch.int64)
    for row, s in enumerate(slots):
        inverse[s] = row
    x_sorted = torch.stack([x[s // top_k] for s in slots]) if slots else x[:0]
    return Dispatch(x_sorted, offs.to(x.device), inverse.to(x.device))


def check_combine_args(y_sorted, weights, inverse) -> None:
    for name, t, rank in (("y_sorted", y_sorted, 2), ("weights", weights, 2),
                          ("inverse", inverse, 1)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D, got shape {tuple(t.shape)}")
    if not weights.is_floating_point():
        raise TypeError(f"weights must be floating point, got {weights.dtype}")
    if inverse.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"inverse must be int32 or int64, got {inverse.dtype}")
    slots = weights.shape[0] * weights.shape[1]
    if inverse.shape[0] != slots or y_sorted.shape[0] != slots:
        raise ValueError(
            f"weights {tuple(weights.shape)} has {slots} slots; inverse has {inverse.shape[0]} "
            f"and y_sorted {y_sorted.shape[0]} rows")


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


def combine(y_sorted: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * y_sorted[inverse[t * top_k + k]]``.

    y_sorted: (T * top_k, H) expert outputs in expert order; weights: (T, top_k).
    The K rows of each token are gathered into a (T, top_k, H) view and summed
    over K in fp32 with the weights in fp32, then rounded once to
    ``y_sorted.dtype``: deterministic, no atomics, forward and backward
    (``inverse`` is a permutation: its gradient is a gather too).
    """
    check_combine_args(y_sorted, weights, inverse)
    tokens, top_k = weights.shape
    y = gather_permutation(y_sorted, inverse).view(tokens, top_k, y_sorted.shape[1])
    # bf16 * fp32 promotes inside the multiply: no fp32 copy of y (at T=4096
    # on the H200 that copy was 2 % of the Mixtral layer's time)
    out = (y * weights.float().unsqueeze(-1)).sum(dim=1)
    return out.to(y_sorted.dtype)


def combine_reference(y_sorted: torch.Tensor, weights: torch.Tensor,
                      inverse: torch.Tensor) -> torch.Tensor:
    """:func:`combine`, one token and one slot at a time in fp32 (tests only)."""
    check_combine_args(y_sorted, weights, inverse)
    tokens, top_k = weights.shape
    out = torch.zeros(tokens, y_sorted.shape[1], dtype=torch.float32, device=y_sorted.device)
    for t in range(tokens):
        for k in range(top_k):
            row = int(inverse[t * top_k + k])
            out[t] += float(weights[t, k]) * y_sorted[row].float()
    return out.to(y_sorted.dtype)
