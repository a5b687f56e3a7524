"""Torch side of the Hopper grouped GEMM: its builds, compiled once each, and its
backends, which launch :class:`csrc_free_kernels.hopper.grouped_gemm_sm90.GroupedGemmSm90`
(and its SwiGLU subclass) on the current stream.

- :func:`build`: one compile (the run-time cache key and the kernel with its fake
  arguments); :func:`builds`: every build a call can reach; :func:`checked`: those the
  PTX tests and the pre-flight compile on the CPU;
- :data:`GROUPED_GEMM`, :data:`GROUPED_GEMM_SWIGLU`: the sm_90 backends of the op layer
  (``ts_moe.ops.backend.GroupedGemm`` / ``GroupedGemmSwiglu``): ``choose_config``
  (:mod:`.grouped_gemm_sm90_config`), then ``run`` launches the kernel once on
  arguments the op validated; :data:`KERNELS`: what the family serves.
"""

import functools
import itertools

import cutlass
import torch

from ..common import compile as kcompile
from ..common.family import Build, Kernels, Op
from ..common.kernel_config import Declined
from .grouped_gemm_sm90 import GroupedGemmSm90, GroupedGemmSwigluSm90
from .grouped_gemm_sm90_config import (CONFIGS, MAX_EXPERTS, TileConfig, choose_config,
                                      swiglu_config, swiglu_takes)

HALF = (torch.bfloat16, torch.float16)  # the kernels' operand types


def _fake_args(a_dtype, c_dtype, b_n_major: bool, kernel_cls=GroupedGemmSm90):
    """Symbolic (M, K), (E, K, N), (M, N'), (E,) tensors with 16-byte strides
    (``N' = N`` except for the SwiGLU kernel, whose output has half the
    weight's columns): :func:`csrc_free_kernels.common.compile.fake_gemm_args`."""
    return kcompile.fake_gemm_args(
        a_dtype, c_dtype, b_n_major, own_n_out=issubclass(kernel_cls, GroupedGemmSwigluSm90))


def build(config: TileConfig, a_dtype=torch.bfloat16, c_dtype=None, b_n_major: bool = True,
          swiglu: bool = False, prefetch_weights: bool = False, kernel_cls=None) -> Build:
    """The build of a call: ``a`` K-major in ``a_dtype``, the output in ``c_dtype``
    (default ``a_dtype``), weights N-major or K-major, the SwiGLU kernel or the plain
    one, weights streaming before the kernel ahead ends where the configuration
    honours it; ``kernel_cls`` a variant's class instead of the plain kernel (an A/B,
    a test's probe).  Named ``gemm_<config>`` / ``swiglu_<config>``
    with ``_fp16``, ``_bk`` (K-major weights), ``_f32_out`` and ``_prefetch`` as they
    apply, and the variant class's ``variant`` suffix."""
    c_dtype = c_dtype or a_dtype
    kernel_cls = kernel_cls or (GroupedGemmSwigluSm90 if swiglu else GroupedGemmSm90)
    prefetch = prefetch_weights and kernel_cls.prefetch_supported(config)  # and honoured
    key = (kernel_cls.__name__, config, str(a_dtype), str(c_dtype), b_n_major, "sm_90a",
           *(("prefetch_weights",) if prefetch else ()))
    name = (("swiglu_" if swiglu else "gemm_") + config.name
            + ("_fp16" if a_dtype == torch.float16 else "") + ("" if b_n_major else "_bk")
            + ("_f32_out" if c_dtype == torch.float32 else "") + ("_prefetch" if prefetch else "")
            + (f"_{kernel_cls.variant}" if getattr(kernel_cls, "variant", "") else ""))

    def make():
        ca, cc = kcompile.CUTE_DTYPES[a_dtype], kcompile.CUTE_DTYPES[c_dtype]
        return kernel_cls(config, prefetch_weights=prefetch), (
            *_fake_args(ca, cc, b_n_major, kernel_cls), cutlass.Int32(1), kcompile.fake_stream())

    return Build(name, key, make, {"config": config, "a_dtype": a_dtype, "c_dtype": c_dtype,
                                   "b_n_major": b_n_major, "swiglu": swiglu,
                                   "prefetch_weights": prefetch})


def builds():
    """Every build a call can reach: each configuration x operand type x weight layout
    x (plain: output in the operand type or fp32; SwiGLU: the operand type) x
    weights prefetched or not (where the configuration honours it)."""
    seen = set()
    for config, dtype, b_n_major, prefetch in itertools.product(
            CONFIGS.values(), HALF, (True, False), (False, True)):
        for swiglu, out in ((False, dtype), (False, torch.float32), (True, dtype)):
            if swiglu and not swiglu_takes(config, b_n_major):
                continue  # such calls take other tiles (swiglu_config)
            b = build(config, dtype, out, b_n_major, swiglu, prefetch)
            if b.key not in seen:
                seen.add(b.key)
                yield b


def checked(b: Build) -> bool:
    """The builds the PTX tests and the pre-flight compile on the CPU: bf16 in every
    configuration with K-major weights (the layer's), plain and SwiGLU; N-major plain
    where a configuration's weight loads differ by layout (all but ``mid``); prefetching
    where the MoE block's GEMMs take it; fp16 and fp32 output once each."""
    s = b.spec
    name = s["config"].name
    if s["a_dtype"] == torch.float16:
        return name == "decode" and not s["swiglu"] and s["b_n_major"] and \
            s["c_dtype"] == torch.float16 and not s["prefetch_weights"]
    if s["c_dtype"] == torch.float32:
        return name == "prefill" and s["b_n_major"] and not s["prefetch_weights"]
    if s["prefetch_weights"]:
        return not s["b_n_major"] and (name in ("decode16", "decode16_n64") or (
            name == "prefill" and not s["swiglu"]))
    if s["swiglu"]:
        return not s["b_n_major"]
    return name != "mid" or s["b_n_major"]


def _row_major(t: torch.Tensor) -> bool:
    """Last dim contiguous: K-major tokens (M, K), N-major weights (E, K, N).  Its
    stride must be 1 even where the dim has size 1: the compiled signature says so."""
    return t.stride(-1) == 1


@functools.cache
def compiled_kernel(config: TileConfig, a_dtype, c_dtype, b_n_major: bool,
                    kernel_cls=GroupedGemmSm90, prefetch_weights: bool = False):
    """The compiled kernel for a K-major ``a`` (memoized: it is on every call's path)."""
    b = build(config, a_dtype, c_dtype, b_n_major, issubclass(kernel_cls, GroupedGemmSwigluSm90),
              prefetch_weights, kernel_cls)
    return kcompile.get_compiled(b)


@functools.cache
def _launcher(config: TileConfig, a_dtype, c_dtype, b_n_major: bool, kernel_cls,
              device_index: int, prefetch_weights: bool = False):
    """The compiled kernel and its grid (one CTA per SM, whole clusters): one
    cache lookup per call."""
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return (compiled_kernel(config, a_dtype, c_dtype, b_n_major, kernel_cls, prefetch_weights),
            sms // config.cluster_m * config.cluster_m)


def launch(a, b, offs, out, config: TileConfig, kernel_cls=GroupedGemmSm90,
           prefetch_weights: bool = False):
    """``out = grouped_gemm(a, b, offs)`` by ``kernel_cls`` (the SwiGLU kernel, or a
    variant's class for an A/B) in ``config``, on the current stream; the arguments as
    the op validates them."""
    fn, ctas = _launcher(config, a.dtype, out.dtype, _row_major(b), kernel_cls, a.get_device(),
                         prefetch_weights)
    fn(a, b, out, offs, ctas)
    return out


class GroupedGemmBackend:
    """The sm_90 backend of ``ts_moe.grouped_gemm`` (row-grouped): the op gathers
    ``a[a_index]`` first (with the row kernel) and passes ``prefetch_weights``."""

    gathers = False

    def choose_config(self, a, b, offs, out, a_index) -> TileConfig:
        return choose_config(b.shape[0], b.shape[2], a.shape[1], out.shape[0])

    def run(self, a, b, offs, out, config, *, a_index=None, prefetch_weights=False):
        return launch(a, b, offs, out, config, GroupedGemmSm90, prefetch_weights)


class GroupedGemmSwigluBackend:
    """The sm_90 backend of ``ts_moe.grouped_gemm_swiglu``: the fused kernel, where
    I is a multiple of its tile's ``tile_n / 2`` (:func:`swiglu_config`)."""

    gathers = False

    def choose_config(self, a, gate_up, offs, out, a_index) -> TileConfig | Declined:
        return swiglu_config(gate_up.shape[0], gate_up.shape[1], a.shape[1], out.shape[0],
                             n_major=_row_major(gate_up.transpose(-2, -1)))

    def run(self, a, gate_up, offs, out, config, *, a_index=None, prefetch_weights=False):
        return launch(a, gate_up.transpose(-2, -1), offs, out, config, GroupedGemmSwigluSm90,
                       prefetch_weights)


GROUPED_GEMM = GroupedGemmBackend()
GROUPED_GEMM_SWIGLU = GroupedGemmSwigluBackend()


KERNELS = Kernels(backends={Op.GROUPED_GEMM: GROUPED_GEMM,
                            Op.GROUPED_GEMM_SWIGLU: GROUPED_GEMM_SWIGLU},
                  builds=builds, checked=checked, max_experts=MAX_EXPERTS, dtypes=HALF)
