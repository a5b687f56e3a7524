"""The ``torch.ops.ts_moe`` operators.

``grouped_gemm(a, b, offs, out_dtype=None)`` has the semantics of
``torch.nn.functional.grouped_mm`` for 2-D ``a`` (M, K) and 3-D ``b`` (E, K, N):
rows ``[offs[e-1], offs[e])`` of ``a`` (``offs[-1]`` read as 0) are multiplied by
``b[e]``; rows at or past ``offs[-1]`` are written as zeros (``grouped_mm``
leaves them undefined).

Bad ``offs`` are not checked on the host (that would be a sync); instead the
kernels use ``cummax(clamp(offs, 0, M))`` as the segment ends
(:func:`ts_moe.reference.segment_ends`): no access is ever out of bounds,
segments never overlap, and every output row is written.

On an sm_90 GPU the CUDA kernels are the CuTeDSL ones of
``csrc_free_kernels.grouped_gemm_sm90``; elsewhere (CPU, other GPUs, or
``TS_MOE_REFERENCE=1``) the plain-torch references run (they read ``offs`` on
the host).  The ops are registered with ``torch.library.Library`` rather than
``custom_op``: its Python wrapper alone costs more than the 20 us host budget
allows for a whole call.
"""

import functools
import os

import torch

from .checks import check_grouped_gemm_args, check_tensor_types, plausible_kernel_args
from .reference import grouped_gemm_reference, grouped_gemm_swiglu_reference

_lib = torch.library.Library("ts_moe", "DEF")
_lib.define("grouped_gemm(Tensor a, Tensor b, Tensor offs, ScalarType? out_dtype=None) -> Tensor")
_lib.define("grouped_gemm_swiglu(Tensor a, Tensor gate_up, Tensor offs) -> Tensor")


@functools.cache
def kernel_arch(device_index: int) -> str | None:
    """'sm_90a' when the CuTeDSL kernels can run on this CUDA device, else None."""
    if os.environ.get("TS_MOE_REFERENCE") == "1":
        return None
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return None
    try:
        import cutlass  # noqa: F401
    except ImportError:
        return None
    return "sm_90a"


@functools.cache
def _kernels(device: torch.device):
    """The kernel module for this CUDA device, or None (then the reference runs)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if kernel_arch(index) is None:
        return None
    from csrc_free_kernels import grouped_gemm_sm90

    return grouped_gemm_sm90


# ------------------------------------------------------------- grouped_gemm
def _grouped_gemm_cpu(a, b, offs, out_dtype=None):
    check_grouped_gemm_args(a, b, offs, out_dtype)
    return grouped_gemm_reference(a, b, offs, out_dtype)


def _grouped_gemm_cuda(a, b, offs, out_dtype=None):
    kernels = _kernels(a.device)
    if kernels is None:
        check_grouped_gemm_args(a, b, offs, out_dtype)
        return grouped_gemm_reference(a, b, offs, out_dtype)
    if not plausible_kernel_args(a, b, offs, out_dtype):
        check_grouped_gemm_args(a, b, offs, out_dtype)
    try:
        return kernels.grouped_gemm(a, b, offs, out_dtype)
    except ValueError:  # the kernel's own argument check: name the argument
        check_grouped_gemm_args(a, b, offs, out_dtype)
        raise


@torch.library.register_fake("ts_moe::grouped_gemm", lib=_lib)
def _grouped_gemm_fake(a, b, offs, out_dtype=None):
    check_grouped_gemm_args(a, b, offs, out_dtype, fake=True)
    return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype or a.dtype)


_lib.impl("grouped_gemm", _grouped_gemm_cpu, "CPU")
_lib.impl("grouped_gemm", _grouped_gemm_cuda, "CUDA")


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.ops.ts_moe.grouped_gemm``: ``out[r] = a[r] @ b[e]`` for the rows of expert ``e``.

    a: (M, K) bf16/fp16; b: (E, K, N), either of its last two dims contiguous
    (``w.transpose(-2, -1)`` of an (E, N, K) nn.Linear weight works); offs:
    int32 (E,) cumulative row ends.  Returns (M, N) in ``out_dtype`` (default
    ``a.dtype``; float32 allowed), zeros past ``offs[-1]``.
    """
    check_tensor_types(a=a, b=b, offs=offs)
    return torch.ops.ts_moe.grouped_gemm(a, b, offs, out_dtype)


# ------------------------------------------------------ grouped_gemm_swiglu
def _check_swiglu_args(a, gate_up, offs, fake=False):
    check_grouped_gemm_args(a, gate_up, offs, b_name="gate_up", k_dim=2, fake=fake)
    if gate_up.shape[1] % 16:
        raise ValueError(
            f"gate_up must be (E, 2I, H) with I a multiple of 8, got {tuple(gate_up.shape)}")


def _grouped_gemm_swiglu_cpu(a, gate_up, offs):
    _check_swiglu_args(a, gate_up, offs)
    return grouped_gemm_swiglu_reference(a, gate_up, offs)


def _grouped_gemm_swiglu_cuda(a, gate_up, offs):
    kernels = _kernels(a.device)
    if kernels is None:
        _check_swiglu_args(a, gate_up, offs)
        return grouped_gemm_swiglu_reference(a, gate_up, offs)
    if not plausible_kernel_args(a, gate_up, offs, None) or gate_up.shape[1] % 16:
        _check_swiglu_args(a, gate_up, offs)
    try:
        return kernels.grouped_gemm_swiglu(a, gate_up, offs)
    except ValueError:  # the kernel's own argument check: name the argument
        _check_swiglu_args(a, gate_up, offs)
        raise


@torch.library.register_fake("ts_moe::grouped_gemm_swiglu", lib=_lib)
def _grouped_gemm_swiglu_fake(a, gate_up, offs):
    _check_swiglu_args(a, gate_up, offs, fake=True)
    return a.new_empty((a.shape[0], gate_up.shape[1] // 2))


_lib.impl("grouped_gemm_swiglu", _grouped_gemm_swiglu_cpu, "CPU")
_lib.impl("grouped_gemm_swiglu", _grouped_gemm_swiglu_cuda, "CUDA")


def grouped_gemm_swiglu(a: torch.Tensor, gate_up: torch.Tensor,
                        offs: torch.Tensor) -> torch.Tensor:
    """``torch.ops.ts_moe.grouped_gemm_swiglu``: ``silu(a @ gate^T) * (a @ up^T)`` per expert.

    gate_up: (E, 2I, H), the Hugging Face (transformers 5) layout, gate rows
    first.  Returns (M, I) in ``a.dtype``; rows past ``offs[-1]`` are zeros.
    The same ragged-expert rules as :func:`grouped_gemm`.
    """
    check_tensor_types(a=a, gate_up=gate_up, offs=offs)
    return torch.ops.ts_moe.grouped_gemm_swiglu(a, gate_up, offs)
