"""Torch launch code of the FP8 grouped GEMM (sm_90a): arguments already validated.

Conventions (``torch.nn.functional.scaled_grouped_mm``'s, for 2-D ``a`` and 3-D ``b``):

- ``a`` (M, K) ``torch.float8_e4m3fn``, row-major (``stride(-1) == 1``, 16-byte rows);
- ``b`` (E, K, N) e4m3 with K contiguous (``stride(1) == 1``): the ``transpose(-2, -1)``
  view of the (E, N, K) checkpoint stack (the kernel reads weights K-major only);
- ``offs`` int32 (E,) row ends on the device, any values (the kernel segments by
  ``cummax(clamp(offs, 0, M))``); rows at or past ``offs[-1]`` are written as zeros;
- scales are dequantization multipliers (``real ~ fp8 * scale``), fp32:

  ========== ======================================== ======================================
  recipe     ``scale_a``                              ``scale_b``
  ========== ======================================== ======================================
  blockwise  (M, ceil(K/128)); fast: M-major,          (E, ceil(N/128), ceil(K/128)); any
             ``stride() == (1, Mp)``, ``Mp % 4 == 0``  strides
  rowwise    (M,)                                     (E, N)
  tensorwise one element (0-d or (1,))                (E,)
  ========== ======================================== ======================================

  The fast blockwise ``scale_a`` is ``t[:, :M].t()`` of a contiguous (ceil(K/128), Mp)
  tensor (what ``quantize_fp8_sm90_launch.quantize(x, "blockwise_1x128")`` returns):
  the kernel's TMA reads a k-block's scales of a tile's rows as one box.  Any other
  strides are copied into it here (a small device copy); rowwise/tensorwise scales and
  ``scale_b`` are made contiguous (free when they are).

- ``a_index`` (M',) int32/int64: the rows ``a[a_index]`` (zero rows, and zero scales, for
  indices outside ``[0, M)``) are gathered on the device first, with their scales, as the
  bf16 Hopper path gathers; ``offs`` then indexes the M' gathered rows and the output has
  M' rows.

Nothing here reads a device value on the host: no sync; all launches on the current stream.
"""

import functools

import cutlass
import cutlass.cute as cute
import torch

from . import compile as kcompile
from .grouped_gemm_fp8_sm90 import GroupedGemmFp8Sm90, GroupedGemmFp8SwigluSm90
from .grouped_gemm_fp8_sm90_config import (RECIPES, SCALE_BLOCK, TileConfig, choose_config,
                                           swiglu_supported)
from .grouped_gemm_sm90_config import MAX_EXPERTS
from .quantize_fp8_sm90_launch import one_row_view

__all__ = ["scaled_grouped_gemm", "scaled_grouped_gemm_swiglu", "choose_config",
           "swiglu_supported", "fast_scale_a", "compiled_kernel"]

_OUT_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
               torch.float32: cutlass.Float32}


def fake_args(recipe: str, c_dtype, swiglu: bool = False) -> tuple:
    """Symbolic arguments of one compiled kernel: ``fake_gemm_args``' e4m3 (M, K) tokens,
    K-major (E, K, N) weights, (M, N') output and offs, then the recipe's scales (the
    blockwise ``sfa`` M-major with a 16-byte column stride; the others compact)."""
    a, b, c, offs = kcompile.fake_gemm_args(cutlass.Float8E4M3FN, c_dtype, False,
                                            own_n_out=swiglu)
    m, e = a.shape[0], b.shape[0]
    f32 = cutlass.Float32
    fake, compact = cute.runtime.make_fake_tensor, cute.runtime.make_fake_compact_tensor
    if recipe == "blockwise":
        kb, nb = kcompile.sym_dims(2)
        sfa = fake(f32, (m, kb), (1, cute.sym_int64(divisibility=4)), assumed_align=16)
        sfb = compact(f32, (e, nb, kb), stride_order=(2, 1, 0), assumed_align=4)
    elif recipe == "rowwise":
        sfa = compact(f32, (m,), assumed_align=4)
        sfb = compact(f32, (e, kcompile.sym_dims(1)[0]), stride_order=(1, 0), assumed_align=4)
    else:
        sfa = compact(f32, (1,), assumed_align=4)
        sfb = compact(f32, (e,), assumed_align=4)
    return a, b, c, offs, sfa, sfb


@functools.cache
def compiled_kernel(config: TileConfig, recipe: str, out_dtype: torch.dtype,
                    swiglu: bool = False):
    """The compiled kernel of one configuration, recipe, output dtype (memoized)."""
    cls = GroupedGemmFp8SwigluSm90 if swiglu else GroupedGemmFp8Sm90
    key = (cls.__name__, config, recipe, str(out_dtype), "sm_90a")

    def build():
        return cls(config, recipe), (*fake_args(recipe, _OUT_DTYPES[out_dtype], swiglu),
                                     cutlass.Int32(1), kcompile.fake_stream())

    return kcompile.get_compiled(key, build)


@functools.cache
def _ctas(config: TileConfig, device_index: int) -> int:
    """One CTA per SM, whole clusters."""
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return sms // config.cluster_m * config.cluster_m


def fast_scale_a(scale_a: torch.Tensor) -> torch.Tensor:
    """Blockwise ``scale_a`` (M, KB) in the kernel's layout: M-major with a 16-byte
    column stride and a 16-byte aligned start (returned as is when it already is)."""
    m, kb = scale_a.shape
    if (scale_a.stride(0) == 1 and scale_a.stride(1) % 4 == 0 and scale_a.stride(1) >= m
            and scale_a.data_ptr() % 16 == 0) or m == 0 or kb == 0:
        return scale_a
    mp = -(-m // 4) * 4
    return scale_a.new_empty(kb, mp)[:, :m].t().copy_(scale_a)


def _gather(a, scale_a, a_index, recipe):
    """``a[a_index]`` and its scales, zero rows and zero scales for indices outside
    ``[0, M)``; the blockwise scales land in the fast layout directly."""
    m = a.shape[0]
    index = a_index.long()
    valid = ((index >= 0) & (index < m)).unsqueeze(1)
    safe = index.clamp(0, max(m - 1, 0))
    rows = a.view(torch.uint8).index_select(0, safe).masked_fill_(~valid, 0)
    rows = rows.view(torch.float8_e4m3fn)
    if recipe == "tensorwise":
        return rows, scale_a
    if recipe == "rowwise":
        return rows, scale_a.index_select(0, safe).masked_fill_(~valid[:, 0], 0)
    kb = scale_a.shape[1]
    mp = -(-index.shape[0] // 4) * 4
    out = scale_a.new_empty(kb, mp)[:, :index.shape[0]].t()
    out.copy_(scale_a.index_select(0, safe).masked_fill_(~valid, 0))
    return rows, out


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` row-major with exactly the compact strides the compiled signature checks
    (torch calls a tensor contiguous whatever the strides of its size-1 dims)."""
    t = t.contiguous()
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    strides = tuple(reversed(strides))
    return t if t.stride() == strides else t.as_strided(t.shape, strides)


def _prepare_scales(scale_a, scale_b, recipe):
    if recipe == "blockwise":
        return fast_scale_a(scale_a), _compact(scale_b)
    if recipe == "tensorwise":
        return _compact(scale_a.reshape(1)), _compact(scale_b)
    return _compact(scale_a), _compact(scale_b)


def _launch(a, b, scale_a, scale_b, offs, recipe, out_dtype, a_index, out, swiglu, config):
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    num_experts, k, n = b.shape
    n_out = n // 2 if swiglu else n
    if a_index is not None:
        a, scale_a = _gather(a, scale_a, a_index, recipe)
    m = a.shape[0]
    if out is None:
        out = torch.empty(m, n_out, dtype=out_dtype, device=a.device)
    if m == 0 or n_out == 0:
        return out
    if k == 0 or num_experts == 0:
        return out.zero_()
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"the sm_90 kernel supports up to {MAX_EXPERTS} experts, "
                         f"got {num_experts}")
    cfg = config or choose_config(num_experts, n, k, m, recipe=recipe, swiglu=swiglu)
    if swiglu and not swiglu_supported(n, recipe, cfg):
        raise ValueError(f"the fused FP8 SwiGLU kernel needs I = {n // 2} to be a multiple "
                         f"of {cfg.tile_n // 2}" + (f" and of {SCALE_BLOCK}"
                                                   if recipe == "blockwise" else ""))
    scale_a, scale_b = _prepare_scales(scale_a, scale_b, recipe)
    fn = compiled_kernel(cfg, recipe, out.dtype, swiglu)
    fn(one_row_view(a), b, one_row_view(out), offs, scale_a, scale_b,
       _ctas(cfg, a.get_device()))
    return out


def scaled_grouped_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                        scale_b: torch.Tensor, offs: torch.Tensor, *, recipe: str,
                        out_dtype: torch.dtype = torch.bfloat16,
                        a_index: torch.Tensor | None = None, out: torch.Tensor | None = None,
                        config: TileConfig | None = None) -> torch.Tensor:
    """``out[r] = (a[r] @ b[e]) * scales`` for the rows ``r`` of expert ``e``; zeros past
    ``offs[-1]``.  Arguments as in the module docstring, validated by the caller.

    ``out``: (M, N) (M' with ``a_index``) of ``out_dtype`` (bf16, fp16 or fp32),
    ``stride(-1) == 1``, 16-byte aligned rows; allocated when omitted.  ``config``
    (instead of :func:`choose_config`) is for tests and benchmarks.
    """
    return _launch(a, b, scale_a, scale_b, offs, recipe, out_dtype, a_index, out, False,
                   config)


def scaled_grouped_gemm_swiglu(a: torch.Tensor, gate_up_b: torch.Tensor,
                               scale_a: torch.Tensor, scale_b: torch.Tensor,
                               offs: torch.Tensor, *, recipe: str,
                               out_dtype: torch.dtype = torch.bfloat16,
                               a_index: torch.Tensor | None = None,
                               out: torch.Tensor | None = None,
                               config: TileConfig | None = None) -> torch.Tensor:
    """``silu(a @ gate) * (a @ up)`` per expert, (M, I): ``gate_up_b`` (E, K, 2I) e4m3
    with K contiguous (the transpose view of the (E, 2I, H) stack, gate rows first);
    ``scale_b`` blockwise (E, ceil(2I/128), ceil(K/128)), rowwise (E, 2I), tensorwise
    (E,).  A ValueError where :func:`swiglu_supported` is False for the chosen tiles
    (the caller then runs :func:`scaled_grouped_gemm` and the activation apart)."""
    return _launch(a, gate_up_b, scale_a, scale_b, offs, recipe, out_dtype, a_index, out, True,
                   config)
