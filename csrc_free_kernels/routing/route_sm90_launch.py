"""Torch side of the routing kernels of :mod:`.route_sm90`: their builds, compiled once
each, and their backends, which launch them on the current stream.

- :func:`route_build`, :func:`rowsum_build`, :func:`builds`: one compile, and every one
  a call can reach; :func:`checked`: those the PTX tests and the pre-flight compile;
- :data:`ROUTE_SLOTS`, :data:`SORT_SLOTS`, :data:`ROW_SUM`: the sm_90 backends
  of the op layer's routing, slot order, combine and row gather
  (``ts_moe.ops.backend``): ``choose_config`` says which batches the one-CTA
  tables and the row kernel take (:func:`fits`, :func:`rows_ok`); :data:`KERNELS`.
"""

import functools

import cutlass
import cutlass.cute as cute
import torch

from ..common import compile as kcompile
from ..common.family import Build, Kernels, Op
from ..common.kernel_config import Declined
from .route_sm90 import LANE_WIDTHS, MAX_EXPERTS, MAX_SLOTS, RouteSlots, WeightedRowSum


def fake_compact(dtype, *shape):
    return cute.runtime.make_fake_compact_tensor(
        dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
        assumed_align=dtype.width // 8)


def fake_rows(dtype, n, h):
    """(n, h) rows of 16-byte vectors with a free row stride."""
    return cute.runtime.make_fake_tensor(
        dtype, (n, h), (cute.sym_int64(divisibility=128 // dtype.width), 1), assumed_align=16)


def route_fake_args(dtype, from_logits: bool) -> tuple:
    """Symbolic T, E, k, and T k (checked against each other on the host);
    ``dtype``: the logits' (``from_logits``) or the input ids'."""
    t, e, k, s = kcompile.sym_dims(4)
    experts = fake_compact(cutlass.Int64 if from_logits else dtype, t, k)
    logits = fake_compact(dtype, t, e) if from_logits else None
    weights = fake_compact(cutlass.Float32, t, k) if from_logits else None
    return (logits, weights, experts, fake_compact(cutlass.Int32, s),
            fake_compact(cutlass.Int32, e), fake_compact(cutlass.Int64, s),
            kcompile.fake_stream())


def rowsum_fake_args(dtype, index_dtype, weighted: bool) -> tuple:
    """(M, H) source and (T, H) output rows with free 16-byte strides; (R,) index;
    (T, k) weights when ``weighted`` (else R = T)."""
    m, h, t = kcompile.sym_dims(3)
    r, k = kcompile.sym_dims(2) if weighted else (t, None)
    weights = fake_compact(cutlass.Float32, t, k) if weighted else None
    return (fake_rows(dtype, m, h), fake_compact(index_dtype, r), weights,
            fake_rows(dtype, t, h),
            kcompile.fake_stream())


def lane_width(num_experts: int) -> int:
    """The :class:`RouteSlots` build for ``num_experts``: logits per lane."""
    return next(w for w in LANE_WIDTHS if 32 * w >= num_experts)


_SUFFIX = {torch.bfloat16: "", torch.float16: "_fp16", torch.float32: "_f32",
           torch.int64: "_i64", torch.int32: "_i32"}
LOGITS = (torch.bfloat16, torch.float16, torch.float32)  # the routing's logits types
ROWS = (torch.bfloat16, torch.float16)  # the row kernel's types
INDEX = (torch.int64, torch.int32)


def route_build(from_logits: bool, dtype: torch.dtype, per_lane: int = 1) -> Build:
    """Routing and slot order from ``dtype`` logits (``route_slots``, ``_e32`` ...
    ``_e128`` below 256 experts), or the slot order of ``dtype`` experts
    (``sort_slots_i64`` / ``_i32``)."""
    key = ("RouteSlots", from_logits, str(dtype), per_lane, "sm_90a")
    name = ("route_slots" + _SUFFIX[dtype] + ("" if per_lane == 8 else f"_e{32 * per_lane}")
            if from_logits else "sort_slots" + _SUFFIX[dtype])

    def make():
        return (RouteSlots(from_logits, per_lane),
                route_fake_args(kcompile.CUTE_DTYPES[dtype], from_logits))

    return Build(name, key, make, {"from_logits": from_logits, "dtype": dtype,
                                   "per_lane": per_lane})


def rowsum_build(weighted: bool, dtype: torch.dtype, index_dtype: torch.dtype) -> Build:
    """The combine (``combine_rows``, weighted) or the row gather (``gather_rows``), of
    ``dtype`` rows by an ``index_dtype`` index (``_i32``; int64 unnamed)."""
    key = ("WeightedRowSum", weighted, str(dtype), str(index_dtype), "sm_90a")
    name = (("combine_rows" if weighted else "gather_rows") + _SUFFIX[dtype]
            + ("_i32" if index_dtype == torch.int32 else ""))

    def make():
        return WeightedRowSum(weighted), rowsum_fake_args(
            kcompile.CUTE_DTYPES[dtype], kcompile.CUTE_DTYPES[index_dtype], weighted)

    return Build(name, key, make, {"weighted": weighted, "dtype": dtype,
                                   "index_dtype": index_dtype})


def builds():
    """Every build a call can reach: the routing per logits type and lane width, the
    slot order per experts' index type, the row kernel per row and index type."""
    for dtype in LOGITS:
        for per_lane in LANE_WIDTHS:
            yield route_build(True, dtype, per_lane)
    for dtype in INDEX:
        yield route_build(False, dtype, 1)
    for weighted in (True, False):
        for dtype in ROWS:
            for index in INDEX:
                yield rowsum_build(weighted, dtype, index)


_CHECKED = {"route_slots", "route_slots_f32", "route_slots_e32", "sort_slots_i64",
            "sort_slots_i32", "combine_rows", "gather_rows_i32"}


def checked(b: Build) -> bool:
    """The routing at 256 experts (bf16 and fp32 logits) and at 32; the slot order for
    both index types; the combine and the gather once each."""
    return b.name in _CHECKED


@functools.cache
def _route_kernel(from_logits: bool, dtype: torch.dtype, per_lane: int = 1):
    b = route_build(from_logits, dtype, per_lane)
    return kcompile.get_compiled(b)


@functools.cache
def _rowsum_kernel(weighted: bool, dtype: torch.dtype, index_dtype: torch.dtype):
    b = rowsum_build(weighted, dtype, index_dtype)
    return kcompile.get_compiled(b)


def fits(slots: int, num_experts: int) -> bool:
    """Whether the one-CTA routing and slot order take a batch of this size."""
    return 0 < slots <= MAX_SLOTS and 0 < num_experts <= MAX_EXPERTS


def _too_large(slots: int, num_experts: int) -> str:
    return (f"{slots} slots, {num_experts} experts: the one-CTA kernel takes 1 to {MAX_SLOTS} "
            f"slots and 1 to {MAX_EXPERTS} experts")


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
    logits per lane.  ``top_k`` is in ``[1, E]`` (the op checks it)."""

    def choose_config(self, logits, top_k) -> int | Declined:
        tokens, num_experts = logits.shape
        if logits.dtype not in LOGITS:
            return Declined(f"{logits.dtype} logits: the routing kernel takes bf16, fp16 "
                            f"or fp32")
        if not fits(tokens * top_k, num_experts):
            return Declined(_too_large(tokens * top_k, num_experts))
        return lane_width(num_experts)

    def run(self, logits, top_k, config):
        tokens = logits.shape[0]
        weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
        experts = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
        return (weights, experts,
                *_slot_order(experts, logits.shape[1], True, config, logits, weights))


class SortSlotsBackend:
    """The sm_90 backend of ``ts_moe::sort_slots``: a batch that :func:`fits`."""

    def choose_config(self, experts, num_experts) -> int | Declined:
        if not fits(experts.numel(), num_experts):
            return Declined(_too_large(experts.numel(), num_experts))
        return 1

    def run(self, experts, num_experts, config):
        return _slot_order(experts, num_experts, False, config)


class RowSumBackend:
    """The sm_90 backend of the combine and of the row gather: one launch of
    :class:`.route_sm90.WeightedRowSum` (fp32 sums, one rounding) over 16-bit
    rows of whole 16-byte vectors; fp32 weights (others are converted)."""

    def choose_config(self, src, index, weights) -> str | Declined:
        if not (src.shape[0] and rows_ok(src)):
            return Declined("rows the row kernel cannot read: it takes 16-bit rows of whole "
                            "16-byte vectors")
        if not (index.dtype in INDEX and index.device == src.device
                and (weights is None or weights.device == src.device)):
            return Declined("an index or weights the row kernel does not take")
        return "gather" if weights is None else "combine"

    def run(self, src, index, weights, config):
        rows = index.shape[0] if weights is None else weights.shape[0]
        out = src.new_empty(rows, src.shape[1])
        if weights is not None and weights.dtype != torch.float32:
            weights = weights.float()
        if rows and src.shape[1]:
            _rowsum_kernel(config == "combine", src.dtype, index.dtype)(
                src, index, None if weights is None else weights.contiguous(), out)
        return out


ROUTE_SLOTS = RouteSlotsBackend()
SORT_SLOTS = SortSlotsBackend()
ROW_SUM = RowSumBackend()


KERNELS = Kernels(backends={Op.ROUTE_SLOTS: ROUTE_SLOTS, Op.SORT_SLOTS: SORT_SLOTS,
                            Op.ROW_SUM: ROW_SUM},
                  builds=builds, checked=checked, max_experts=MAX_EXPERTS)
