"""Torch side of the routing kernels of :mod:`.route_sm90`: compile (once per
build) and launch them on the current stream.

- :data:`ROUTE_SLOTS`, :data:`SORT_SLOTS`, :data:`ROW_SUM`: the sm_90 backends
  of the op layer's routing, slot order, combine and row gather
  (``ts_moe.ops.backend``): ``choose_config`` says which batches the one-CTA
  tables and the row kernel take (:func:`fits`, :func:`rows_ok`);
- :func:`route_slots`, :func:`sort_slots`, :func:`weighted_row_sum`: the
  module's own entries (tests, benchmarks), with their guards.
"""

import functools

import cutlass
import cutlass.cute as cute
import torch

from ..common import compile as kcompile
from .route_sm90 import LANE_WIDTHS, MAX_EXPERTS, MAX_SLOTS, RouteSlots, WeightedRowSum


def _compact(dtype, *shape):
    return cute.runtime.make_fake_compact_tensor(
        dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
        assumed_align=dtype.width // 8)


def _rows(dtype, n, h):
    """(n, h) rows of 16-byte vectors with a free row stride."""
    return cute.runtime.make_fake_tensor(
        dtype, (n, h), (cute.sym_int64(divisibility=128 // dtype.width), 1), assumed_align=16)


def route_fake_args(dtype, from_logits: bool) -> tuple:
    """Symbolic T, E, k, and T k (checked against each other on the host);
    ``dtype``: the logits' (``from_logits``) or the input ids'."""
    t, e, k, s = kcompile.sym_dims(4)
    experts = _compact(cutlass.Int64 if from_logits else dtype, t, k)
    logits = _compact(dtype, t, e) if from_logits else None
    weights = _compact(cutlass.Float32, t, k) if from_logits else None
    return (logits, weights, experts, _compact(cutlass.Int32, s), _compact(cutlass.Int32, e),
            _compact(cutlass.Int64, s), kcompile.fake_stream())


def rowsum_fake_args(dtype, index_dtype, weighted: bool) -> tuple:
    """(M, H) source and (T, H) output rows with free 16-byte strides; (R,) index;
    (T, k) weights when ``weighted`` (else R = T)."""
    m, h, t = kcompile.sym_dims(3)
    r, k = kcompile.sym_dims(2) if weighted else (t, None)
    weights = _compact(cutlass.Float32, t, k) if weighted else None
    return (_rows(dtype, m, h), _compact(index_dtype, r), weights, _rows(dtype, t, h),
            kcompile.fake_stream())


def lane_width(num_experts: int) -> int:
    """The :class:`RouteSlots` build for ``num_experts``: logits per lane."""
    return next(w for w in LANE_WIDTHS if 32 * w >= num_experts)


@functools.cache
def _route_kernel(from_logits: bool, dtype: torch.dtype, per_lane: int = 1):
    key = ("RouteSlots", from_logits, str(dtype), per_lane, "sm_90a")

    def build():
        return (RouteSlots(from_logits, per_lane),
                route_fake_args(kcompile.CUTE_DTYPES[dtype], from_logits))

    return kcompile.get_compiled(key, build)


@functools.cache
def _rowsum_kernel(weighted: bool, dtype: torch.dtype, index_dtype: torch.dtype):
    key = ("WeightedRowSum", weighted, str(dtype), str(index_dtype), "sm_90a")

    def build():
        return WeightedRowSum(weighted), rowsum_fake_args(
            kcompile.CUTE_DTYPES[dtype], kcompile.CUTE_DTYPES[index_dtype], weighted)

    return kcompile.get_compiled(key, build)


def fits(slots: int, num_experts: int) -> bool:
    """Whether :func:`route_slots` / :func:`sort_slots` take a batch of this size."""
    return 0 < slots <= MAX_SLOTS and 0 < num_experts <= MAX_EXPERTS


def _check_fits(slots: int, num_experts: int) -> None:
    """The one CTA holds every slot and expert in shared memory: a batch past
    that would run off its tables (the ops check :func:`fits` and take the torch
    path instead; this guards the module's own entries)."""
    if not fits(slots, num_experts):
        raise ValueError(f"the routing kernel takes 1 to {MAX_SLOTS} slots and 1 to "
                         f"{MAX_EXPERTS} experts, got {slots} slots and {num_experts} experts")


def _check_top_k(top_k: int, num_experts: int) -> None:
    """Each top-k round takes a new expert."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the experts), got {top_k}")


def rows_ok(t: torch.Tensor) -> bool:
    """16-bit rows the row kernel reads and writes whole 16-byte vectors of."""
    return (t.dtype in (torch.bfloat16, torch.float16) and t.shape[1] % 8 == 0
            and t.stride(1) == 1 and (t.shape[0] <= 1 or t.stride(0) % 8 == 0)
            and t.data_ptr() % 16 == 0)


def _slot_order(experts, num_experts, from_logits, per_lane, logits=None, weights=None):
    slots = experts.numel()
    dev = experts.device
    token_index = torch.empty(slots, dtype=torch.int32, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    inverse = torch.empty(slots, dtype=torch.int64, device=dev)
    dtype = logits.dtype if from_logits else experts.dtype
    _route_kernel(from_logits, dtype, per_lane)(logits, weights, experts, token_index, offs,
                                                 inverse)
    return token_index, offs, inverse


class RouteSlotsBackend:
    """The sm_90 backend of ``ts_moe::route_slots``: routing and slot order of a
    batch that :func:`fits` in one CTA and one launch; config: the build's
    logits per lane."""

    def choose_config(self, logits, top_k) -> int | None:
        tokens, num_experts = logits.shape
        if (logits.dtype not in (torch.bfloat16, torch.float16, torch.float32)
                or not fits(tokens * top_k, num_experts)):
            return None
        return lane_width(num_experts)

    def run(self, logits, top_k, config):
        tokens = logits.shape[0]
        weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
        experts = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
        return (weights, experts,
                *_slot_order(experts, logits.shape[1], True, config, logits, weights))


class SortSlotsBackend:
    """The sm_90 backend of ``ts_moe::sort_slots``: a batch that :func:`fits`."""

    def choose_config(self, experts, num_experts) -> int | None:
        return 1 if fits(experts.numel(), num_experts) else None

    def run(self, experts, num_experts, config):
        return _slot_order(experts, num_experts, False, config)


class RowSumBackend:
    """The sm_90 backend of the combine and of the row gather: one launch of
    :class:`.route_sm90.WeightedRowSum` (fp32 sums, one rounding) over 16-bit
    rows of whole 16-byte vectors; fp32 weights (others are converted)."""

    def choose_config(self, src, index, weights) -> bool | None:
        if not (src.shape[0] and rows_ok(src) and index.dtype in (torch.int32, torch.int64)
                and index.device == src.device
                and (weights is None or weights.device == src.device)):
            return None
        return weights is not None

    def run(self, src, index, weights, config):
        rows = index.shape[0] if weights is None else weights.shape[0]
        out = src.new_empty(rows, src.shape[1])
        if weights is not None and weights.dtype != torch.float32:
            weights = weights.float()
        if rows and src.shape[1]:
            _rowsum_kernel(config, src.dtype, index.dtype)(
                src, index, None if weights is None else weights.contiguous(), out)
        return out


ROUTE_SLOTS = RouteSlotsBackend()
SORT_SLOTS = SortSlotsBackend()
ROW_SUM = RowSumBackend()


def route_slots(logits: torch.Tensor, top_k: int):
    """(weights, experts, token_index, offs, inverse) of a batch that :func:`fits`;
    ``logits`` (T, E) contiguous, on the current stream.  ``ts_moe.route`` and
    ``ts_moe.sort_slots`` in one launch."""
    tokens, num_experts = logits.shape
    _check_fits(tokens * top_k, num_experts)
    _check_top_k(top_k, num_experts)
    return ROUTE_SLOTS.run(logits, top_k, lane_width(num_experts))


def sort_slots(experts: torch.Tensor, num_experts: int):
    """(token_index, offs, inverse) of ``experts`` (T, k) int32/int64 contiguous,
    a batch that :func:`fits`: ``ts_moe.sort_slots`` in one launch."""
    _check_fits(experts.numel(), num_experts)
    return SORT_SLOTS.run(experts, num_experts, 1)


def weighted_row_sum(src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None,
                     out: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * src[index[t * k + j]]`` (``weights`` None:
    ``out[t] = src[index[t]]``); rows 16-byte aligned, H a multiple of 8."""
    if out.shape[0] and out.shape[1]:
        _rowsum_kernel(weights is not None, src.dtype, index.dtype)(src, index, weights, out)
    return out
