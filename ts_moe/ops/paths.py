"""Path policy: which backends run a call, from the device and the dtypes alone.

- sm_90 (H100/H200), bf16/fp16: the CuTeDSL kernels (``csrc_free_kernels``,
  ``offs`` on the device, no sync);
- sm_90 and sm_100/sm_103 (B200, GB200, B300), bf16 in and out, where the
  kernels don't run: ``torch._grouped_mm`` (its CUTLASS kernel; no sync);
  sm_100 runs ts_moe's kernel only with ``ts_moe.settings.sm100_kernel``
  (:func:`use_sm100_kernel`);
- float32 on any CUDA GPU: ``torch._grouped_mm`` (its per-expert loop, which
  reads ``offs`` on the host);
- everything else (CPU, other GPUs and dtypes, ``ts_moe.settings.reference``,
  that is ``TS_MOE_REFERENCE=1``): the plain-torch references, which read
  ``offs`` on the host (a sync per call on a GPU).

A path is a set of backends, one per op family (:class:`GemmBackends`); a
device whose bf16 calls take the sm_90 kernels also runs the sm_90 routing,
row and activation kernels (:class:`DeviceBackends`).  A call a kernel's
``choose_config`` declines goes to :func:`without_kernels`: the path the same
device would take without the kernels.
"""

import enum
import functools
from typing import NamedTuple

import torch

from ..settings import settings
from . import kernels
from . import reference_backend as ref
from . import torch_backend
from .backend import (GroupedGemm, GroupedGemmK, GroupedGemmSwiglu, NoKernel, RouterLogits,
                      RouteSlots, RouteTopK, RowSum, SortSlots, SwigluActivation)


class Path(enum.Enum):
    KERNEL_SM90 = "ts_moe CuTeDSL kernels (sm_90a)"
    KERNEL_SM100 = "ts_moe CuTeDSL kernel (sm_100a; opted in, never run on hardware here)"
    TORCH_GROUPED_MM = "torch._grouped_mm"
    REFERENCE = "plain-torch reference (reads offs on the host)"


class GemmBackends(NamedTuple):
    """The grouped GEMMs of a path."""

    gemm: GroupedGemm
    gemm_k: GroupedGemmK
    swiglu: GroupedGemmSwiglu


class DeviceBackends(NamedTuple):
    """The small kernels of a device: routing, slot order, rows, activation."""

    route_slots: RouteSlots
    route_topk: RouteTopK
    sort_slots: SortSlots
    row_sum: RowSum
    router_logits: RouterLogits
    activation: SwigluActivation


REFERENCE_GEMMS = GemmBackends(ref.GROUPED_GEMM, ref.GROUPED_GEMM_K, ref.GROUPED_GEMM_SWIGLU)
REFERENCE_DEVICE = DeviceBackends(ref.ROUTE_SLOTS, ref.ROUTE_TOPK, ref.SORT_SLOTS, ref.ROW_SUM,
                                  ref.ROUTER_LOGITS, ref.SWIGLU_ACTIVATION)
PATH_BACKENDS = {
    Path.TORCH_GROUPED_MM: GemmBackends(torch_backend.GROUPED_GEMM, torch_backend.GROUPED_GEMM_K,
                                        torch_backend.GROUPED_GEMM_SWIGLU),
    Path.REFERENCE: REFERENCE_GEMMS,
}
# Each kernel family counts where it imported (ts_moe.ops.kernels); one that did not
# is a NoKernel, and its calls take the path's next backend.
KERNEL_MAX_EXPERTS = {}
if kernels.sm90 is not None:
    PATH_BACKENDS[Path.KERNEL_SM90] = GemmBackends(
        kernels.sm90.GROUPED_GEMM,
        kernels.sm90_dw.GROUPED_GEMM_K if kernels.sm90_dw is not None else NoKernel(),
        kernels.sm90.GROUPED_GEMM_SWIGLU)
    KERNEL_MAX_EXPERTS[9, 0] = kernels.sm90.MAX_EXPERTS
if kernels.sm100 is not None:
    PATH_BACKENDS[Path.KERNEL_SM100] = GemmBackends(
        kernels.sm100.GROUPED_GEMM, NoKernel(), kernels.sm100.GROUPED_GEMM_SWIGLU)
    KERNEL_MAX_EXPERTS[10, 0] = kernels.sm100.MAX_EXPERTS
_route, _router, _act = kernels.route_sm90, kernels.router_sm90, kernels.swiglu_sm90
SM90_DEVICE = DeviceBackends(
    _route.ROUTE_SLOTS if _route is not None else NoKernel(),
    _router.ROUTE_TOPK if _router is not None else NoKernel(),
    _route.SORT_SLOTS if _route is not None else NoKernel(),
    _route.ROW_SUM if _route is not None else NoKernel(),
    _router.ROUTER_LOGITS if _router is not None else NoKernel(),
    _act.SWIGLU_ACTIVATION if _act is not None else NoKernel())


def choose_path(capability: tuple[int, int] | None, dtype: torch.dtype,
                out_dtype: torch.dtype | None, num_experts: int, *,
                kernels_available: bool = True, kernel_max_experts: int = 512,
                has_torch_grouped_mm: bool = True, sm100_opt_in: bool = False) -> Path:
    """The path of a call on a device of compute ``capability`` (None: the CPU).

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


def cuda_path(device_index: int, dtype: torch.dtype, out_dtype: torch.dtype | None = None,
              num_experts: int = 1) -> tuple[Path, GemmBackends]:
    """``(path, its backends)`` of a call on CUDA device ``device_index``
    (``ts_moe.settings.reference`` and ``sm100_kernel`` read now)."""
    if settings.reference:
        return Path.REFERENCE, REFERENCE_GEMMS
    return _cuda_path(device_index, dtype, out_dtype, num_experts, settings.sm100_kernel)


@functools.cache
def _cuda_path(device_index, dtype, out_dtype, num_experts, sm100_opt_in):
    capability = torch.cuda.get_device_capability(device_index)
    max_experts = KERNEL_MAX_EXPERTS.get(capability, 0)
    path = choose_path(capability, dtype, out_dtype, num_experts,
                       kernels_available=max_experts > 0, kernel_max_experts=max_experts,
                       has_torch_grouped_mm=hasattr(torch, "_grouped_mm"),
                       sm100_opt_in=sm100_opt_in)
    return path, PATH_BACKENDS[path]


@functools.cache
def without_kernels(device_index: int, dtype: torch.dtype, out_dtype: torch.dtype | None,
                    num_experts: int) -> GemmBackends:
    """The backends of a call a kernel's ``choose_config`` declined: the path
    :func:`choose_path` gives this device without the kernels."""
    path = choose_path(torch.cuda.get_device_capability(device_index), dtype, out_dtype,
                       num_experts, kernels_available=False,
                       has_torch_grouped_mm=hasattr(torch, "_grouped_mm"))
    return PATH_BACKENDS[path]


def device_backends(t: torch.Tensor) -> DeviceBackends:
    """The small kernels where ``t``'s CUDA device runs the sm_90 kernels (its
    bf16 calls take :attr:`Path.KERNEL_SM90`), else the references."""
    if not t.is_cuda or cuda_path(t.get_device(), torch.bfloat16)[0] is not Path.KERNEL_SM90:
        return REFERENCE_DEVICE
    return SM90_DEVICE


def graph_path(device_index: int, dtype: torch.dtype, num_experts: int) -> Path | None:
    """The path of the layer's calls in ``dtype`` with ``num_experts`` experts on
    this CUDA device where it never syncs with the host, so that a CUDA graph
    can hold it (the kernel paths, torch's grouped_mm in 16 bits), else None
    (its float32 loop and the reference read ``offs`` on the host)."""
    path = cuda_path(device_index, dtype, None, num_experts)[0]
    if path in (Path.KERNEL_SM90, Path.KERNEL_SM100) or (
            path is Path.TORCH_GROUPED_MM and dtype != torch.float32):
        return path
    return None


def kernel_arch(device_index: int) -> str | None:
    """'sm_90a' when bf16 calls on this CUDA device run the CuTeDSL kernels, else None."""
    return "sm_90a" if cuda_path(device_index, torch.bfloat16)[0] is Path.KERNEL_SM90 else None
