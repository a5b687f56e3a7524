"""Torch side of the Blackwell grouped GEMM: compile (once per configuration)
and launch :class:`csrc_free_kernels.sm100.grouped_gemm_sm100.GroupedGemmSm100` on
the current stream (never run on hardware here).

- :data:`GROUPED_GEMM`, :data:`GROUPED_GEMM_SWIGLU`: the sm_100 backends of the
  op layer (``ts_moe.ops.backend``); they gather ``a[a_index]`` in the kernel;
- :func:`grouped_gemm`: the module's own entry (tests, benchmarks).
"""

import functools

import cutlass
import torch

from ..common import compile as kcompile
from .grouped_gemm_sm100 import GroupedGemmSm100
from .grouped_gemm_sm100_config import MAX_EXPERTS, TileConfigSm100, choose_config, swiglu_config

def fake_args(a_dtype, c_dtype, b_n_major: bool, swiglu: bool = False, gather: bool = True):
    """Symbolic (M, K), (E, K, N), (M', N'), (E,) and row-index tensors (``N' = N / 2``
    for SwiGLU; gathering: M' rows, the index's length; else M' = M and the index
    is a placeholder of any length)."""
    return kcompile.fake_gemm_args(a_dtype, c_dtype, b_n_major, own_n_out=swiglu,
                                   row_index=True, gather=gather)


@functools.cache
def compiled_kernel(config: TileConfigSm100, a_dtype, c_dtype, b_n_major: bool, gather: bool,
                    swiglu: bool):
    key = ("GroupedGemmSm100", config, str(a_dtype), str(c_dtype), b_n_major, gather, swiglu,
           "sm_100a")

    def build():
        kernel = GroupedGemmSm100(config, gather=gather, b_n_major=b_n_major, swiglu=swiglu)
        ca, cc = kcompile.CUTE_DTYPES[a_dtype], kcompile.CUTE_DTYPES[c_dtype]
        return kernel, (*fake_args(ca, cc, b_n_major, swiglu, gather), cutlass.Int32(2),
                        kcompile.fake_stream())

    return kcompile.get_compiled(key, build)


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

    def choose_config(self, a, b, offs, out, a_index) -> TileConfigSm100 | None:
        if a.shape[1] % 8:
            return None
        return choose_config(b.shape[0], b.shape[2], a.shape[1], out.shape[0])

    def run(self, a, b, offs, out, config, *, a_index=None, prefetch_weights=False):
        return _launch(a, b, offs, out, config, a_index, False)


class GroupedGemmSwigluBackend:
    """The sm_100 backend of ``ts_moe.grouped_gemm_swiglu``: the fused epilogue,
    where I is a multiple of the tile's ``tile_n / 2`` and the weights are
    H-contiguous (the layout of a checkpoint's (E, 2I, H) stack)."""

    gathers = True

    def choose_config(self, a, gate_up, offs, out, a_index) -> TileConfigSm100 | None:
        if a.shape[1] % 8 or gate_up.stride(2) != 1:
            return None
        return swiglu_config(gate_up.shape[0], gate_up.shape[1], a.shape[1], out.shape[0])

    def run(self, a, gate_up, offs, out, config, *, a_index=None, prefetch_weights=False):
        return _launch(a, gate_up.transpose(-2, -1), offs, out, config, a_index, True)


GROUPED_GEMM = GroupedGemmBackend()
GROUPED_GEMM_SWIGLU = GroupedGemmSwigluBackend()


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, *,
                 a_index: torch.Tensor | None = None, swiglu: bool = False,
                 config: TileConfigSm100 | None = None) -> torch.Tensor:
    """Launch on the current stream, for tests and benchmarks (the op layer calls
    :data:`GROUPED_GEMM`); ``out`` (M', N) or (M', N / 2) for SwiGLU, 16-byte
    rows; K a multiple of 8, I a multiple of ``tile_n / 2`` for SwiGLU.  Never
    run on hardware here (see the module docstring)."""
    k = a.shape[1]
    num_experts, _, n = b.shape
    if k % 8:
        raise ValueError(f"the sm_100 kernel gathers 16-byte chunks: K = {k} must be a "
                         f"multiple of 8")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"the sm_100 kernel supports up to {MAX_EXPERTS} experts, "
                         f"got {num_experts}")
    cfg = config or choose_config(num_experts, n, k, out.shape[0])
    if swiglu and (n // 2) % (cfg.tile_n // 2):
        raise ValueError(f"the fused SwiGLU kernel needs I = {n // 2} to be a multiple of "
                         f"{cfg.tile_n // 2}")
    if out.shape[0] == 0 or out.shape[1] == 0:
        return out
    return _launch(a if a.stride(-1) == 1 else a.contiguous(), b, offs, out, cfg, a_index, swiglu)
