"""Torch side of the opt-in router kernels of :mod:`.router_sm90`: compile (once
per build) and launch them on the current stream.

- :data:`ROUTER_LOGITS`, :data:`ROUTE_TOPK`: the sm_90 backends the op layer
  takes with ``ts_moe.use_router_kernel`` (``ts_moe.ops.backend``); their
  ``choose_config`` holds when each pays (:data:`ROUTER_KERNEL_MAX_READ`,
  :data:`ROUTE_SPLIT_MIN_WORK`: estimates until the GPU A/B);
- :func:`router_logits`, :func:`route_topk`: the module's own entries (tests,
  benchmarks), with their guards.
"""

import functools

import cutlass
import torch

from ..common import compile as kcompile
from .route_sm90 import MAX_EXPERTS
from .route_sm90_launch import _check_top_k, _compact, _rows, lane_width, rows_ok
from .router_sm90 import (ROUTER_EXPERTS_PER_CTA, ROUTER_MAX_TOKENS, ROUTER_TOKENS_PER_CTA,
                          RouterLogits, RouteTopK)


# the router kernel's CTAs read x's rows once per expert pair: it takes a batch
# while they read at most this much (about 250 KB per SM of the H200), e.g.
# Qwen3-30B-A3B up to 64 tokens, DeepSeek-V3 up to 8 (not yet measured)
ROUTER_KERNEL_MAX_READ = 32 << 20
# the one-CTA routing spends about 900 warp instructions a token at 128 experts
# on its top-k rounds (one SM, issue-bound: 9 us at Qwen3-30B-A3B T=64, 17 at
# DeepSeek-V3 T=64).  From this many tokens x logits per lane (E / 32) the
# routing runs a warp a token on many CTAs (RouteTopK) and the slot order in a
# second launch (an estimate: Qwen3 from T=32, DeepSeek-V3 from T=16, Mixtral
# from T=128; bench/notes/2026-12-04-routing-packed-topk.md)
ROUTE_SPLIT_MIN_WORK = 128


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
                                               router_fake_args(kcompile.CUTE_DTYPES[dtype])))


@functools.cache
def _topk_kernel(dtype: torch.dtype, per_lane: int):
    key = ("RouteTopK", str(dtype), per_lane, "sm_90a")
    return kcompile.get_compiled(key, lambda: (RouteTopK(per_lane),
                                               topk_fake_args(kcompile.CUTE_DTYPES[dtype])))


def router_read_bytes(tokens: int, experts: int, hidden: int) -> int:
    """The bytes :class:`RouterLogits`'s CTAs read (from L2 and HBM): each its
    experts' rows and its tokens' rows, of 16-bit elements."""
    ctas_e = -(-experts // ROUTER_EXPERTS_PER_CTA)
    ctas_t = -(-tokens // ROUTER_TOKENS_PER_CTA)
    rows = (min(experts, ROUTER_EXPERTS_PER_CTA) + min(tokens, ROUTER_TOKENS_PER_CTA))
    return ctas_e * ctas_t * rows * hidden * 2


def _weight_rows_ok(t: torch.Tensor) -> bool:
    """Rows as the router kernel is compiled for: 16-byte vectors, 16-byte strides."""
    return rows_ok(t) and t.stride(0) % 8 == 0


class RouterLogitsBackend:
    """The sm_90 backend of ``ts_moe::router_logits`` with the router kernel on:
    16-bit batches of up to ``ROUTER_MAX_TOKENS`` whose reads stay within
    :data:`ROUTER_KERNEL_MAX_READ`.  The choice rests on shapes, dtypes and the
    weight (which a decode graph keys on), never on x's strides: ``run``
    copies rows the kernel cannot read, so a graph replay routes as the eager
    call did."""

    def choose_config(self, x, weight) -> torch.dtype | None:
        tokens, hidden = x.shape
        if (x.dtype not in (torch.bfloat16, torch.float16) or not 0 < tokens <= ROUTER_MAX_TOKENS
                or not weight.shape[0] or hidden % 8 or not _weight_rows_ok(weight)
                or router_read_bytes(tokens, *weight.shape) > ROUTER_KERNEL_MAX_READ):
            return None
        return x.dtype

    def run(self, x, weight, config):
        if not _weight_rows_ok(x):
            x = x.clone(memory_format=torch.contiguous_format)
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        _router_kernel(config)(x, weight, out)
        return out


class RouteTopKBackend:
    """The sm_90 backend of the routing alone, a warp a token on many CTAs (the
    op then sorts the slots in a second launch): taken with the router kernel
    on, from :data:`ROUTE_SPLIT_MIN_WORK`; config: the logits per lane."""

    def choose_config(self, logits, top_k) -> int | None:
        tokens, num_experts = logits.shape
        if not 0 < num_experts <= MAX_EXPERTS:
            return None
        width = lane_width(num_experts)
        return width if tokens * width >= ROUTE_SPLIT_MIN_WORK else None

    def run(self, logits, top_k, config):
        tokens = logits.shape[0]
        weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
        experts = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
        if tokens:
            _topk_kernel(logits.dtype, config)(logits, weights, experts)
        return weights, experts


ROUTER_LOGITS = RouterLogitsBackend()
ROUTE_TOPK = RouteTopKBackend()


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
    experts and weights of :func:`.route_sm90_launch.route_slots`, bit for bit.  ``weights`` and
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
