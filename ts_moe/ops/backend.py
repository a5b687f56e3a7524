"""The kernel interface: what every backend of an op family offers.

A backend is an arch's kernels (the families of ``csrc_free_kernels.families``:
sm_90, sm_100), torch's own (:mod:`ts_moe.ops.torch_backend`), plain torch
(:mod:`ts_moe.ops.reference_backend`), or for the FP8 families one of
:mod:`ts_moe.fp8.backends`.  :mod:`ts_moe.ops.paths` orders them per call; the op
then

1. validates the call once (:mod:`ts_moe.checks`; :mod:`ts_moe.fp8.recipes`,
   which parses the FP8 recipes into their one value) and brings the operands to
   the layout its family promises (:mod:`ts_moe.ops.layout`; an FP8 backend
   brings them to its own),
2. asks ``backend.choose_config(...)``: the kernel configuration for this
   call, or, where this backend cannot take it (a size its tiles cannot cover, an
   unaligned row, ...), a :class:`Declined` with the reason (falsy); the op then
   takes the next backend of its paths (:func:`take`; the last takes every
   call),
3. calls ``backend.run(..., config)`` once: no validation there, nothing
   raised for a call its ``choose_config`` took, the config used as given, but for a
   kernel build the pre-flight refuses (a ``PreflightError``, the build refused once
   per process with one warning: ``csrc_free_kernels.common.refusals``).  A kernel
   backend's ``run`` obtains its compiled kernel before it launches or writes
   anything, so a refusal means the backend declines the call, and the op takes the
   next backend (:func:`take`).

The protocols below are the families; every backend of a family has these
methods with these signatures (``tests/test_backends.py`` checks them).
Tensors reach a backend validated, on one device, in the documented layout,
with no empty dimension (the op answers those itself).
"""

from collections.abc import Callable, Hashable
from typing import NamedTuple, Protocol

import torch

from .kernels import Declined, Op, PreflightError

Config = Hashable  # a backend's own configuration object (a tile config, a build width, ...)


class GroupedGemm(Protocol):
    """Row-grouped GEMM: ``out[r] = a[r] @ b[e]`` for the rows ``r`` of expert ``e``
    (``a[a_index[r]]`` where the backend ``gathers``), zeros past ``offs[-1]``.

    a (M, K) K-major; b (E, K, N) with a unit stride on K or N; offs int32 (E,);
    out (M', N) with 16-byte rows, written whole (or a tensor of its shape,
    dtype and strides returned instead).  ``gathers``: ``run`` takes
    ``a_index`` (the rows ``a[a_index]``, zero rows for indices out of
    range); otherwise the op gathers first and never passes it.
    ``prefetch_weights``: see :func:`ts_moe.grouped_gemm` (a hint)."""

    gathers: bool

    def choose_config(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                      out: torch.Tensor, a_index: torch.Tensor | None) -> Config | Declined: ...

    def run(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor,
            config: Config, *, a_index: torch.Tensor | None = None,
            prefetch_weights: bool = False) -> torch.Tensor: ...


class GroupedGemmK(Protocol):
    """k-grouped GEMM (the weight gradient): ``out[e] = a[:, rows e] @ b[rows e]``.

    a (K, M) with a unit stride on K (``x.t()`` of row-major activations x);
    b (M, N) N-major; offs int32 (E,); out (E, K, N) with 16-byte rows; zeros
    for an expert without rows."""

    def choose_config(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                      out: torch.Tensor) -> Config | Declined: ...

    def run(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor,
            config: Config) -> torch.Tensor: ...


class GroupedGemmSwiglu(Protocol):
    """``silu(a @ gate^T) * (a @ up^T)`` per expert, in one pass over the GEMM.

    gate_up (E, 2I, H), gate rows first, a unit stride on H or on 2I; out
    (M', I) with 16-byte rows in ``a.dtype``; otherwise as :class:`GroupedGemm`.
    Where ``choose_config`` declines, the op runs the path's
    :class:`GroupedGemm` to fp32 and the activation apart."""

    gathers: bool

    def choose_config(self, a: torch.Tensor, gate_up: torch.Tensor, offs: torch.Tensor,
                      out: torch.Tensor, a_index: torch.Tensor | None) -> Config | Declined: ...

    def run(self, a: torch.Tensor, gate_up: torch.Tensor, offs: torch.Tensor,
            out: torch.Tensor, config: Config, *, a_index: torch.Tensor | None = None,
            prefetch_weights: bool = False) -> torch.Tensor: ...


class SwigluActivation(Protocol):
    """``out = silu(h[:, :I]) * h[:, I:]`` and its gradient ``dh`` for ``dy``.

    h (M, 2I), dy and out (M, I), dh (M, 2I): one float dtype, a unit stride on
    the last dim, 16-byte rows; ``dy`` None for the forward."""

    def choose_config(self, h: torch.Tensor, dy: torch.Tensor | None) -> Config | Declined: ...

    def forward(self, h: torch.Tensor, out: torch.Tensor, config: Config) -> torch.Tensor: ...

    def backward(self, dy: torch.Tensor, h: torch.Tensor, dh: torch.Tensor,
                 config: Config) -> torch.Tensor: ...


class RouteSlots(Protocol):
    """Routing and slot order: ``(weights, experts, token_index, offs, inverse)`` of
    ``ts_moe.reference.route`` and ``ts_moe.reference.sort_slots``, bit for bit.
    logits (T, E) contiguous."""

    def choose_config(self, logits: torch.Tensor, top_k: int) -> Config | Declined: ...

    def run(self, logits: torch.Tensor, top_k: int, config: Config) -> tuple: ...


class RouteTopK(Protocol):
    """The routing alone: ``(weights, experts)`` of ``ts_moe.reference.route``, bit
    for bit.  logits (T, E) contiguous."""

    def choose_config(self, logits: torch.Tensor, top_k: int) -> Config | Declined: ...

    def run(self, logits: torch.Tensor, top_k: int, config: Config) -> tuple: ...


class SortSlots(Protocol):
    """The slot order ``(token_index, offs, inverse)`` of ``ts_moe.reference.sort_slots``,
    bit for bit (ids outside ``[0, E)`` dropped).  experts (T, k) contiguous."""

    def choose_config(self, experts: torch.Tensor, num_experts: int) -> Config | Declined: ...

    def run(self, experts: torch.Tensor, num_experts: int, config: Config) -> tuple: ...


class RowSum(Protocol):
    """``out[t] = sum_j weights[t, j] * src[index[t * k + j]]`` in fp32, one rounding
    (the combine; ``index`` a permutation), or with ``weights`` None the row
    gather ``out[r] = src[index[r]]``, zero rows for indices outside ``[0, M)``.
    index contiguous int32/int64."""

    def choose_config(self, src: torch.Tensor, index: torch.Tensor,
                      weights: torch.Tensor | None) -> Config | Declined: ...

    def run(self, src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None,
            config: Config) -> torch.Tensor: ...


class CombineGrad(Protocol):
    """Both gradients of the combine ``out[t] = sum_j w[t, j] * y[inverse[t k + j]]``,
    per sorted row ``r`` of slot ``s = order[r]`` (token ``t = s // k``): ``(dy, dw)``,
    ``dy[r] = w[t, s % k] * dout[t]`` (M, H) in ``y``'s dtype, one rounding, and ``dw[r]
    = sum_h dout[t, h] * y[r, h]`` (M,) with fp32 sums (fp64 for fp64 rows); zeros for
    an ``order`` entry outside ``[0, T k)``.  dout (T, H) and y (M, H) of one dtype,
    16-byte rows; weights (T, k); order contiguous int32/int64."""

    def choose_config(self, dout: torch.Tensor, y_sorted: torch.Tensor, weights: torch.Tensor,
                      order: torch.Tensor) -> Config | Declined: ...

    def run(self, dout: torch.Tensor, y_sorted: torch.Tensor, weights: torch.Tensor,
            order: torch.Tensor, config: Config) -> tuple: ...


class RouterLogits(Protocol):
    """``x @ weight.T`` (T, E) in x's dtype, fp32 sums."""

    def choose_config(self, x: torch.Tensor, weight: torch.Tensor) -> Config | Declined: ...

    def run(self, x: torch.Tensor, weight: torch.Tensor, config: Config) -> torch.Tensor: ...


class ScaledGroupedGemm(Protocol):
    """FP8 (e4m3) row-grouped GEMM: ``out[r] = (a[r] x scale_a) @ (b[e] x scale_b)`` for
    the rows ``r`` of expert ``e`` (``a[a_index[r]]``, with its scales, zero rows for
    indices out of range: every backend gathers), zeros past ``offs[-1]``, fp32 sums.

    a (M, K) e4m3 and b (E, K, N) e4m3 with the strides the caller gave (a backend
    brings them to its own layout); scale_a, scale_b of the recipes of ``pair`` (their
    formats give the scale types: fp32, or e8m0 for MX)
    (``ts_moe.fp8.recipes.Pair``, parsed: a ``str`` enum whose members are the
    kernels' names for the pairs); offs int32 (E,); out (M', N) in the output dtype
    (bf16, fp16 or fp32) with 16-byte rows, written whole (or a tensor of its shape,
    dtype and strides returned instead).  ``choose_config`` reads only the output's
    ``shape`` and ``dtype`` (:class:`OutputSpec`): the op allocates the
    output once the path is known, and only for a backend that writes into one."""

    allocates: bool  # True: ``run`` returns a tensor of its own and is given out=None

    def choose_config(self, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                      scale_b: torch.Tensor, offs: torch.Tensor, out,
                      a_index: torch.Tensor | None, pair: str) -> Config | Declined: ...

    def run(self, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
            scale_b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor | None,
            config: Config, pair: str, *,
            a_index: torch.Tensor | None = None) -> torch.Tensor: ...


class ScaledGroupedGemmSwiglu(Protocol):
    """``silu(a @ gate^T) * (a @ up^T)`` per expert of FP8 operands.

    gate_up (E, 2I, K) e4m3 as stored, gate rows first, scale_b of its recipe over
    (E, 2I, K); out (M', I); otherwise as :class:`ScaledGroupedGemm`.  Where
    ``choose_config`` declines, the op runs the same path's :class:`ScaledGroupedGemm`
    to fp32 and the activation apart."""

    def choose_config(self, a: torch.Tensor, gate_up: torch.Tensor, scale_a: torch.Tensor,
                      scale_b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor,
                      a_index: torch.Tensor | None, pair: str) -> Config | Declined: ...

    def run(self, a: torch.Tensor, gate_up: torch.Tensor, scale_a: torch.Tensor,
            scale_b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, config: Config,
            pair: str, *, a_index: torch.Tensor | None = None) -> torch.Tensor: ...


class QuantizeFp8(Protocol):
    """``(x_fp8, scale)``: x (..., R, C) bf16/fp16/fp32/fp64 to e4m3 (contiguous) and its
    fp32 scales ``amax / 448`` per group of ``recipe`` (``ts_moe.fp8.recipes.Recipe``,
    parsed: a ``str`` enum of the quantize kernel's names), the scale in any strides
    (the op brings it to the recipe's fast layout)."""

    def choose_config(self, x: torch.Tensor, recipe: str) -> Config | Declined: ...

    def run(self, x: torch.Tensor, recipe: str, config: Config) -> tuple: ...


PROTOCOLS = {Op.GROUPED_GEMM: GroupedGemm, Op.GROUPED_GEMM_K: GroupedGemmK,
             Op.GROUPED_GEMM_SWIGLU: GroupedGemmSwiglu, Op.SWIGLU_ACTIVATION: SwigluActivation,
             Op.ROUTE_SLOTS: RouteSlots, Op.ROUTE_TOPK: RouteTopK, Op.SORT_SLOTS: SortSlots,
             Op.ROW_SUM: RowSum, Op.COMBINE_GRAD: CombineGrad,
             Op.ROUTER_LOGITS: RouterLogits,
             Op.SCALED_GROUPED_GEMM: ScaledGroupedGemm,
             Op.SCALED_GROUPED_GEMM_SWIGLU: ScaledGroupedGemmSwiglu,
             Op.QUANTIZE_FP8: QuantizeFp8}
"""The protocol of each op family (``csrc_free_kernels.common.family.Op``)."""


class OutputSpec(NamedTuple):
    """What a backend's ``choose_config`` reads of an output: its shape and dtype (the
    output itself is allocated once the backend is known)."""

    shape: tuple
    dtype: torch.dtype


def first_taker(backends, *args) -> tuple:
    """``(backend, config)`` of the first of ``backends`` whose ``choose_config(*args)``
    takes the call (a truthy config; a :class:`Declined` is falsy); the last must take
    every call.  What a call would take, before any kernel is compiled."""
    for backend in backends:
        config = backend.choose_config(*args)
        if config:
            return backend, config
    raise AssertionError(f"no backend took the call; the last, {type(backend).__name__}, "
                         f"answered {config!r}")


def _take(offers, run: Callable):
    """``run(backend, config, *extra)`` for the first ``(backend, args, extra)`` of
    ``offers`` whose ``choose_config(*args)`` takes the call and whose ``run`` meets no
    refused kernel build; the last must take every call."""
    backend = said = None
    for backend, args, extra in offers:
        said = backend.choose_config(*args)
        if said:
            try:
                return run(backend, said, *extra)
            except PreflightError as refused:  # nothing launched: the backend declines
                said = Declined(str(refused))
    raise AssertionError(f"no backend took the call; the last, {type(backend).__name__}, "
                         f"answered {said!r}")


def take(backends, args: tuple, run: Callable):
    """``run(backend, config)`` on the first of ``backends`` that takes the call: its
    ``choose_config(*args)`` gives a config (:func:`first_taker`), and ``run`` meets no
    kernel build the pre-flight refused (a backend whose build is refused declines
    the call, and the next one takes it); the last takes every call."""
    return _take(((backend, args, ()) for backend in backends), run)


def run_first(backends, *args):
    """``run(*args, config)`` of the first of ``backends`` that takes the call
    (:func:`take`): the families whose ``run`` takes what ``choose_config`` does."""
    return take(backends, args, lambda backend, config: backend.run(*args, config))


def fused_or_split(pairs, fused_args, split_args, run: Callable):
    """``run(backend, config, fused)`` of a fused GEMM + SwiGLU call: per ``(fused,
    split)`` pair of backends (a path's), in order, the fused one where it takes
    ``fused_args`` (:func:`take`), else the path's plain GEMM (None: the path has none)
    where it takes ``split_args`` (the GEMM to fp32, the op then applies the
    activation: one rounding); the last pair takes every call."""
    def offers():
        for fused, split in pairs:
            yield fused, fused_args, (True,)
            if split is not None:
                yield split, split_args, (False,)

    return _take(offers(), run)
