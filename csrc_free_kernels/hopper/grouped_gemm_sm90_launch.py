"""Torch side of the Hopper grouped GEMM: compile (once per configuration) and
launch :class:`csrc_free_kernels.hopper.grouped_gemm_sm90.GroupedGemmSm90` (and its
SwiGLU subclass) on the current stream.

- :data:`GROUPED_GEMM`, :data:`GROUPED_GEMM_SWIGLU`: the sm_90 backends of the
  op layer (``ts_moe.ops.backend.GroupedGemm`` / ``GroupedGemmSwiglu``):
  ``choose_config`` (:mod:`.grouped_gemm_sm90_config`), then ``run`` launches
  the kernel once on arguments the op validated;
- :func:`grouped_gemm`, :func:`grouped_gemm_swiglu`: the module's own entries
  (tests, benchmarks), with their guards.
"""

import functools

import cutlass
import torch

from ..common import compile as kcompile
from .grouped_gemm_sm90 import GroupedGemmSm90, GroupedGemmSwigluSm90
from .grouped_gemm_sm90_config import MAX_EXPERTS, TileConfig, choose_config, swiglu_config

def _fake_args(a_dtype, c_dtype, b_n_major: bool, kernel_cls=GroupedGemmSm90):
    """Symbolic (M, K), (E, K, N), (M, N'), (E,) tensors with 16-byte strides
    (``N' = N`` except for the SwiGLU kernel, whose output has half the
    weight's columns): :func:`csrc_free_kernels.common.compile.fake_gemm_args`."""
    return kcompile.fake_gemm_args(
        a_dtype, c_dtype, b_n_major, own_n_out=issubclass(kernel_cls, GroupedGemmSwigluSm90))


def _row_major(t: torch.Tensor) -> bool:
    """Last dim contiguous: K-major tokens (M, K), N-major weights (E, K, N).  Its
    stride must be 1 even where the dim has size 1: the compiled signature says so."""
    return t.stride(-1) == 1


def _k_major(a: torch.Tensor) -> torch.Tensor:
    """The kernels read tokens K-major (activations always are in a MoE layer);
    an M-major ``a`` is copied."""
    return a if _row_major(a) else a.contiguous()


@functools.cache
def compiled_kernel(config: TileConfig, a_dtype, c_dtype, b_n_major: bool,
                    kernel_cls=GroupedGemmSm90, prefetch_weights: bool = False):
    """The compiled kernel for a K-major ``a`` (memoized: it is on every call's path)."""
    kernel = kernel_cls(config, prefetch_weights=prefetch_weights)
    key = (kernel_cls.__name__, config, str(a_dtype), str(c_dtype), b_n_major, "sm_90a",
           *(("prefetch_weights",) if kernel.prefetch_weights else ()))

    def build():
        ca, cc = kcompile.CUTE_DTYPES[a_dtype], kcompile.CUTE_DTYPES[c_dtype]
        return kernel, (*_fake_args(ca, cc, b_n_major, kernel_cls),
                        cutlass.Int32(1), kcompile.fake_stream())

    return kcompile.get_compiled(key, build)


@functools.cache
def _launcher(config: TileConfig, a_dtype, c_dtype, b_n_major: bool, kernel_cls,
              device_index: int, prefetch_weights: bool = False):
    """The compiled kernel and its grid (one CTA per SM, whole clusters): one
    cache lookup per call."""
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return (compiled_kernel(config, a_dtype, c_dtype, b_n_major, kernel_cls, prefetch_weights),
            sms // config.cluster_m * config.cluster_m)


def _launch(a, b, offs, out, config: TileConfig, kernel_cls, prefetch_weights: bool):
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
        return _launch(a, b, offs, out, config, GroupedGemmSm90, prefetch_weights)


class GroupedGemmSwigluBackend:
    """The sm_90 backend of ``ts_moe.grouped_gemm_swiglu``: the fused kernel, where
    I is a multiple of its tile's ``tile_n / 2`` (:func:`swiglu_config`)."""

    gathers = False

    def choose_config(self, a, gate_up, offs, out, a_index) -> TileConfig | None:
        return swiglu_config(gate_up.shape[0], gate_up.shape[1], a.shape[1], out.shape[0])

    def run(self, a, gate_up, offs, out, config, *, a_index=None, prefetch_weights=False):
        return _launch(a, gate_up.transpose(-2, -1), offs, out, config, GroupedGemmSwigluSm90,
                       prefetch_weights)


GROUPED_GEMM = GroupedGemmBackend()
GROUPED_GEMM_SWIGLU = GroupedGemmSwigluBackend()


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                 out_dtype: torch.dtype | None = None, *, out: torch.Tensor | None = None,
                 config: TileConfig | None = None, kernel_cls=GroupedGemmSm90,
                 prefetch_weights: bool = False) -> torch.Tensor:
    """The kernel on the current stream, for tests and benchmarks (the op layer
    calls :data:`GROUPED_GEMM`); arguments valid for the op.

    ``out``: (M, N) ((M, N / 2) for the SwiGLU kernel) with a 16-byte aligned
    row stride; allocated here when omitted (then N must give aligned rows).
    ``config`` (instead of :func:`choose_config`) and ``kernel_cls`` (a
    :class:`GroupedGemmSm90`: the SwiGLU kernel, or a variant) are for tests
    and benchmarks.  ``prefetch_weights``: the caller vouches that the kernel launched last on
    the stream did not write ``offs`` or ``b`` and lets its dependents launch
    only once everything before it has completed (``ts_moe.grouped_gemm``
    says when), so the weights may start streaming before it ends
    (:class:`GroupedGemmSm90`).
    """
    m, k = a.shape
    num_experts, _, n = b.shape
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or a.dtype, device=a.device)
    a = _k_major(a)
    if m == 0 or n == 0:
        return out
    if k == 0 or num_experts == 0:
        return out.zero_()
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"the sm_90 kernel supports up to {MAX_EXPERTS} experts, got {num_experts}")
    cfg = config or choose_config(num_experts, n, k, m)
    return _launch(a, b, offs, out, cfg, kernel_cls, prefetch_weights)


def grouped_gemm_swiglu(a: torch.Tensor, gate_up: torch.Tensor, offs: torch.Tensor, *,
                        out: torch.Tensor | None = None, config: TileConfig | None = None,
                        prefetch_weights: bool = False,
                        kernel_cls=GroupedGemmSwigluSm90) -> torch.Tensor:
    """``silu(a @ gate^T) * (a @ up^T)`` per expert; gate_up (E, 2I, H); for tests
    and benchmarks, as :func:`grouped_gemm`.

    ``config`` defaults to :func:`swiglu_config`; a ValueError where I is not
    a multiple of its ``tile_n / 2``.  ``kernel_cls`` (a
    :class:`GroupedGemmSwigluSm90`) is for tests and benchmarks of variants."""
    m, k = a.shape
    num_experts, two_i, _ = gate_up.shape
    cfg = config or choose_config(num_experts, two_i, k, m)
    if (two_i // 2) % (cfg.tile_n // 2):
        raise ValueError(f"the fused SwiGLU kernel needs I = {two_i // 2} to be a multiple of "
                         f"{cfg.tile_n // 2} (half of {cfg.name}'s tile_n)")
    if out is None:
        out = torch.empty(m, two_i // 2, dtype=a.dtype, device=a.device)
    return grouped_gemm(a, gate_up.transpose(-2, -1), offs, out=out, config=cfg,
                        kernel_cls=kernel_cls, prefetch_weights=prefetch_weights)
