"""How an FP8 call runs: the paths of the FP8 op families, each a set of backends of the
families of :mod:`ts_moe.ops.backend` (:class:`Fp8Backends`), and the paths a device
tries, in order (:func:`paths_for`).  A call runs on the first path whose backend's
``choose_config`` takes it; a backend that declines answers a ``Declined`` naming the
limit the call meets (K, N, the expert count, the recipe, the output dtype).

=================  ==========================================================  ==========
device             scaled_grouped_gemm (and its SwiGLU form)                   host sync
=================  ==========================================================  ==========
sm_90 (H100/H200)  after use_fp8_kernels(): ts_moe's CuTeDSL FP8 kernels      no
                   (every recipe; K % 16 == 0, E <= 512); otherwise as below
sm_90, by default  rowwise, bf16 out, K and N % 16 == 0, E < 1024:             no
                   ``torch._scaled_grouped_mm``; otherwise as below
other CUDA GPUs    the weights of the experts the rows use dequantized to      as
(sm_100, sm_89..)  bf16 in chunks (:mod:`ts_moe.fp8.dequantize_path`), then    grouped_gemm
                   ``ts_moe.grouped_gemm``, which runs torch's grouped_mm on
                   sm_90/sm_10x (no sync) and its reference elsewhere (a sync)
CPU, or            the plain-torch reference (:mod:`ts_moe.fp8.reference`),   yes (GPU)
TS_MOE_REFERENCE=1 fp32 accumulation
=================  ==========================================================  ==========

``quantize_fp8`` of a 2-D activation (bf16/fp16/fp32; ``blockwise_1x128``
with K % 128 == 0, ``rowwise``, ``tensorwise``; K % 16 == 0) on sm_90 after
:func:`use_fp8_kernels` runs the quantize kernel (one pass, scales in the GEMM's fast
layout); everything else runs the reference, which never syncs.
Backends: the kernels' (``csrc_free_kernels.fp8.grouped_gemm_fp8_sm90_launch``,
``quantize_fp8_sm90_launch``, through :mod:`ts_moe.ops.kernels`) and
:mod:`ts_moe.fp8.backends`.
"""

import enum
import functools
from typing import NamedTuple

import torch

from ..ops import kernels
from ..ops.backend import NoKernel, QuantizeFp8, ScaledGroupedGemm, ScaledGroupedGemmSwiglu
from ..settings import settings
from . import backends as own


class Fp8Path(enum.Enum):
    KERNEL_SM90 = "ts_moe CuTeDSL FP8 kernels (sm_90a)"
    TORCH_SCALED = "torch._scaled_grouped_mm (rowwise, sm_90)"
    DEQUANTIZE = "dequantized to bf16, then ts_moe.grouped_gemm"
    REFERENCE = "plain-torch reference (reads offs on the host)"


class Fp8Backends(NamedTuple):
    """The FP8 families' backends of one path."""

    path: Fp8Path
    gemm: ScaledGroupedGemm
    swiglu: ScaledGroupedGemmSwiglu
    quantize: QuantizeFp8


TORCH_SCALED = Fp8Backends(Fp8Path.TORCH_SCALED, own.TORCH_SCALED_GEMM, own.TORCH_SCALED_SWIGLU,
                           own.REFERENCE_QUANTIZE)
DEQUANTIZE = Fp8Backends(Fp8Path.DEQUANTIZE, own.DEQUANTIZE_GEMM, own.DEQUANTIZE_SWIGLU,
                         own.REFERENCE_QUANTIZE)
REFERENCE = Fp8Backends(Fp8Path.REFERENCE, own.REFERENCE_GEMM, own.REFERENCE_SWIGLU,
                        own.REFERENCE_QUANTIZE)
# each kernel family where it imported (ts_moe.ops.kernels); one that did not is a
# NoKernel, and its calls take the next path
_gemm, _quantize = kernels.sm90_fp8, kernels.quantize_fp8_sm90
KERNEL_SM90 = Fp8Backends(
    Fp8Path.KERNEL_SM90,
    _gemm.GROUPED_GEMM if _gemm is not None else NoKernel(),
    _gemm.GROUPED_GEMM_SWIGLU if _gemm is not None else NoKernel(),
    _quantize.QUANTIZE if _quantize is not None else NoKernel())
PATH_BACKENDS = {b.path: b for b in (KERNEL_SM90, TORCH_SCALED, DEQUANTIZE, REFERENCE)}

_SM90_KERNELS = (KERNEL_SM90, TORCH_SCALED, DEQUANTIZE)
_SM90 = (TORCH_SCALED, DEQUANTIZE)
_OTHER_GPU = (DEQUANTIZE,)
_CPU = (REFERENCE,)


def use_fp8_kernels(enabled: bool = True) -> None:
    """Run FP8 calls on sm_90 on ts_moe's CuTeDSL FP8 kernels (the GEMM and the
    activation quantizer): sets ``ts_moe.settings.fp8_kernels`` to ``bool(enabled)``.

    Off by default: they compile and their PTX, registers and scale maps are
    checked on the CPU, but on an H200 the GEMM stopped with an illegal
    instruction at its first launch (bench/notes/2026-12-05-fp8-kernel-first-gpu-run.md),
    so sm_90 takes ``torch._scaled_grouped_mm`` (rowwise) or the dequantize path
    until it passes there.  Takes effect on the next call; the layer's decode
    graphs captured before it keep the path they captured."""
    settings.fp8_kernels = bool(enabled)


def fp8_kernels_enabled() -> bool:
    """``ts_moe.settings.fp8_kernels``."""
    return settings.fp8_kernels


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def device_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """The capability whose paths ``t``'s calls take: None off CUDA (and with
    ``ts_moe.settings.reference``, ``TS_MOE_REFERENCE=1``, read now)."""
    if t.device.type != "cuda" or settings.reference:
        return None
    return _capability(t.get_device())


def paths_for(t: torch.Tensor) -> tuple[Fp8Backends, ...]:
    """The paths a call on ``t``'s device tries, in order (the module's table; the
    settings read now); the last takes every call."""
    capability = device_capability(t)
    if capability is None:
        return _CPU
    if capability == (9, 0):
        return _SM90_KERNELS if settings.fp8_kernels else _SM90
    return _OTHER_GPU


def gemm_path(paths: tuple[Fp8Backends, ...], a, b, scale_a, scale_b, offs, out, a_index,
              pair) -> tuple[Fp8Backends, object]:
    """``(path, config)``: the first of ``paths`` whose GEMM takes the call, and the config
    it chose."""
    for backends in paths:
        config = backends.gemm.choose_config(a, b, scale_a, scale_b, offs, out, a_index, pair)
        if config:
            return backends, config
    raise AssertionError(f"the last FP8 path ({backends.path}) declined: {config}")
