"""The routing ops around the expert GEMMs, and the router-kernel switch:

- ``torch.ops.ts_moe.router_logits(x, weight)``: ``x @ weight.T``;
- ``torch.ops.ts_moe.route_slots(logits, top_k)``: Mixtral routing and the
  expert order of the (token, k) slots (:func:`route`, :func:`sort_slots`);
- ``torch.ops.ts_moe.sort_slots(experts, num_experts)``: the slot order alone;
- ``torch.ops.ts_moe.combine(y_sorted, weights, inverse)``: the weighted sum
  of each token's expert outputs;
- ``torch.ops.ts_moe.combine_grad(dout, y_sorted, weights, order)``: both of its
  gradients in one pass (the MoE layer's backward, :mod:`ts_moe.experts_grad`);

and :func:`gather_rows`, the row gather ahead of a GEMM that does not gather.
On a device with the sm_90 kernels, each takes its kernel where the
kernel's ``choose_config`` takes the call (a decode batch: one
launch each), else :mod:`ts_moe.reference` (on the device, no host sync):
the same results, bit for bit.  None is differentiable itself: where an input
needs a gradient, the public functions run the differentiable references.
"""

import torch

from .. import reference
from ..checks import check_combine_args, check_combine_grad_args, check_experts, check_flag, \
    check_permute_args, check_route_args, check_router_args
from ..reference import Dispatch, SlotOrder
from ..settings import settings
from . import paths
from .backend import Op, run_first
from .layout import row_major
from .library import define


def use_router_kernel(enabled: bool = True) -> bool:
    """Set ``ts_moe.settings.router_kernel`` to ``bool(enabled)``: take
    :func:`router_logits` of small batches (bf16/fp16, the kernel's reads within
    ``csrc_free_kernels.routing.router_sm90_launch.ROUTER_KERNEL_MAX_READ``) on the sm_90
    path to ts_moe's router kernel (one launch, fp32 sums in a fixed order) instead of ``F.linear`` (cuBLAS: two launches at decode shapes), and
    :func:`route_slots` of batches from ``ROUTE_SPLIT_MIN_WORK`` to the top-k on
    many CTAs and the slot order in a second launch (the same experts, weights
    and order, bit for bit).  Off by default until it has been measured on the
    GPU (bench/notes/2026-12-04-router-kernel.md).  Returns the previous setting; takes
    effect on the next call (the layer's decode graphs key on it; a
    ``torch.compile(mode="reduce-overhead")`` graph keeps the router it was
    recorded with: set this before compiling)."""
    previous, settings.router_kernel = settings.router_kernel, bool(enabled)
    return previous


def router_kernel_enabled() -> bool:
    """``ts_moe.settings.router_kernel``: whether :func:`use_router_kernel` is on."""
    return settings.router_kernel


# ------------------------------------------------------------------ kernels
def _router_logits_impl(x, weight):
    check_router_args(x, weight)
    return run_first(paths.device_backends(Op.ROUTER_LOGITS, x), x, weight)


class _SplitRouting:
    """A ``RouteSlots`` backend made of two: the routing on the many-CTA top-k kernel,
    then the slot order in a second launch; it takes a batch the one-CTA kernel
    (``kernel``) takes that is large enough for the top-k's CTAs."""

    def __init__(self, kernel, topk):
        self.kernel, self.topk = kernel, topk

    def choose_config(self, logits, top_k):
        taken = self.kernel.choose_config(logits, top_k)
        return self.topk.choose_config(logits, top_k) if taken else taken

    def run(self, logits, top_k, config):
        weights, experts = self.topk.run(logits, top_k, config)
        return (weights, experts, *_sort(experts, logits.shape[1]))


def _route_slots_impl(logits, top_k):
    check_route_args(logits, top_k)
    logits = logits.contiguous()
    backends = paths.device_backends(Op.ROUTE_SLOTS, logits)
    reference = paths.TABLE[paths.Path.REFERENCE]
    topk = paths.device_backends(Op.ROUTE_TOPK, logits)[0]
    if backends[0] is not reference[Op.ROUTE_SLOTS] and topk is not reference[Op.ROUTE_TOPK]:
        backends = (_SplitRouting(backends[0], topk), *backends)  # the router kernels on
    return run_first(backends, logits, top_k)


def _sort(experts, num_experts):
    return run_first(paths.device_backends(Op.SORT_SLOTS, experts), experts, num_experts)


def _sort_slots_impl(experts, num_experts):
    check_experts(experts, num_experts)
    return _sort(experts.contiguous(), num_experts)


def _combine_impl(y_sorted, weights, inverse):
    check_combine_args(y_sorted, weights, inverse)
    return _row_sum(y_sorted, inverse.contiguous(), weights)


def _combine_grad_impl(dout, y_sorted, weights, order):
    check_combine_grad_args(dout, y_sorted, weights, order)
    if y_sorted.shape[0] == 0:
        return y_sorted.new_empty(y_sorted.shape), y_sorted.new_empty(
            0, dtype=reference.acc_dtype(y_sorted.dtype))
    return run_first(paths.device_backends(Op.COMBINE_GRAD, y_sorted), row_major(dout),
                     row_major(y_sorted), weights, order.contiguous())


def _row_sum(src, index, weights):
    return run_first(paths.device_backends(Op.ROW_SUM, src), src, index, weights)


def gather_rows(a: torch.Tensor, a_index: torch.Tensor) -> torch.Tensor:
    """``a[a_index]`` with zero rows for indices outside ``[0, M)``: one launch of
    the row kernel on an sm_90 device, else :func:`ts_moe.reference.gather_rows`
    (a validated ``a_index``)."""
    return _row_sum(a, a_index.contiguous(), None)


def _combine_grad_fake(dout, y_sorted, weights, order):
    check_combine_grad_args(dout, y_sorted, weights, order)
    return (y_sorted.new_empty(y_sorted.shape),
            y_sorted.new_empty(y_sorted.shape[0], dtype=reference.acc_dtype(y_sorted.dtype)))


def _router_logits_fake(x, weight):
    check_router_args(x, weight)
    return x.new_empty(x.shape[0], weight.shape[0])


def _route_slots_fake(logits, top_k):
    check_route_args(logits, top_k)
    tokens, num_experts = logits.shape
    return (logits.new_empty(tokens, top_k, dtype=reference.acc_dtype(logits.dtype)),
            logits.new_empty(tokens, top_k, dtype=torch.int64),
            logits.new_empty(tokens * top_k, dtype=torch.int32),
            logits.new_empty(num_experts, dtype=torch.int32),
            logits.new_empty(tokens * top_k, dtype=torch.int64))


def _sort_slots_fake(experts, num_experts):
    check_experts(experts, num_experts)
    slots = experts.numel()
    return (experts.new_empty(slots, dtype=torch.int32),
            experts.new_empty(num_experts, dtype=torch.int32),
            experts.new_empty(slots, dtype=torch.int64))


def _combine_fake(y_sorted, weights, inverse):
    check_combine_args(y_sorted, weights, inverse)
    return y_sorted.new_empty(weights.shape[0], y_sorted.shape[1])


ROUTER_LOGITS = define("router_logits(Tensor x, Tensor weight) -> Tensor",
                       _router_logits_impl, _router_logits_impl, _router_logits_fake)
ROUTE_SLOTS = define("route_slots(Tensor logits, int top_k) -> "
                     "(Tensor, Tensor, Tensor, Tensor, Tensor)",
                     _route_slots_impl, _route_slots_impl, _route_slots_fake)
SORT_SLOTS = define("sort_slots(Tensor experts, int num_experts) -> (Tensor, Tensor, Tensor)",
                    _sort_slots_impl, _sort_slots_impl, _sort_slots_fake)
COMBINE = define("combine(Tensor y_sorted, Tensor weights, Tensor inverse) -> Tensor",
                 _combine_impl, _combine_impl, _combine_fake)
COMBINE_GRAD = define("combine_grad(Tensor dout, Tensor y_sorted, Tensor weights, Tensor order) "
                      "-> (Tensor, Tensor)", _combine_grad_impl, _combine_grad_impl,
                      _combine_grad_fake)


# --------------------------------------------------------------- the public
def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in tensors)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The router's logits ``x @ weight.T`` (T, E) in x's dtype.

    ``torch.ops.ts_moe.router_logits``: ``F.linear``, or with
    :func:`use_router_kernel` a small batch on the sm_90 path in one launch of
    ts_moe's router kernel.  The op runs only where it may choose the kernel:
    with the switch off, or where x or weight need a gradient (the op is not
    differentiable itself), ``F.linear`` runs here, without the op's dispatch."""
    if not settings.router_kernel or _wants_grad(x, weight):
        check_router_args(x, weight)
        return torch.nn.functional.linear(x, weight)
    if not all(isinstance(t, torch.Tensor) for t in (x, weight)):
        check_router_args(x, weight)  # the op validates the rest, once
    return ROUTER_LOGITS(x, weight)


def route_slots(logits: torch.Tensor, top_k: int, *,
                renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor, SlotOrder]:
    """:func:`route` and :func:`sort_slots` of its experts: ``(weights, experts,
    SlotOrder)``.

    ``torch.ops.ts_moe.route_slots``: on the sm_90 path a batch of up to 1024
    slots and 256 experts takes one launch (two for larger batches with
    :func:`use_router_kernel`), otherwise :mod:`ts_moe.reference`.  Where the
    logits need a gradient, the differentiable references run.

    ``renormalize=False``: the op's experts and slot order, the weights the
    chosen experts' softmax probabilities as they are
    (:func:`ts_moe.reference.route_weights`, the reference's own formula on
    every path: two more launches on the GPU).
    """
    check_flag("renormalize", renormalize)
    if _wants_grad(logits):
        weights, experts = reference.route(logits, top_k, renormalize)
        return weights, experts, reference.sort_slots(experts, logits.shape[1])
    if not isinstance(logits, torch.Tensor) or type(top_k) is not int:
        check_route_args(logits, top_k)  # the op validates the rest, once
    weights, experts, token_index, offs, inverse = ROUTE_SLOTS(logits, top_k)
    if not renormalize:
        weights = reference.route_weights(logits, experts, False)
    return weights, experts, SlotOrder(token_index, offs, inverse)


def route(logits: torch.Tensor, top_k: int, *,
          renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral routing: ``(weights, experts)``, both (T, top_k), fp32 weights (fp64
    for fp64 logits) summing to 1 per token, int64 experts in decreasing order of logit, ties to
    the lower expert (:func:`ts_moe.reference.route` says how).
    ``renormalize=False``: the weights are the chosen experts' softmax
    probabilities as they are (Qwen-MoE's ``norm_topk_prob`` false).

    The weights and experts of :func:`route_slots` (on the sm_90 path its one
    launch computes the slot order too; take it from there when it is needed)."""
    weights, experts, _ = route_slots(logits, top_k, renormalize=renormalize)
    return weights, experts


def sort_slots(experts: torch.Tensor, num_experts: int) -> SlotOrder:
    """The expert order of the (token, k) slots of ``experts`` (T, top_k):
    ``SlotOrder(token_index, offs, inverse)`` (:func:`ts_moe.reference.sort_slots`:
    stable, and an id outside ``[0, num_experts)`` is a dropped slot that
    counts for no expert and sorts after ``offs[-1]``).

    ``torch.ops.ts_moe.sort_slots``: one launch on the sm_90 path for up to
    1024 slots and 256 experts."""
    if not isinstance(experts, torch.Tensor) or type(num_experts) is not int:
        check_experts(experts, num_experts)  # the op validates the rest, once
    return SlotOrder(*SORT_SLOTS(experts, num_experts))


def permute(x: torch.Tensor, experts: torch.Tensor, num_experts: int) -> Dispatch:
    """The token rows of ``x`` (T, H) gathered into the expert order of
    :func:`sort_slots`: ``Dispatch(x_sorted, offs, inverse)``.

    The MoE layer itself passes :func:`sort_slots`'s ``token_index`` to the
    first grouped GEMM as ``a_index`` instead (no separate permuted copy)."""
    check_permute_args(x, experts, num_experts)
    slots = sort_slots(experts, num_experts)
    return Dispatch(x.index_select(0, slots.token_index), slots.offs, slots.inverse)


def combine(y_sorted: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * y_sorted[inverse[t * top_k + k]]``, (T, H) in
    ``y_sorted``'s dtype (a float one): fp32 sums (fp64 for fp64), one rounding, no
    atomics; the three tensors on one device.  ``inverse``: any indices into ``y_sorted``'s rows (a permutation, as
    :func:`sort_slots` makes it, or not); under autograd ``y_sorted``'s gradient is the gather's exact
    adjoint (:func:`ts_moe.reference.combine`).

    ``torch.ops.ts_moe.combine``: one launch on the sm_90 path; where
    ``y_sorted`` or ``weights`` need a gradient, :func:`ts_moe.reference.combine`."""
    if _wants_grad(y_sorted, weights):
        return reference.combine(y_sorted, weights, inverse)
    if not all(isinstance(t, torch.Tensor) for t in (y_sorted, weights, inverse)):
        check_combine_args(y_sorted, weights, inverse)  # the op validates the rest
    return COMBINE(y_sorted, weights, inverse)
