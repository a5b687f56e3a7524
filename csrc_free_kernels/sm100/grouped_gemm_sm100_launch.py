"""Torch side of the Blackwell grouped GEMM: its builds, compiled once each, and its
backends, which launch :class:`csrc_free_kernels.sm100.grouped_gemm_sm100.GroupedGemmSm100`
on the current stream (never run on hardware here).

- :func:`build`, :func:`builds`: one compile, and every one a call can reach;
  :func:`checked`: those the PTX tests and the pre-flight compile;
- :data:`GROUPED_GEMM`, :data:`GROUPED_GEMM_SWIGLU`: the sm_100 backends of the
  op layer (``ts_moe.ops.backend``); they gather ``a[a_index]`` in the kernel;
  :data:`KERNELS`.
"""

import functools
import itertools

import cutlass
import torch

from ..common import compile as kcompile
from ..common.family import Build, Kernels, Op
from ..common.kernel_config import Declined
from .grouped_gemm_sm100 import GroupedGemmSm100
from .grouped_gemm_sm100_config import (CONFIGS, MAX_EXPERTS, TileConfigSm100, choose_config,
                                        swiglu_config)

HALF = (torch.bfloat16, torch.float16)  # the kernel's operand types


def fake_args(a_dtype, c_dtype, b_n_major: bool, swiglu: bool = False, gather: bool = True):
    """Symbolic (M, K), (E, K, N), (M', N'), (E,) and row-index tensors (``N' = N / 2``
    for SwiGLU; gathering: M' rows, the index's length; else M' = M and the index
    is a placeholder of any length)."""
    return kcompile.fake_gemm_args(a_dtype, c_dtype, b_n_major, own_n_out=swiglu,
                                   row_index=True, gather=gather)


def build(config: TileConfigSm100, a_dtype=torch.bfloat16, c_dtype=None,
          b_n_major: bool = True, gather: bool = True, swiglu: bool = False) -> Build:
    """The build of a call (``sm100_gemm_<config>`` / ``sm100_swiglu_<config>``, with
    ``_fp16``, ``_bk`` for K-major weights, ``_dense`` without the row gather and
    ``_f32_out``)."""
    c_dtype = c_dtype or a_dtype
    key = ("GroupedGemmSm100", config, str(a_dtype), str(c_dtype), b_n_major, gather, swiglu,
           "sm_100a")
    name = ("sm100_" + ("swiglu_" if swiglu else "gemm_") + config.name
            + ("_fp16" if a_dtype == torch.float16 else "") + ("" if b_n_major else "_bk")
            + ("" if gather else "_dense") + ("_f32_out" if c_dtype == torch.float32 else ""))

    def make():
        kernel = GroupedGemmSm100(config, gather=gather, b_n_major=b_n_major, swiglu=swiglu)
        ca, cc = kcompile.CUTE_DTYPES[a_dtype], kcompile.CUTE_DTYPES[c_dtype]
        return kernel, (*fake_args(ca, cc, b_n_major, swiglu, gather), cutlass.Int32(2),
                        kcompile.fake_stream())

    return Build(name, key, make, {"config": config, "a_dtype": a_dtype, "c_dtype": c_dtype,
                                   "b_n_major": b_n_major, "gather": gather, "swiglu": swiglu})


def builds():
    """Every build a call can reach: each configuration x operand type x gathering or
    not x (plain: either weight layout, output in the operand type or fp32; SwiGLU:
    H-contiguous weights, the operand type)."""
    for config, dtype, gather in itertools.product(CONFIGS.values(), HALF, (True, False)):
        for b_n_major in (True, False):
            for out in (dtype, torch.float32):
                yield build(config, dtype, out, b_n_major, gather)
        yield build(config, dtype, dtype, False, gather, swiglu=True)


def checked(b: Build) -> bool:
    """bf16, each configuration x (plain, SwiGLU) x gathering or not, in the layer's
    layouts (plain N-major, SwiGLU H-contiguous); at 256 columns also K-major weights and
    fp32 output, once each.  No Blackwell GPU runs them here: the pre-flight is all the
    checking they get, so every kernel shape is in."""
    s = b.spec
    if s["a_dtype"] != torch.bfloat16:
        return False
    if s["c_dtype"] == torch.float32:
        return s["config"].name == "n256" and s["b_n_major"] and s["gather"] and not s["swiglu"]
    return s["swiglu"] or s["b_n_major"] or (s["config"].name == "n256" and s["gather"])


@functools.cache
def compiled_kernel(config: TileConfigSm100, a_dtype, c_dtype, b_n_major: bool, gather: bool,
                    swiglu: bool):
    b = build(config, a_dtype, c_dtype, b_n_major, gather, swiglu)
    return kcompile.get_compiled(b)


@functools.cache
def _num_ctas(device_index: int) -> int:
    """One CTA per SM, whole pairs (cached: it is on every call's path)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count // 2 * 2


def _launch(a, b, offs, out, config: TileConfigSm100, a_index, swiglu: bool):
    index = a_index if a_index is not None else offs  # unread without gathering
    fn = compiled_kernel(config, a.dtype, out.dtype, b.stride(-1) == 1, a_index is not None, swiglu)
    fn(a, b, out, offs, index, _num_ctas(a.get_device()))
    return out


class GroupedGemmBackend:
    """The sm_100 backend of ``ts_moe.grouped_gemm`` (row-grouped): gathers
    ``a[a_index]`` in the kernel, in whole 16-byte chunks (K a multiple of 8)."""

    gathers = True

    def choose_config(self, a, b, offs, out, a_index) -> TileConfigSm100 | Declined:
        if a.shape[1] % 8:
            return Declined(f"K = {a.shape[1]}: the sm_100 kernel gathers 16-byte chunks "
                            f"(a multiple of 8)")
        return choose_config(b.shape[0], b.shape[2], a.shape[1], out.shape[0])

    def run(self, a, b, offs, out, config, *, a_index=None, prefetch_weights=False):
        return _launch(a, b, offs, out, config, a_index, False)


class GroupedGemmSwigluBackend:
    """The sm_100 backend of ``ts_moe.grouped_gemm_swiglu``: the fused epilogue,
    where I is a multiple of the tile's ``tile_n / 2`` and the weights are
    H-contiguous (the layout of a checkpoint's (E, 2I, H) stack)."""

    gathers = True

    def choose_config(self, a, gate_up, offs, out, a_index) -> TileConfigSm100 | Declined:
        if a.shape[1] % 8 or gate_up.stride(2) != 1:
            return Declined("the fused sm_100 kernel takes K a multiple of 8 and "
                            "H-contiguous weights")
        return swiglu_config(gate_up.shape[0], gate_up.shape[1], a.shape[1], out.shape[0])

    def run(self, a, gate_up, offs, out, config, *, a_index=None, prefetch_weights=False):
        return _launch(a, gate_up.transpose(-2, -1), offs, out, config, a_index, True)


GROUPED_GEMM = GroupedGemmBackend()
GROUPED_GEMM_SWIGLU = GroupedGemmSwigluBackend()


KERNELS = Kernels(backends={Op.GROUPED_GEMM: GROUPED_GEMM,
                            Op.GROUPED_GEMM_SWIGLU: GROUPED_GEMM_SWIGLU},
                  builds=builds, checked=checked, max_experts=MAX_EXPERTS, dtypes=HALF)
