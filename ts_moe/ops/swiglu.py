"""The SwiGLU ops and their gradients:

- ``torch.ops.ts_moe.grouped_gemm_swiglu(a, gate_up, offs)``: ``silu(a @
  gate^T) * (a @ up^T)`` per expert, the expert GEMM and its activation in
  one pass where the path's kernel takes the shapes;
- ``torch.ops.ts_moe.swiglu(h)`` and ``swiglu_backward(dy, h)``: the
  activation alone and its gradient (the pieces of the fused op's formula;
  ops of their own so that traced training graphs hold them).

Every op here has an autograd formula made of ops, so the gradient runs on
the forward's path, and double backward is exact on every path (the
gradient of ``swiglu_backward`` is :func:`ts_moe.reference.swiglu_double_backward`).
"""

import torch

from ..checks import check_swiglu_activation_args, check_swiglu_args, check_tensor_types, \
    contiguous_dim, layout_ready
from ..reference import gather_rows, swiglu, swiglu_double_backward
from . import paths, routing
from .backend import Op, OutputSpec, fused_or_split, take
from .gemm import grouped_gemm, scatter_rows, weight_grad
from .layout import aligned_rows, empty_output, one_segment, row_major, row_pad, tma_view
from .library import below_autograd, define

GROUPED_SCHEMA = "grouped_gemm_swiglu(Tensor a, Tensor gate_up, Tensor offs, *, " \
                 "Tensor? a_index=None) -> Tensor"
ACTIVATION_SCHEMA = "swiglu(Tensor h) -> Tensor"
BACKWARD_SCHEMA = "swiglu_backward(Tensor dy, Tensor h) -> Tensor"

# The fused op under autograd keeps its pre-activation h (M, 2I) from the
# forward (True) or recomputes it in the backward (False): measured both, see
# bench/notes/2026-12-04-swiglu-keep-h.md
SWIGLU_KEEPS_H = True


# ------------------------------------------------------ grouped_gemm_swiglu
def run(capability, a, gate_up, offs, a_index=None) -> torch.Tensor:
    """A validated call on a device of ``capability`` (None: the references): the empty
    sizes answered here, a broadcast ``gate_up`` as one matrix
    (:func:`ts_moe.ops.layout.one_segment`), the operands in the backends' layout, then
    :func:`dispatch`."""
    m = (a if a_index is None else a_index).shape[0]
    num_experts, two_i, k = gate_up.shape
    if m == 0 or two_i == 0 or k == 0 or num_experts == 0:
        return empty_output(a, m, two_i // 2, a.dtype).zero_()
    gate_up, offs = one_segment(gate_up, offs)
    a = tma_view(a, 1) if a_index is None else aligned_rows(a)
    return dispatch(capability, a,
                    tma_view(gate_up, contiguous_dim(gate_up.shape, gate_up.stride())), offs,
                    a_index)


def dispatch(capability, a, gate_up, offs, a_index=None) -> torch.Tensor:
    """The first path whose fused backend takes the call; where it declines (I not a
    multiple of its tile), that path's GEMM to h (M, 2I) in fp32 and the activation
    in fp32, one rounding (:func:`ts_moe.ops.backend.fused_or_split`)."""
    m = (a if a_index is None else a_index).shape[0]
    two_i = gate_up.shape[1]
    out = empty_output(a, m, two_i // 2, a.dtype)
    b = gate_up.transpose(-2, -1)

    def run_on(backend, config, fused):
        rows, index, prefetch_weights = a, a_index, False
        if a_index is not None and not backend.gathers:
            # the row gather is the kernel ahead: offs and gate_up are older
            rows, index, prefetch_weights = routing.gather_rows(a, a_index), None, True
        if fused:
            return backend.run(rows, gate_up, offs, out, config, a_index=index,
                               prefetch_weights=prefetch_weights)
        h = backend.run(rows, b, offs, empty_output(a, m, two_i, torch.float32), config,
                        a_index=index, prefetch_weights=prefetch_weights)
        return out.copy_(swiglu(h, a.dtype))

    return fused_or_split(
        paths.pairs(Op.GROUPED_GEMM_SWIGLU, Op.GROUPED_GEMM, capability, a.dtype,
                    gate_up.shape[0]),
        (a, gate_up, offs, out, a_index),
        (a, b, offs, OutputSpec((m, two_i), torch.float32), a_index), run_on)


def _cpu(a, gate_up, offs, *, a_index=None):
    check_swiglu_args(a, gate_up, offs, a_index=a_index)
    return run(None, a, gate_up, offs, a_index)


def _cuda(a, gate_up, offs, *, a_index=None):
    capability = paths.device_capability(a)
    if (a_index is None and layout_ready(a, gate_up, offs, None, a.get_device(), k_dim=2)
            and gate_up.shape[1] % 2 == 0):
        # the hot path: valid, and already in the backends' layout
        return dispatch(capability, a, gate_up, offs)
    check_swiglu_args(a, gate_up, offs, a_index=a_index)
    return run(capability, a, gate_up, offs, a_index)


def _fake(a, gate_up, offs, *, a_index=None):
    check_swiglu_args(a, gate_up, offs, fake=True, a_index=a_index)
    inter = gate_up.shape[1] // 2
    m = a.shape[0] if a_index is None else a_index.shape[0]
    return a.new_empty_strided((m, inter), (row_pad(inter, a.dtype), 1))


def grouped_gemm_swiglu_backward(dy, a, gate_up, offs, a_index=None, need_a=True,
                                 need_gate_up=True):
    """``(da, dgate_up)`` of ``grouped_gemm_swiglu`` without :data:`SWIGLU_KEEPS_H`:
    the pre-activation ``h`` (M, 2I) recomputed, ``dh`` = d(SwiGLU)/dh
    (``ts_moe::swiglu_backward``), then ``da = grouped_gemm(dh, gate_up)`` and
    ``dgate_up = grouped_gemm(dh.t(), a)`` (k-grouped).  (With it, the op is the
    GEMM to h and ``ts_moe::swiglu``, each with its own formula.)"""
    x = a if a_index is None else gather_rows(a, a_index)
    dh = SWIGLU_BACKWARD(dy.to(a.dtype), grouped_gemm(x, gate_up.transpose(-2, -1), offs))
    da = dgate_up = None
    if need_a:
        da = grouped_gemm(dh, gate_up, offs)
        if a_index is not None:
            da = scatter_rows(da, a_index, a.shape[0])
    if need_gate_up:
        dgate_up = weight_grad(x, dh, offs, gate_up.transpose(-2, -1)).transpose(-2, -1)
    return da, dgate_up


class _SwigluRecomputeFunction(torch.autograd.Function):
    """``grouped_gemm_swiglu`` under autograd without :data:`SWIGLU_KEEPS_H`: the
    fused forward; ``h`` recomputed in the backward."""

    @staticmethod
    def forward(ctx, keyset, a, gate_up, offs, a_index):
        ctx.save_for_backward(a, gate_up, offs, a_index)
        return below_autograd(GROUPED_GEMM_SWIGLU, keyset, a, gate_up, offs, a_index=a_index)

    @staticmethod
    def backward(ctx, dy):
        a, gate_up, offs, a_index = ctx.saved_tensors
        da, dgate_up = grouped_gemm_swiglu_backward(dy, a, gate_up, offs, a_index,
                                                    *ctx.needs_input_grad[1:3])
        return None, da, dgate_up, None, None


def _grouped_with_grad(keyset, a, gate_up, offs, *, a_index=None):
    if SWIGLU_KEEPS_H:
        # two autograd nodes, the GEMM to h and the activation, so that the
        # engine frees h and the activation's gradient once dh exists (as for
        # any plain-torch layer) rather than at the end of one fused node
        h = grouped_gemm(a, gate_up.transpose(-2, -1), offs, a_index=a_index)
        return SWIGLU(h)
    return _SwigluRecomputeFunction.apply(keyset, a, gate_up, offs, a_index)


# ------------------------------------------------- the activation, and its gradient
def _activation(h, dy, run):
    """``run(backend, config)`` on the device's elementwise kernel where it takes ``h``,
    else on the reference (:func:`ts_moe.ops.backend.take`)."""
    return take(paths.device_backends(Op.SWIGLU_ACTIVATION, h), (h, dy), run)


def _swiglu_impl(h):
    check_swiglu_activation_args(h)
    out = empty_output(h, h.shape[0], h.shape[1] // 2, h.dtype)
    if out.numel() == 0:
        return out
    h = row_major(h)
    return _activation(h, None, lambda backend, config: backend.forward(h, out, config))


def _swiglu_backward_impl(dy, h):
    check_swiglu_activation_args(h, dy)
    dh = empty_output(h, h.shape[0], h.shape[1], h.dtype)
    if dh.numel() == 0:
        return dh
    h, dy = row_major(h), row_major(dy)
    return _activation(h, dy, lambda backend, config: backend.backward(dy, h, dh, config))


def _swiglu_fake(h):
    check_swiglu_activation_args(h)
    inter = h.shape[1] // 2
    return h.new_empty_strided((h.shape[0], inter), (row_pad(inter, h.dtype), 1))


def _swiglu_backward_fake(dy, h):
    check_swiglu_activation_args(h, dy)
    return h.new_empty_strided(h.shape, (row_pad(h.shape[1], h.dtype), 1))


class _SwigluFunction(torch.autograd.Function):
    """``ts_moe::swiglu`` under autograd: keeps ``h``; backward ``ts_moe::swiglu_backward``."""

    @staticmethod
    def forward(ctx, keyset, h):
        ctx.save_for_backward(h)
        return below_autograd(SWIGLU, keyset, h)

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        return None, SWIGLU_BACKWARD(dy.to(h.dtype), h)


class _SwigluBackwardFunction(torch.autograd.Function):
    """``ts_moe::swiglu_backward`` under autograd (double backward through the
    SwiGLU ops): its gradients in ``dy`` and ``h`` by
    :func:`ts_moe.reference.swiglu_double_backward` (plain torch, so a third
    derivative is exact too)."""

    @staticmethod
    def forward(ctx, keyset, dy, h):
        ctx.save_for_backward(dy, h)
        return below_autograd(SWIGLU_BACKWARD, keyset, dy, h)

    @staticmethod
    def backward(ctx, grad):
        dy, h = ctx.saved_tensors
        return None, *swiglu_double_backward(grad, dy, h)


GROUPED_GEMM_SWIGLU = define(GROUPED_SCHEMA, _cpu, _cuda, _fake, with_grad=_grouped_with_grad)
SWIGLU = define(ACTIVATION_SCHEMA, _swiglu_impl, _swiglu_impl, _swiglu_fake,
                with_grad=lambda keyset, h: _SwigluFunction.apply(keyset, h), differentiable=1)
SWIGLU_BACKWARD = define(BACKWARD_SCHEMA, _swiglu_backward_impl, _swiglu_backward_impl,
                         _swiglu_backward_fake,
                         with_grad=lambda keyset, dy, h: _SwigluBackwardFunction.apply(
                             keyset, dy, h))


def grouped_gemm_swiglu(a: torch.Tensor, gate_up: torch.Tensor, offs: torch.Tensor, *,
                        a_index: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.ops.ts_moe.grouped_gemm_swiglu``: ``silu(a @ gate^T) * (a @ up^T)`` per expert.

    gate_up: (E, 2I, H), the Hugging Face (transformers 5) layout, gate rows
    first.  Returns (M, I) in ``a.dtype``; rows past ``offs[-1]`` are zeros.
    The same ragged-expert rules, and ``a_index``, as :func:`ts_moe.grouped_gemm`.
    """
    if not (isinstance(a, torch.Tensor) and isinstance(gate_up, torch.Tensor)
            and isinstance(offs, torch.Tensor)):
        check_tensor_types(a=a, gate_up=gate_up, offs=offs)
    if a_index is None:
        return GROUPED_GEMM_SWIGLU(a, gate_up, offs)
    check_tensor_types(a_index=a_index)
    return GROUPED_GEMM_SWIGLU(a, gate_up, offs, a_index=a_index)
