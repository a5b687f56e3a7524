"""Torch entry points of the opt-in router kernels of :mod:`.router_sm90`:
:func:`router_logits` and :func:`route_topk` compile (once per build) and launch
them on the current stream; :func:`router_read_bytes` is what the op layer's
choice rests on."""

import functools

import cutlass
import torch

from . import compile as kcompile
from .route_sm90 import MAX_EXPERTS
from .route_sm90_launch import _TORCH_TO_CUTE, _check_top_k, _compact, _rows, lane_width
from .router_sm90 import (ROUTER_EXPERTS_PER_CTA, ROUTER_MAX_TOKENS, ROUTER_TOKENS_PER_CTA,
                          RouterLogits, RouteTopK)


def router_fake_args(dtype) -> tuple:
    """x (T, H) and w (E, H) rows with free 16-byte strides; out (T, E) compact."""
    t, e, h = kcompile.sym_dims(3)
    return _rows(dtype, t, h), _rows(dtype, e, h), _compact(dtype, t, e), kcompile.fake_stream()


def topk_fake_args(dtype) -> tuple:
    """Symbolic T, E, k: logits (T, E) of ``dtype``, weights and experts (T, k)."""
    t, e, k = kcompile.sym_dims(3)
    return (_compact(dtype, t, e), _compact(cutlass.Float32, t, k), _compact(cutlass.Int64, t, k),
            kcompile.fake_stream())


@functools.cache
def _router_kernel(dtype: torch.dtype):
    key = ("RouterLogits", str(dtype), "sm_90a")
    return kcompile.get_compiled(key, lambda: (RouterLogits(),
                                               router_fake_args(_TORCH_TO_CUTE[dtype])))


@functools.cache
def _topk_kernel(dtype: torch.dtype, per_lane: int):
    key = ("RouteTopK", str(dtype), per_lane, "sm_90a")
    return kcompile.get_compiled(key, lambda: (RouteTopK(per_lane),
                                               topk_fake_args(_TORCH_TO_CUTE[dtype])))


def router_read_bytes(tokens: int, experts: int, hidden: int) -> int:
    """The bytes :class:`RouterLogits`'s CTAs read (from L2 and HBM): each its
    experts' rows and its tokens' rows, of 16-bit elements."""
    ctas_e = -(-experts // ROUTER_EXPERTS_PER_CTA)
    ctas_t = -(-tokens // ROUTER_TOKENS_PER_CTA)
    rows = (min(experts, ROUTER_EXPERTS_PER_CTA) + min(tokens, ROUTER_TOKENS_PER_CTA))
    return ctas_e * ctas_t * rows * hidden * 2


def router_logits(x: torch.Tensor, weight: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` (T, E) in x's dtype: x (T, H) and weight (E, H) bf16/fp16
    with 16-byte rows (H a multiple of 8, row strides too), ``out`` (T, E)
    contiguous or None; on the current stream."""
    tokens, hidden = x.shape
    if not 0 < tokens <= ROUTER_MAX_TOKENS:
        raise ValueError(f"the router kernel takes 1 to {ROUTER_MAX_TOKENS} tokens, "
                         f"got {tokens}")
    if hidden % 8 or weight.shape[1] != hidden:
        raise ValueError(f"x (T, H) and weight (E, H) need one H, a multiple of 8: got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if out is None:
        out = torch.empty(tokens, weight.shape[0], dtype=x.dtype, device=x.device)
    if weight.shape[0]:
        _router_kernel(x.dtype)(x, weight, out)
    return out


def route_topk(logits: torch.Tensor, top_k: int, weights: torch.Tensor | None = None,
               experts: torch.Tensor | None = None):
    """(weights (T, k) fp32, experts (T, k) int64): ``ts_moe.route`` of ``logits``
    (T, E) contiguous, E <= MAX_EXPERTS, a warp a token on many CTAs; the
    experts and weights of :func:`route_slots`, bit for bit.  ``weights`` and
    ``experts``: contiguous outputs to write, or None."""
    tokens, num_experts = logits.shape
    if not 0 < num_experts <= MAX_EXPERTS:
        raise ValueError(f"the routing kernel takes 1 to {MAX_EXPERTS} experts, "
                         f"got {num_experts}")
    _check_top_k(top_k, num_experts)
    dev = logits.device
    if weights is None:
        weights = torch.empty(tokens, top_k, dtype=torch.float32, device=dev)
    if experts is None:
        experts = torch.empty(tokens, top_k, dtype=torch.int64, device=dev)
    if tokens:
        _topk_kernel(logits.dtype, lane_width(num_experts))(logits, weights, experts)
    return weights, experts
