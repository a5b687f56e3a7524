"""Torch side of the Hopper k-grouped GEMM (the weight gradient): its builds, compiled
once each, and its backend, which launches
:class:`csrc_free_kernels.hopper.grouped_gemm_dw_sm90.GroupedGemmDwSm90` on the current
stream.

- :func:`build`, :func:`builds`: one compile, and every one a call can reach (each
  configuration x bf16/fp16 x output in the operand type or fp32; all checked on the CPU);
- :data:`GROUPED_GEMM_K`: the sm_90 backend of the op layer's k-grouped form
  (``ts_moe.ops.backend.GroupedGemmK``); :data:`KERNELS`: what the family serves.
"""

import functools

import cutlass
import cutlass.cute as cute
import torch

from ..common import compile as kcompile
from ..common.family import Build, Kernels, Op
from ..common.kernel_config import Declined
from .grouped_gemm_dw_sm90 import GroupedGemmDwSm90
from .grouped_gemm_dw_sm90_config import (CONFIGS, MAX_EXPERTS, DwConfig, choose_config,
                                          output_tiles)

HALF = (torch.bfloat16, torch.float16)  # the kernel's operand types


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


def build(config: DwConfig, ab_dtype=torch.bfloat16, c_dtype=None) -> Build:
    """The build of a call: operands in ``ab_dtype``, the output in ``c_dtype`` (default
    ``ab_dtype``); named after the configuration, with ``_fp16`` and ``_f32_out``."""
    c_dtype = c_dtype or ab_dtype
    key = ("GroupedGemmDwSm90", config, str(ab_dtype), str(c_dtype), "sm_90a")
    name = (config.name + ("_fp16" if ab_dtype == torch.float16 else "")
            + ("_f32_out" if c_dtype == torch.float32 else ""))

    def make():
        return GroupedGemmDwSm90(config), (
            *_fake_args(kcompile.CUTE_DTYPES[ab_dtype], kcompile.CUTE_DTYPES[c_dtype]),
            cutlass.Int32(1), kcompile.fake_stream())

    return Build(name, key, make, {"config": config, "ab_dtype": ab_dtype,
                                   "c_dtype": c_dtype})


def builds():
    """Every build a call can reach: each configuration x operand type x output type."""
    for config in CONFIGS.values():
        for dtype in HALF:
            for out in (dtype, torch.float32):
                yield build(config, dtype, out)


@functools.cache
def compiled_kernel(config: DwConfig, ab_dtype, c_dtype):
    """The compiled kernel (memoized: it is on every call's path)."""
    b = build(config, ab_dtype, c_dtype)
    return kcompile.get_compiled(b)


@functools.cache
def _launcher(config: DwConfig, ab_dtype, c_dtype, device_index: int):
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return compiled_kernel(config, ab_dtype, c_dtype), sms


def _launch(a, dy, offs, out, config: DwConfig):
    num_experts, k, n = out.shape
    fn, sms = _launcher(config, a.dtype, out.dtype, a.get_device())
    fn(a, dy, out, offs, min(sms, output_tiles(config, num_experts, k, n)))
    return out


class GroupedGemmKBackend:
    """The sm_90 backend of the op's k-grouped form: ``a`` (K, M), unit stride on
    K, is read as the (M, K) rows of the kernel; 16-bit, K and N multiples of 8."""

    def choose_config(self, a, b, offs, out) -> DwConfig | Declined:
        (k, m), n = a.shape, b.shape[1]
        if a.dtype not in HALF:
            return Declined(f"{a.dtype} operands: the k-grouped kernel takes bf16 or fp16")
        if k % 8 or n % 8:
            return Declined(f"K = {k}, N = {n}: the k-grouped kernel needs multiples of 8")
        return choose_config(offs.shape[0], k, n, m)

    def run(self, a, b, offs, out, config):
        return _launch(a.t(), b, offs, out, config)


GROUPED_GEMM_K = GroupedGemmKBackend()


KERNELS = Kernels(backends={Op.GROUPED_GEMM_K: GROUPED_GEMM_K}, builds=builds,
                  max_experts=MAX_EXPERTS, dtypes=HALF)
