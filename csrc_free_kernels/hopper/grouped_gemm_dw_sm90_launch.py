"""Torch side of the Hopper k-grouped GEMM (the weight gradient): compile (once
per configuration) and launch
:class:`csrc_free_kernels.hopper.grouped_gemm_dw_sm90.GroupedGemmDwSm90` on the current stream.

- :data:`GROUPED_GEMM_K`: the sm_90 backend of the op layer's k-grouped form
  (``ts_moe.ops.backend.GroupedGemmK``);
- :func:`grouped_gemm_k`: the module's own entry (tests, benchmarks), which
  checks its arguments.
"""

import functools

import cutlass
import cutlass.cute as cute
import torch

from ..common import compile as kcompile
from .grouped_gemm_dw_sm90 import GroupedGemmDwSm90
from .grouped_gemm_dw_sm90_config import MAX_EXPERTS, DwConfig, choose_config, output_tiles

__all__ = ["GROUPED_GEMM_K", "grouped_gemm_k", "choose_config", "MAX_EXPERTS"]


def _fake_args(ab_dtype, c_dtype):
    """Symbolic (M, K) a, (M, N) dy, (E, K, N) out, (E,) offs: last dims
    contiguous, other strides symbolic multiples of 16 bytes."""
    m, k, n, e = kcompile.sym_dims(4)

    def s(dtype):
        return cute.sym_int64(divisibility=128 // dtype.width)

    f = cute.runtime.make_fake_tensor
    a = f(ab_dtype, (m, k), (s(ab_dtype), 1), assumed_align=16)
    dy = f(ab_dtype, (m, n), (s(ab_dtype), 1), assumed_align=16)
    out = f(c_dtype, (e, k, n), (s(c_dtype), s(c_dtype), 1), assumed_align=16)
    offs = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (e,), assumed_align=4)
    return a, dy, out, offs


@functools.cache
def compiled_kernel(config: DwConfig, ab_dtype, c_dtype):
    """The compiled kernel (memoized: it is on every call's path)."""
    key = ("GroupedGemmDwSm90", config, str(ab_dtype), str(c_dtype), "sm_90a")

    def build():
        return GroupedGemmDwSm90(config), (
            *_fake_args(kcompile.CUTE_DTYPES[ab_dtype], kcompile.CUTE_DTYPES[c_dtype]),
            cutlass.Int32(1), kcompile.fake_stream())

    return kcompile.get_compiled(key, build)


@functools.cache
def _launcher(config: DwConfig, ab_dtype, c_dtype, device_index: int):
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return compiled_kernel(config, ab_dtype, c_dtype), sms


def _check(a, dy, offs, out):
    """Cheap layout checks (no sync): the layouts the compiled kernel takes."""
    if a.dim() != 2 or dy.dim() != 2 or out.dim() != 3 or offs.dim() != 1:
        raise ValueError("grouped_gemm_k: a (M, K), dy (M, N), offs (E,), out (E, K, N)")
    m, k = a.shape
    if dy.shape[0] != m or tuple(out.shape) != (offs.shape[0], k, dy.shape[1]):
        raise ValueError(f"grouped_gemm_k: shapes a {tuple(a.shape)}, dy {tuple(dy.shape)}, "
                         f"offs {tuple(offs.shape)}, out {tuple(out.shape)} do not agree")
    if a.dtype not in (torch.bfloat16, torch.float16) or dy.dtype != a.dtype:
        raise ValueError(f"grouped_gemm_k: a and dy must be one of bf16/fp16, got "
                         f"{a.dtype}, {dy.dtype}")
    if out.dtype not in (a.dtype, torch.float32):
        raise ValueError(f"grouped_gemm_k: out must be {a.dtype} or float32, got {out.dtype}")
    if offs.dtype != torch.int32 or (offs.shape[0] > 1 and offs.stride(0) != 1):
        raise ValueError("grouped_gemm_k: offs must be contiguous int32")
    if offs.shape[0] > MAX_EXPERTS:
        raise ValueError(f"grouped_gemm_k: at most {MAX_EXPERTS} experts, got {offs.shape[0]}")
    devices = {t.device for t in (a, dy, offs, out)}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"grouped_gemm_k: all tensors on one CUDA device, got {devices}")
    for name, t in (("a", a), ("dy", dy), ("out", out)):
        align = 16 // t.element_size()
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"grouped_gemm_k: {name} must have a contiguous last dim")
        if any(s % align for s in t.stride()[:-1]) or t.data_ptr() % 16:
            raise ValueError(f"grouped_gemm_k: {name}: strides {t.stride()} must be "
                             f"16-byte multiples and the data 16-byte aligned")


def _launch(a, dy, offs, out, config: DwConfig):
    num_experts, k, n = out.shape
    fn, sms = _launcher(config, a.dtype, out.dtype, a.get_device())
    fn(a, dy, out, offs, min(sms, output_tiles(config, num_experts, k, n)))
    return out


class GroupedGemmKBackend:
    """The sm_90 backend of the op's k-grouped form: ``a`` (K, M), unit stride on
    K, is read as the (M, K) rows of the kernel; 16-bit, K and N multiples of 8."""

    def choose_config(self, a, b, offs, out) -> DwConfig | None:
        (k, m), n = a.shape, b.shape[1]
        if k % 8 or n % 8 or a.dtype not in (torch.bfloat16, torch.float16):
            return None
        return choose_config(offs.shape[0], k, n, m)

    def run(self, a, b, offs, out, config):
        return _launch(a.t(), b, offs, out, config)


GROUPED_GEMM_K = GroupedGemmKBackend()


def grouped_gemm_k(a: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, out: torch.Tensor,
                   config: DwConfig | None = None) -> torch.Tensor:
    """``out[e] = a[rows e].T @ dy[rows e]`` on the current stream; returns ``out``.

    a (M, K), dy (M, N) bf16/fp16 with contiguous rows, offs (E,) int32 on the
    device, out (E, K, N) of a's dtype or float32 (last dim contiguous, strides
    16-byte multiples).  No host sync (CUDA-graph capturable); deterministic.
    ``config`` (instead of :func:`choose_config`) is for tests and benchmarks.
    """
    _check(a, dy, offs, out)
    m, k = a.shape
    num_experts, _, n = out.shape
    if num_experts == 0 or k == 0 or n == 0:
        return out
    if m == 0:
        return out.zero_()
    return _launch(a, dy, offs, out, config or choose_config(num_experts, k, n, m))
