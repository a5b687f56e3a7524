"""How an FP8 call runs: the path policy of the FP8 ops, and their kernel modules.

=================  ==========================================================  ==========
device             scaled_grouped_gemm (and its SwiGLU form)                   host sync
=================  ==========================================================  ==========
sm_90 (H100/H200)  after use_fp8_kernels(): ts_moe's CuTeDSL FP8 kernels      no
                   (every recipe; K % 16 == 0)
sm_90, by default   rowwise, bf16 out, K and N % 16 == 0, E < 1024:             no
                   ``torch._scaled_grouped_mm``; otherwise as below
other CUDA GPUs    the weights of the experts the rows use dequantized to      as
(sm_100, sm_89..)  bf16 in chunks (:mod:`ts_moe.fp8.dequantize_path`), then    grouped_gemm
                   ``ts_moe.grouped_gemm``, which runs torch's grouped_mm on
                   sm_90/sm_10x (no sync) and its reference elsewhere (a sync)
CPU, or            the plain-torch reference (:mod:`ts_moe.fp8.reference`),   yes (GPU)
TS_MOE_REFERENCE=1 fp32 accumulation
=================  ==========================================================  ==========

``quantize_fp8`` of a 2-D activation (bf16/fp16/fp32; ``blockwise_1x128``
with K % 128 == 0, ``rowwise``, ``tensorwise``) on sm_90 after
:func:`use_fp8_kernels` runs the quantize kernel (one pass, scales in the GEMM's fast layout); everything else runs the
reference, which never syncs.

``torch._scaled_grouped_mm`` has no blockwise recipe and runs rowwise on sm_90
only (its sm_100 grouped path is MX formats only; torch 2.13's
``_meta_registrations.py`` and ``aten/src/ATen/native/cuda/GroupedBlas.cpp``).
"""

import enum
import functools

import torch

from ..ops import kernels
from ..settings import settings
from .recipes import ACTIVATION_RECIPES, BLOCK, BLOCKWISE_1X128

ALIGN = 16  # bytes: the kernels' (and torch's) row strides and pointers
TORCH_SCALED_MAX_EXPERTS = 1023  # torch._scaled_grouped_mm: group_count < 1024


class Fp8Path(enum.Enum):
    KERNEL_SM90 = "ts_moe CuTeDSL FP8 kernels (sm_90a)"
    TORCH_SCALED = "torch._scaled_grouped_mm (rowwise, sm_90)"
    DEQUANTIZE = "dequantized to bf16, then ts_moe.grouped_gemm"
    REFERENCE = "plain-torch reference (reads offs on the host)"


def choose_fp8_path(capability: tuple[int, int] | None, pair: str, k: int, n: int,
                    out_dtype: torch.dtype, num_experts: int, *,
                    kernels_available: bool = True, kernel_max_experts: int = 512,
                    has_torch_scaled: bool = True) -> Fp8Path:
    """The path of a scaled grouped GEMM with recipe ``pair`` (``blockwise``,
    ``rowwise``, ``tensorwise``) on a device of ``capability`` (None: the CPU)."""
    if capability is None:
        return Fp8Path.REFERENCE
    if (capability == (9, 0) and kernels_available and k % ALIGN == 0
            and num_experts <= kernel_max_experts):
        return Fp8Path.KERNEL_SM90
    if (capability == (9, 0) and has_torch_scaled and pair == "rowwise"
            and out_dtype == torch.bfloat16 and k % ALIGN == 0 and n % ALIGN == 0
            and num_experts <= TORCH_SCALED_MAX_EXPERTS):
        return Fp8Path.TORCH_SCALED
    return Fp8Path.DEQUANTIZE


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


def gemm_kernels():
    """``csrc_free_kernels.grouped_gemm_fp8_sm90_launch`` after :func:`use_fp8_kernels`,
    else None (and None without nvidia-cutlass-dsl): :mod:`ts_moe.ops.kernels`, the one
    import."""
    return kernels.sm90_fp8 if settings.fp8_kernels else None


def quantize_kernels():
    """``csrc_free_kernels.quantize_fp8_sm90_launch``, or None (as :func:`gemm_kernels`)."""
    return kernels.quantize_fp8_sm90 if settings.fp8_kernels else None


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def device_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """The capability whose path ``t``'s calls take: None off CUDA (and with
    ``ts_moe.settings.reference``, ``TS_MOE_REFERENCE=1``, read now)."""
    if t.device.type != "cuda" or settings.reference:
        return None
    return _capability(t.get_device())


def scaled_path(a: torch.Tensor, pair: str, k: int, n: int, out_dtype: torch.dtype,
                num_experts: int) -> Fp8Path:
    """The path of a validated call on ``a``'s device (the kernel module is asked
    only on an sm_90 device, where it can run)."""
    capability = device_capability(a)
    kernels = gemm_kernels() if capability == (9, 0) else None
    return choose_fp8_path(capability, pair, k, n, out_dtype, num_experts,
                           kernels_available=kernels is not None,
                           kernel_max_experts=kernels.MAX_EXPERTS if kernels else 0,
                           has_torch_scaled=hasattr(torch, "_scaled_grouped_mm"))


def quantize_kernel_for(x: torch.Tensor, recipe: str):
    """The quantize kernel module where ``x``'s call runs it (sm_90; a 2-D activation
    of bf16, fp16 or fp32 with rows to quantize, K % 16 == 0; ``blockwise_1x128``
    with K % 128 == 0), else None.  The kernel reads 16-byte rows: see
    :func:`kernel_input`."""
    if (device_capability(x) != (9, 0) or x.dim() != 2 or recipe not in ACTIVATION_RECIPES
            or x.dtype not in (torch.bfloat16, torch.float16, torch.float32)
            or 0 in x.shape or x.shape[1] % ALIGN
            or (recipe == BLOCKWISE_1X128 and x.shape[1] % BLOCK)):
        return None
    return quantize_kernels()


def kernel_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` (M, K), K % 16 == 0, as the quantize kernel reads it: row-major with a
    16-byte row stride and pointer; a contiguous copy otherwise."""
    rows_ok = x.shape[0] <= 1 or (x.stride(0) * x.element_size()) % ALIGN == 0
    if x.stride(-1) == 1 and rows_ok and x.data_ptr() % ALIGN == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)
