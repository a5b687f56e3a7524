"""Torch side of the opt-in router kernels of :mod:`.router_sm90`: their builds,
compiled once each, and their backends, which launch them on the current stream.

- :func:`logits_build`, :func:`topk_build`, :func:`builds`: one compile, and every one a
  call can reach; :func:`checked`: those the PTX tests and the pre-flight compile;
- :data:`ROUTER_LOGITS`, :data:`ROUTE_TOPK`: the sm_90 backends the op layer
  takes with ``ts_moe.use_router_kernel`` (``ts_moe.ops.backend``); their
  ``choose_config`` holds when each pays (:data:`ROUTER_KERNEL_MAX_READ`,
  :data:`ROUTE_SPLIT_MIN_WORK`; ``bench/notes/2026-12-06-h100-run.md`` has the A/B);
  :data:`KERNELS`.
"""

import functools

import cutlass
import torch

from ..common import compile as kcompile
from ..common.family import Build, Kernels, Op
from ..common.kernel_config import Declined
from .route_sm90 import LANE_WIDTHS, MAX_EXPERTS
from .route_sm90_launch import (_SUFFIX, LOGITS, ROWS, fake_compact, fake_rows, lane_width,
                                rows_ok)
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
    return (fake_rows(dtype, t, h), fake_rows(dtype, e, h), fake_compact(dtype, t, e),
            kcompile.fake_stream())


def topk_fake_args(dtype) -> tuple:
    """Symbolic T, E, k: logits (T, E) of ``dtype``, weights and experts (T, k)."""
    t, e, k = kcompile.sym_dims(3)
    return (fake_compact(dtype, t, e), fake_compact(cutlass.Float32, t, k),
            fake_compact(cutlass.Int64, t, k), kcompile.fake_stream())


def logits_build(dtype: torch.dtype) -> Build:
    """The router logits of ``dtype`` tokens and weights (``router_logits``, ``_fp16``)."""
    key = ("RouterLogits", str(dtype), "sm_90a")
    return Build("router_logits" + _SUFFIX[dtype], key,
                 lambda: (RouterLogits(), router_fake_args(kcompile.CUTE_DTYPES[dtype])),
                 {"dtype": dtype})


def topk_build(dtype: torch.dtype, per_lane: int) -> Build:
    """The routing alone from ``dtype`` logits, ``per_lane`` logits a lane
    (``route_topk``; ``_f32``, ``_e32`` ... ``_e128`` as for the routing's builds)."""
    key = ("RouteTopK", str(dtype), per_lane, "sm_90a")
    name = "route_topk" + _SUFFIX[dtype] + ("" if per_lane == 8 else f"_e{32 * per_lane}")
    return Build(name, key,
                 lambda: (RouteTopK(per_lane), topk_fake_args(kcompile.CUTE_DTYPES[dtype])),
                 {"dtype": dtype, "per_lane": per_lane})


def builds():
    """Every build a call can reach: the logits per 16-bit type, the routing per logits
    type and lane width."""
    for dtype in ROWS:
        yield logits_build(dtype)
    for dtype in LOGITS:
        for per_lane in LANE_WIDTHS:
            yield topk_build(dtype, per_lane)


_CHECKED = {"router_logits", "router_logits_fp16", "route_topk", "route_topk_f32_e128"}


def checked(b: Build) -> bool:
    """The logits in both types; the routing at 256 experts (bf16) and 128 (fp32)."""
    return b.name in _CHECKED


@functools.cache
def _router_kernel(dtype: torch.dtype):
    b = logits_build(dtype)
    return kcompile.get_compiled(b)


@functools.cache
def _topk_kernel(dtype: torch.dtype, per_lane: int):
    b = topk_build(dtype, per_lane)
    return kcompile.get_compiled(b)


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

    def choose_config(self, x, weight) -> torch.dtype | Declined:
        tokens, hidden = x.shape
        if x.dtype not in ROWS:
            return Declined(f"{x.dtype} x: the router kernel takes bf16 or fp16")
        if not 0 < tokens <= ROUTER_MAX_TOKENS or not weight.shape[0]:
            return Declined(f"{tokens} tokens, {weight.shape[0]} experts: the router kernel "
                            f"takes 1 to {ROUTER_MAX_TOKENS} tokens")
        if hidden % 8 or not _weight_rows_ok(weight):
            return Declined("rows the router kernel cannot read (H a multiple of 8, "
                            "16-byte strides)")
        if router_read_bytes(tokens, *weight.shape) > ROUTER_KERNEL_MAX_READ:
            return Declined(f"{tokens} tokens: F.linear reads less than the router kernel's "
                            f"CTAs would (ROUTER_KERNEL_MAX_READ)")
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

    def choose_config(self, logits, top_k) -> int | Declined:
        tokens, num_experts = logits.shape
        if not 0 < num_experts <= MAX_EXPERTS:
            return Declined(f"{num_experts} experts: the routing kernels take 1 to "
                            f"{MAX_EXPERTS}")
        width = lane_width(num_experts)
        if tokens * width < ROUTE_SPLIT_MIN_WORK:
            return Declined(f"{tokens} tokens: the one-CTA routing is faster below "
                            f"ROUTE_SPLIT_MIN_WORK")
        return width

    def run(self, logits, top_k, config):
        tokens = logits.shape[0]
        weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
        experts = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
        if tokens:
            _topk_kernel(logits.dtype, config)(logits, weights, experts)
        return weights, experts


ROUTER_LOGITS = RouterLogitsBackend()
ROUTE_TOPK = RouteTopKBackend()


KERNELS = Kernels(backends={Op.ROUTER_LOGITS: ROUTER_LOGITS, Op.ROUTE_TOPK: ROUTE_TOPK},
                  builds=builds, checked=checked, max_experts=MAX_EXPERTS)
