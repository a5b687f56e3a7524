"""Path policy: which backends a call tries, in order, from the device, the dtypes and
the settings alone; one table for every op family, bf16, fp16, fp32 and FP8.

A path (:class:`Path`) is a set of backends, one per op family it serves
(:data:`TABLE`); a call takes the first backend of its paths whose ``choose_config``
takes it (:func:`ts_moe.ops.backend.first_taker`); a backend that does not answers a
``Declined`` with the reason, and the last path takes every call.

=====================  ===================================================================
op families            paths tried, in order
=====================  ===================================================================
grouped GEMMs          sm_90 (H100/H200), 16-bit: the sm_90 kernels; sm_100 (B200, GB200)
(row, k-grouped,       16-bit with ``ts_moe.settings.sm100_kernel``: the sm_100 kernel;
fused SwiGLU)          then the path the device takes without them: ``torch._grouped_mm``
                       (its CUTLASS kernel) for bf16 in and out on sm_90/sm_10x, and for
                       float32 on any CUDA GPU (its per-expert loop, a sync); else the
                       plain-torch references (they read ``offs`` on the host)
routing, slot order,   where the device's bf16 GEMMs take the sm_90 kernels: those kernels
combine and its        (the router's with ``ts_moe.settings.router_kernel``), then the
gradient, gather,      references on the device; elsewhere the references
activation, router
FP8 GEMMs and the      sm_90: the sm_90 FP8 kernels (``ts_moe.settings.fp8_kernels``, on),
quantizer              ``torch._scaled_grouped_mm`` (rowwise, bf16 out), the weights
                       dequantized to bf16 then ``ts_moe.grouped_gemm`` (it takes every
                       call); other GPUs: the dequantized path; the quantizer: the kernel
                       (sm_90, unless switched off), else the reference on the device
=====================  ===================================================================

The CPU, and ``ts_moe.settings.reference`` (``TS_MOE_REFERENCE=1``), take the references.
A kernel family that did not load (:mod:`ts_moe.ops.kernels`) is missing from its path.
"""

import enum
import functools

import torch

from ..fp8 import backends as fp8
from ..settings import settings
from . import kernels
from . import reference_backend as ref
from . import torch_backend
from .backend import Op


class Path(enum.Enum):
    KERNEL_SM90 = "ts_moe CuTeDSL kernels (sm_90a)"
    KERNEL_SM100 = "ts_moe CuTeDSL kernels (sm_100a; opted in, never run on hardware here)"
    TORCH_GROUPED_MM = "torch._grouped_mm"
    TORCH_SCALED = "torch._scaled_grouped_mm (rowwise FP8, sm_90)"
    DEQUANTIZE = "FP8 weights dequantized to bf16, then ts_moe.grouped_gemm"
    REFERENCE = "plain-torch reference (reads offs on the host)"


KERNEL_PATHS = {"sm_90a": Path.KERNEL_SM90, "sm_100a": Path.KERNEL_SM100}
CAPABILITY = {Path.KERNEL_SM90: (9, 0), Path.KERNEL_SM100: (10, 0)}
GEMM_OPS = (Op.GROUPED_GEMM, Op.GROUPED_GEMM_K, Op.GROUPED_GEMM_SWIGLU)
DEVICE_OPS = (Op.SWIGLU_ACTIVATION, Op.ROUTE_SLOTS, Op.ROUTE_TOPK, Op.SORT_SLOTS, Op.ROW_SUM,
              Op.COMBINE_GRAD, Op.ROUTER_LOGITS)
FP8_OPS = (Op.SCALED_GROUPED_GEMM, Op.SCALED_GROUPED_GEMM_SWIGLU, Op.QUANTIZE_FP8)

TABLE: dict[Path, dict[Op, object]] = {
    Path.KERNEL_SM90: {}, Path.KERNEL_SM100: {},
    Path.TORCH_GROUPED_MM: {Op.GROUPED_GEMM: torch_backend.GROUPED_GEMM,
                            Op.GROUPED_GEMM_K: torch_backend.GROUPED_GEMM_K,
                            Op.GROUPED_GEMM_SWIGLU: torch_backend.GROUPED_GEMM_SWIGLU},
    Path.TORCH_SCALED: {Op.SCALED_GROUPED_GEMM: fp8.TORCH_SCALED_GEMM,
                        Op.SCALED_GROUPED_GEMM_SWIGLU: fp8.TORCH_SCALED_SWIGLU},
    Path.DEQUANTIZE: {Op.SCALED_GROUPED_GEMM: fp8.DEQUANTIZE_GEMM,
                      Op.SCALED_GROUPED_GEMM_SWIGLU: fp8.DEQUANTIZE_SWIGLU},
    Path.REFERENCE: {**ref.BACKENDS, Op.SCALED_GROUPED_GEMM: fp8.REFERENCE_GEMM,
                     Op.SCALED_GROUPED_GEMM_SWIGLU: fp8.REFERENCE_SWIGLU,
                     Op.QUANTIZE_FP8: fp8.REFERENCE_QUANTIZE},
}
"""``{path: {op family: backend}}``: the kernel paths hold what each loaded family serves."""
PROVIDER: dict = {}
"""``{(kernel path, op family): the family}`` behind each kernel backend of :data:`TABLE`."""
MAX_EXPERTS: dict = {}
"""``{(kernel path, op family): the most experts its kernels take}``."""
for _family in kernels.FAMILIES:
    _kernels = kernels.LOADED.get(_family.name)
    if _kernels is not None and _family.in_ops:
        _path = KERNEL_PATHS[_family.arch]
        for _op, _backend in _kernels.backends.items():
            TABLE[_path].setdefault(_op, _backend)
            PROVIDER.setdefault((_path, _op), _family)
            MAX_EXPERTS.setdefault((_path, _op), _kernels.max_experts)
SWITCHES = tuple(sorted({f.setting for f in kernels.FAMILIES if f.setting}))
"""The ``ts_moe.settings`` attributes that switch a family on or off."""


def choose_path(capability: tuple[int, int] | None, dtype: torch.dtype,
                out_dtype: torch.dtype | None, num_experts: int, *,
                kernels_available: bool = True, kernel_max_experts: int = 512,
                has_torch_grouped_mm: bool = True, sm100_opt_in: bool = False) -> Path:
    """The first path of a grouped GEMM on a device of compute ``capability`` (None: the
    CPU).

    torch's grouped_mm takes its CUTLASS fast path only on sm_90 and sm_100
    (10.x) for bf16 in and out; elsewhere it loops over the experts with a host
    sync, which the reference does too, so it serves only float32 (which our
    kernels don't take).  Capability 10.0 runs the sm_100a kernel only after
    :func:`use_sm100_kernel` (it has never run on a Blackwell GPU).
    """
    if capability is None:
        return Path.REFERENCE
    half = dtype in (torch.bfloat16, torch.float16)
    if (capability == (9, 0) and kernels_available and half
            and num_experts <= kernel_max_experts):
        return Path.KERNEL_SM90
    if (capability == (10, 0) and sm100_opt_in and kernels_available and half
            and num_experts <= kernel_max_experts):
        return Path.KERNEL_SM100
    if has_torch_grouped_mm:
        if dtype == torch.float32:
            return Path.TORCH_GROUPED_MM
        if (dtype == torch.bfloat16 and out_dtype in (None, torch.bfloat16)
                and (capability == (9, 0) or capability[0] == 10)):
            return Path.TORCH_GROUPED_MM
    return Path.REFERENCE


def use_sm100_kernel(enabled: bool = True) -> None:
    """Run bf16/fp16 calls on Blackwell (capability 10.0) on ts_moe's sm_100a
    kernel: sets ``ts_moe.settings.sm100_kernel`` to ``bool(enabled)``.

    Off by default: the kernel compiles, its PTX is checked and its barrier
    protocol model-checked, but it has never run on a Blackwell GPU here, so
    sm_100 gets ``torch._grouped_mm`` unless a user opts in (for example to
    try it on hardware).  Takes effect on the next call.
    """
    settings.sm100_kernel = bool(enabled)


def use_fp8_kernels(enabled: bool = True) -> None:
    """Run FP8 calls on sm_90 on ts_moe's CuTeDSL FP8 kernels (the GEMM and the
    activation quantizer): sets ``ts_moe.settings.fp8_kernels`` to ``bool(enabled)``.

    On by default: they pass the whole GPU suite and beat the other paths in most cases
    (bench/notes/2026-12-06-h100-run.md); off, sm_90 takes ``torch._scaled_grouped_mm``
    (rowwise) or the dequantize path.  Takes effect on the next call, the layer's
    decode graphs included (they key on it)."""
    settings.fp8_kernels = bool(enabled)


def fp8_kernels_enabled() -> bool:
    """``ts_moe.settings.fp8_kernels``."""
    return settings.fp8_kernels


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def device_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """The capability whose paths ``t``'s calls take: None off CUDA and with
    ``ts_moe.settings.reference`` (``TS_MOE_REFERENCE=1``, read now)."""
    if t.device.type != "cuda" or settings.reference:
        return None
    return _capability(t.get_device())


def paths_for(op: Op, capability: tuple[int, int] | None, dtype: torch.dtype | None = None,
              out_dtype: torch.dtype | None = None, num_experts: int = 1) -> tuple[Path, ...]:
    """The paths a call of ``op`` tries on a device of ``capability``, in order (the
    settings read now); the last takes every call."""
    return _paths(op, capability, dtype, out_dtype, num_experts, switches())


def switches() -> tuple[bool, ...]:
    """The values of :data:`SWITCHES` now: with the device, what decides every path (the
    decode graphs key on it)."""
    return tuple(getattr(settings, s) for s in SWITCHES)


def backends(op: Op, capability: tuple[int, int] | None, dtype: torch.dtype | None = None,
             out_dtype: torch.dtype | None = None, num_experts: int = 1) -> tuple:
    """The backends a call of ``op`` on a device of ``capability`` tries, in order."""
    return tuple(TABLE[p][op] for p in paths_for(op, capability, dtype, out_dtype,
                                                 num_experts))


def pairs(fused: Op, split: Op, capability: tuple[int, int] | None,
          dtype: torch.dtype | None = None, num_experts: int = 1) -> tuple:
    """``(fused backend, plain GEMM backend)`` of each path a fused GEMM + SwiGLU call
    tries, in order (:func:`ts_moe.ops.backend.fused_or_split`)."""
    return tuple((TABLE[p][fused], TABLE[p][split])
                 for p in paths_for(fused, capability, dtype, None, num_experts))


def device_backends(op: Op, t: torch.Tensor) -> tuple:
    """The backends a call of ``op`` on ``t``'s device tries, in order (the small
    kernels of :data:`DEVICE_OPS` and the quantizer: their paths follow the device
    alone)."""
    return backends(op, device_capability(t))


def _gemm_path(op, capability, dtype, out_dtype, num_experts, kernels_available=True):
    """The first path of a GEMM call; a switched-off family's path is dropped after, by
    :func:`_paths`, as every op family's is."""
    kernel = next((p for p, c in CAPABILITY.items() if c == capability), None)
    served = kernel is not None and (kernel, op) in PROVIDER
    return choose_path(capability, dtype, out_dtype, num_experts,
                       kernels_available=kernels_available and served,
                       kernel_max_experts=MAX_EXPERTS.get((kernel, op)) or 0,
                       has_torch_grouped_mm=hasattr(torch, "_grouped_mm"), sm100_opt_in=True)


@functools.cache
def _paths(op, capability, dtype, out_dtype, num_experts, switches) -> tuple[Path, ...]:
    on = dict(zip(SWITCHES, switches))
    if capability is None:
        found = [Path.REFERENCE]
    elif op in GEMM_OPS:
        found = [_gemm_path(op, capability, dtype, out_dtype, num_experts),
                 _gemm_path(op, capability, dtype, out_dtype, num_experts, False)]
    elif op in DEVICE_OPS:
        bf16 = _gemm_path(Op.GROUPED_GEMM, capability, torch.bfloat16, None, 1)
        found = [Path.KERNEL_SM90, Path.REFERENCE] if bf16 is Path.KERNEL_SM90 else \
            [Path.REFERENCE]
    elif op in FP8_OPS and capability == (9, 0):  # the dequantize path takes every call
        found = [Path.KERNEL_SM90, Path.TORCH_SCALED, Path.DEQUANTIZE, Path.REFERENCE]
    elif op in FP8_OPS:
        found = [Path.DEQUANTIZE, Path.REFERENCE]
    else:
        raise ValueError(f"{op}: no path serves it")
    chain = []
    for p in dict.fromkeys(found):
        family = PROVIDER.get((p, op))
        if op in TABLE[p] and (family is None or not family.setting or on[family.setting]):
            chain.append(p)
    return tuple(chain)


def graph_path(device_index: int, dtype: torch.dtype, num_experts: int) -> Path | None:
    """The path of the layer's GEMMs in ``dtype`` with ``num_experts`` experts on this
    CUDA device where it never syncs with the host, so that a CUDA graph can hold it
    (the kernel paths, torch's grouped_mm in 16 bits), else None (its float32 loop and
    the reference read ``offs`` on the host)."""
    capability = None if settings.reference else _capability(device_index)
    path = paths_for(Op.GROUPED_GEMM, capability, dtype, None, num_experts)[0]
    if path in (Path.KERNEL_SM90, Path.KERNEL_SM100) or (
            path is Path.TORCH_GROUPED_MM and dtype != torch.float32):
        return path
    return None


def kernel_arch(device_index: int) -> str | None:
    """'sm_90a' when bf16 calls on this CUDA device run the CuTeDSL kernels, else None."""
    capability = None if settings.reference else _capability(device_index)
    first = paths_for(Op.GROUPED_GEMM, capability, torch.bfloat16)[0]
    return "sm_90a" if first is Path.KERNEL_SM90 else None
