"""The experts of a bf16/fp16/fp32 layer under autograd as one node, whose backward knows
the slot order is a permutation.

The layer's ops each have a gradient of their own (:mod:`ts_moe.ops`), and composed they
train; but each op's gradient holds for any index it was given, so the row gather before
the first GEMM and the combine's gather get torch's general adjoint: a sort of the
gradient rows by destination and an add (``index_put_(accumulate=True)``), over (T k, H)
rows, twice a step, and the combine's fp32 (T k, H) products.  In the layer the slots'
``token_index`` and ``inverse`` come from :func:`ts_moe.sort_slots`: every slot is one
sorted row and back.  Knowing that, the backward is::

    dy, dw_sorted = combine_grad(dout, y, weights, order)   one pass (T k, H)
    d_down = dW(act, dy);  d_act = dy @ down                 grouped GEMMs
    dh = swiglu_backward(d_act, h)
    d_gate_up = dW(x[token_index], dh);  dx_sorted = dh @ gate_up
    dx = combine(dx_sorted, 1, inverse)                      the k rows of a token summed
    d_weights = dw_sorted[inverse]

(``order`` is ``inverse``'s inverse permutation, made once in the forward.)  Every product
is an op on the forward's path (kernels, torch, references); nothing syncs with the host.

Saved for the backward: the pre-activation ``h`` (T k, 2I) and the activation (T k, I)
(as the ops' own gradients keep them: bench/notes/2026-12-04-swiglu-keep-h.md) and ``y``
(T k, H) for the routing weights' gradient, each dropped as soon as the backward has
used it (the peak stays under the plain layer's; a second backward through the node,
``retain_graph=True``, computes them again); ``x[token_index]`` is gathered again rather
than kept.  A backward that must itself be differentiable
(``create_graph=True``) replays the forward on the composed ops and differentiates that.
"""

import torch

from .ops import combine, grouped_gemm
from .ops.gemm import weight_grad
from .ops.routing import COMBINE_GRAD
from .ops.swiglu import SWIGLU, SWIGLU_BACKWARD
from .reference import SlotOrder


def wants_node(x: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> bool:
    """Whether a forward of these tensors records a gradient."""
    return torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, weights, gate_up, down))


def inverse_order(inverse: torch.Tensor) -> torch.Tensor:
    """The slot of each sorted row: the inverse permutation of ``inverse``."""
    return torch.empty_like(inverse).scatter_(
        0, inverse, torch.arange(inverse.shape[0], device=inverse.device, dtype=inverse.dtype))


def composed(x, weights, gate_up, down, slots: SlotOrder) -> torch.Tensor:
    """The same forward on the ops, each with its own gradient (double backward)."""
    h = grouped_gemm(x, gate_up.transpose(-2, -1), slots.offs, a_index=slots.token_index)
    y = grouped_gemm(SWIGLU(h), down.transpose(-2, -1), slots.offs)
    return combine(y, weights, slots.inverse)


class _Experts(torch.autograd.Function):
    """The experts (module docstring); the inputs after ``slots`` are its tensors."""

    @staticmethod
    def forward(ctx, x, weights, gate_up, down, token_index, offs, inverse):
        h, act, y = _intermediates(x, gate_up, down, token_index, offs)
        out = combine(y, weights, inverse)
        ctx.save_for_backward(x, weights, gate_up, down, token_index, offs, inverse)
        # the intermediates on ctx, not saved tensors: the backward drops each once used
        ctx.order, ctx.h, ctx.act, ctx.y = inverse_order(inverse), h, act, y
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weights, gate_up, down, token_index, offs, inverse = ctx.saved_tensors
        need_x, need_w, need_gu, need_down = ctx.needs_input_grad[:4]
        if torch.is_grad_enabled():  # create_graph: a differentiable backward
            return _composed_grads(ctx, dout, x, weights, gate_up, down,
                                   SlotOrder(token_index, offs, inverse))
        if ctx.h is None:  # a second backward (retain_graph): the first dropped them
            ctx.h, ctx.act, ctx.y = _intermediates(x, gate_up, down, token_index, offs)
            ctx.order = inverse_order(inverse)
        dy, dw_sorted = COMBINE_GRAD(dout.to(x.dtype), ctx.y, weights, ctx.order)
        _drop(ctx, "y", "order")
        d_weights = dw_sorted.index_select(0, inverse).view(weights.shape).to(weights.dtype) \
            if need_w else None
        d_down = weight_grad(ctx.act, dy, offs, down.transpose(-2, -1)).transpose(-2, -1) \
            if need_down else None
        _drop(ctx, "act")
        d_act = grouped_gemm(dy, down, offs)
        del dy
        dh = SWIGLU_BACKWARD(d_act, ctx.h)
        del d_act
        _drop(ctx, "h")
        d_gate_up = None
        if need_gu:
            x_sorted = x.index_select(0, token_index)
            d_gate_up = weight_grad(x_sorted, dh, offs,
                                    gate_up.transpose(-2, -1)).transpose(-2, -1)
            del x_sorted
        dx = None
        if need_x:
            dx_sorted = grouped_gemm(dh, gate_up, offs)
            del dh
            dx = combine(dx_sorted, torch.ones_like(weights), inverse)
        return dx, d_weights, d_gate_up, d_down, None, None, None


def _intermediates(x, gate_up, down, token_index, offs) -> tuple:
    """The forward up to the combine: ``(h, act, y)``, the pre-activation (T k, 2I), the
    activation (T k, I) and the expert rows (T k, H)."""
    h = grouped_gemm(x, gate_up.transpose(-2, -1), offs, a_index=token_index)
    act = SWIGLU(h)
    y = grouped_gemm(act, down.transpose(-2, -1), offs,
                     prefetch_weights=not torch.compiler.is_compiling())
    return h, act, y


def _drop(ctx, *names: str) -> None:
    """Free the intermediates the backward has used (eager: their memory returns now; a
    compiled graph schedules its own frees, and its trace must keep them)."""
    if not torch.compiler.is_compiling():
        for name in names:
            setattr(ctx, name, None)


def _composed_grads(ctx, dout, x, weights, gate_up, down, slots):
    inputs = (x, weights, gate_up, down)
    wanted = [t for t, need in zip(inputs, ctx.needs_input_grad[:4]) if need]
    grads = iter(torch.autograd.grad(composed(x, weights, gate_up, down, slots), wanted,
                                     dout, create_graph=True))
    return (*(next(grads) if need else None for need in ctx.needs_input_grad[:4]),
            None, None, None)


def experts(x: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, slots: SlotOrder) -> torch.Tensor:
    """The layer's experts and combine for tokens ``x`` (T, H) in the slot order of
    :func:`ts_moe.sort_slots` (``inverse`` a permutation), as one autograd node: (T, H)."""
    return _Experts.apply(x, weights, gate_up, down, *slots)
