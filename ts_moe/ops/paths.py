"""Path policy: which backends a call tries, in order, from the device, the dtypes and
the settings alone; one table for every op family, bf16, fp16, fp32 and FP8.

A path (:class:`Path`) is a set of backends, one per op family it serves
(:data:`TABLE`); a call takes the first backend of its paths whose ``choose_config``
takes it and whose kernel build the pre-flight does not refuse
(:func:`ts_moe.ops.backend.take`); a backend that does not answers a ``Declined`` with
the reason, and the last path takes every call.

The kernel paths are the families' records (``csrc_free_kernels.families``): one per
compute capability and precedence, holding the backends of the families of that
capability's arch (:data:`KERNEL_PATHS`; sm_90 (H100/H200): the sm_90a families, sm_100
(B200, GB200): the sm_100a GEMM).  A call first tries the kernel paths of its device's
capability, the higher precedence first, each where the family serving the op is
loaded and switched on (``Family.setting``: ``ts_moe.settings.sm100_kernel``,
``router_kernel``, ``fp8_kernels`` (on)) and its kernels take the call's dtype and
expert count (``Kernels.dtypes``, ``max_experts``); then the paths of torch's and of
ts_moe's own backends (:data:`FALLBACKS`, their devices torch's):

=====================  ===================================================================
op families            paths tried after the kernel paths, in order
=====================  ===================================================================
grouped GEMMs          ``torch._grouped_mm`` (its CUTLASS kernel) for bf16 in and out on
(row, k-grouped,       sm_90/sm_10x, and for float32 on any CUDA GPU (its per-expert loop,
fused SwiGLU)          a sync); else the plain-torch references (they read ``offs`` on
                       the host)
FP8 GEMMs              ``torch._scaled_grouped_mm`` (rowwise, bf16 out) on sm_90, the
                       weights dequantized to bf16 then ``ts_moe.grouped_gemm`` (it takes
                       every call), the reference
routing, slot order,   the references on the device
combine and its
gradient, gather,
activation, router,
FP8 quantizer
=====================  ===================================================================

The CPU, and ``ts_moe.settings.reference`` (``TS_MOE_REFERENCE=1``), take the references.
A kernel family that did not load (:mod:`ts_moe.ops.kernels`) is missing from its path.
"""

import enum
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..fp8 import backends as fp8
from ..settings import SETTINGS, settings
from . import kernels
from . import reference_backend as ref
from . import torch_backend
from .backend import Op
from .kernels import Family, Proof

_DEFAULTS = {s.name: s.default for s in SETTINGS}


class KernelPath(NamedTuple):
    """A kernel path: the compute capability it serves, its precedence, and the families
    whose backends it holds (every family of that capability and precedence)."""

    capability: tuple[int, int]
    precedence: int
    families: tuple[Family, ...]

    @property
    def name(self) -> str:
        """``KERNEL_SM90``; ``KERNEL_SM90_P1`` at precedence 1."""
        major, minor = self.capability
        return f"KERNEL_SM{major}{minor}" + (f"_P{self.precedence}" if self.precedence else "")

    @property
    def title(self) -> str:
        """What it is, in words: its archs, its precedence, whether a call takes it only
        once opted in (each family's setting off by default), whether it never ran on
        hardware (none of its families verified)."""
        notes = [", ".join(dict.fromkeys(f.arch for f in self.families))]
        if self.precedence:
            notes.append(f"precedence {self.precedence}")
        state = []
        if all(f.setting and not _DEFAULTS[f.setting] for f in self.families):
            state.append("opted in")
        if not any(f.proof is Proof.VERIFIED for f in self.families):
            state.append("never run on hardware here")
        if state:
            notes.append(", ".join(state))
        return f"ts_moe CuTeDSL kernels ({'; '.join(notes)})"


def _kernel_paths(families) -> tuple[KernelPath, ...]:
    """One kernel path per (capability, precedence) of the families the ops take, in
    the order of the records."""
    groups: dict = {}
    for f in families:
        if f.in_ops:
            groups.setdefault((f.capability, f.precedence), []).append(f)
    return tuple(KernelPath(c, p, tuple(fs)) for (c, p), fs in groups.items())


_KERNEL_PATHS = _kernel_paths(kernels.FAMILIES)
Path = enum.Enum("Path", [*((k.name, k.title) for k in _KERNEL_PATHS),
                          ("TORCH_GROUPED_MM", "torch._grouped_mm"),
                          ("TORCH_SCALED", "torch._scaled_grouped_mm (rowwise FP8, sm_90)"),
                          ("DEQUANTIZE", "FP8 weights dequantized to bf16, then "
                                         "ts_moe.grouped_gemm"),
                          ("REFERENCE", "plain-torch reference (reads offs on the host)")],
                 module=__name__, qualname="Path")
Path.__doc__ = """A path: the kernel paths of the records (``KERNEL_SM90``, ...), then
torch's and ts_moe's own; each member's value says what it is."""
KERNEL_PATHS: dict = {Path[k.name]: k for k in _KERNEL_PATHS}
"""``{kernel path: its KernelPath}``, in the order of the records."""
_BY_CAPABILITY: dict = {}
for _path, _kernel in sorted(KERNEL_PATHS.items(), key=lambda item: -item[1].precedence):
    _BY_CAPABILITY.setdefault(_kernel.capability, []).append(_path)

TABLE: dict[Path, dict[Op, object]] = {
    **{path: {} for path in KERNEL_PATHS},
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
for _path, _kernel in KERNEL_PATHS.items():
    for _family in _kernel.families:
        _served = kernels.LOADED.get(_family.name)
        for _op in _family.serves if _served is not None else ():
            if _op in _served.backends:
                TABLE[_path][_op] = _served.backends[_op]
                PROVIDER[_path, _op] = _family
SWITCHES = tuple(sorted({f.setting for f in kernels.FAMILIES if f.setting}))
"""The ``ts_moe.settings`` attributes that switch a family on or off."""


def kernel_path(family: Family) -> Path:
    """The kernel path that holds ``family``'s backends."""
    return next(p for p, k in KERNEL_PATHS.items() if family in k.families)


def _torch_grouped_mm(capability, dtype, out_dtype) -> bool:
    """torch's grouped_mm takes its CUTLASS fast path only on sm_90 and sm_100 (10.x)
    for bf16 in and out; elsewhere it loops over the experts with a host sync, which the
    reference does too, so it serves only float32 (which our kernels don't take), and
    only on CUDA."""
    return capability is not None and (dtype == torch.float32 or (
        dtype == torch.bfloat16 and out_dtype in (None, torch.bfloat16)
        and (capability == (9, 0) or capability[0] == 10)))


class Fallback(NamedTuple):
    """A path of torch's or ts_moe's own backends: where it serves a call
    (``serves(capability, dtype, out_dtype)``, the capability None on the CPU), and
    whether it takes every call it serves (``final``: no path after it)."""

    path: Path
    serves: Callable[[tuple, torch.dtype | None, torch.dtype | None], bool]
    final: bool


FALLBACKS = (
    Fallback(Path.TORCH_GROUPED_MM, _torch_grouped_mm, True),
    # torch's rowwise FP8 grouped GEMM: sm_90 (its sm_100 one takes MX formats only)
    Fallback(Path.TORCH_SCALED, lambda capability, *_: capability == (9, 0), False),
    Fallback(Path.DEQUANTIZE, lambda capability, *_: capability is not None, False),
    Fallback(Path.REFERENCE, lambda *_: True, True),
)
"""The paths after the kernel paths, in order: an op family tries each that holds a
backend for it and serves the call, up to the first ``final`` one."""


def _takes(path, op, dtype, num_experts, on: Callable[[Family], bool]) -> bool:
    """Whether kernel ``path`` offers a call of ``op``: its family serves it, is on, and
    its kernels take ``dtype`` (where they name theirs) and ``num_experts``."""
    family = PROVIDER.get((path, op))
    if family is None or not on(family):
        return False
    limits = kernels.LOADED[family.name]
    return ((not limits.dtypes or dtype in limits.dtypes)
            and (limits.max_experts is None or num_experts <= limits.max_experts))


def _chain(op, capability, dtype, out_dtype, num_experts, on: Callable[[Family], bool],
           without: tuple = ()) -> tuple[Path, ...]:
    """The paths of a call, in order: the kernel paths of ``capability`` (None: the CPU,
    none) that offer it (:func:`_takes`), then :data:`FALLBACKS` (all but ``without``)."""
    found = [p for p in _BY_CAPABILITY.get(capability, ())
             if _takes(p, op, dtype, num_experts, on)]
    for fallback in FALLBACKS:
        if (op in TABLE[fallback.path] and fallback.path not in without
                and fallback.serves(capability, dtype, out_dtype)):
            found.append(fallback.path)
            if fallback.final:
                break
    if not found:
        raise ValueError(f"no path serves {op.value} on "
                         f"{'the CPU' if capability is None else f'capability {capability}'}")
    return tuple(found)


def choose_path(capability: tuple[int, int] | None, dtype: torch.dtype,
                out_dtype: torch.dtype | None, num_experts: int, *,
                kernels_available: bool = True, has_torch_grouped_mm: bool = True,
                opted_in: bool = False) -> Path:
    """The first path of a grouped GEMM on a device of compute ``capability`` (None: the
    CPU), the settings aside: the first kernel path of the capability whose family takes
    ``dtype`` and ``num_experts`` (none without ``kernels_available``; a family a
    setting turns on only when ``opted_in``: the sm_100a kernel, which has never run on
    a Blackwell GPU), else torch's grouped_mm where it serves the call
    (:func:`_torch_grouped_mm`), else the reference."""
    return _chain(Op.GROUPED_GEMM, capability, dtype, out_dtype, num_experts,
                  lambda f: kernels_available and (opted_in or not f.setting),
                  () if has_torch_grouped_mm else (Path.TORCH_GROUPED_MM,))[0]


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
    tries, in order (:func:`ts_moe.ops.backend.fused_or_split`); None where a path holds
    no plain GEMM."""
    return tuple((TABLE[p][fused], TABLE[p].get(split))
                 for p in paths_for(fused, capability, dtype, None, num_experts))


def device_backends(op: Op, t: torch.Tensor) -> tuple:
    """The backends a call of ``op`` on ``t``'s device tries, in order (the op families
    whose paths follow the device alone: the routing ops, the combine and its gradient,
    the activation, the quantizer)."""
    return backends(op, device_capability(t))


@functools.cache
def _paths(op, capability, dtype, out_dtype, num_experts, switches) -> tuple[Path, ...]:
    on = dict(zip(SWITCHES, switches))
    return _chain(op, capability, dtype, out_dtype, num_experts,
                  lambda f: not f.setting or on[f.setting],
                  () if hasattr(torch, "_grouped_mm") else (Path.TORCH_GROUPED_MM,))


def graph_path(device_index: int, dtype: torch.dtype, num_experts: int) -> Path | None:
    """The path of the layer's GEMMs in ``dtype`` with ``num_experts`` experts on this
    CUDA device where it never syncs with the host, so that a CUDA graph can hold it
    (the kernel paths, torch's grouped_mm in 16 bits), else None (its float32 loop and
    the reference read ``offs`` on the host)."""
    capability = None if settings.reference else _capability(device_index)
    path = paths_for(Op.GROUPED_GEMM, capability, dtype, None, num_experts)[0]
    if path in KERNEL_PATHS or (path is Path.TORCH_GROUPED_MM and dtype != torch.float32):
        return path
    return None


def kernel_arch(device_index: int) -> str | None:
    """The arch of the CuTeDSL kernels bf16 grouped GEMMs on this CUDA device run
    ('sm_90a' on an H100 or H200), else None."""
    capability = None if settings.reference else _capability(device_index)
    first = paths_for(Op.GROUPED_GEMM, capability, torch.bfloat16)[0]
    family = PROVIDER.get((first, Op.GROUPED_GEMM))
    return None if family is None else family.arch
