"""Torch side of the FP8 grouped GEMM (sm_90a): compile once per configuration and
launch :class:`~csrc_free_kernels.fp8.grouped_gemm_fp8_sm90.GroupedGemmFp8Sm90` (and its
SwiGLU subclass) on the current stream.

- :data:`GROUPED_GEMM`, :data:`GROUPED_GEMM_SWIGLU`: the sm_90 backends of the FP8 op
  families (``ts_moe.ops.backend.ScaledGroupedGemm`` and ``ScaledGroupedGemmSwiglu``):
  ``choose_config`` picks the tiles from the shapes
  (:mod:`.grouped_gemm_fp8_sm90_config`), or answers a
  :class:`~csrc_free_kernels.common.kernel_config.Declined` naming the limit the call meets (more than
  :data:`MAX_EXPERTS` experts, K not a multiple of 16, an I the fused kernel's tiles do
  not cover); ``run`` is :func:`launch` with that configuration;
- :func:`launch`: what the backends' ``run`` calls: the compiled kernel launched once,
  on arguments the op layer validated, with a configuration ``choose_config`` took.  It
  checks nothing;
- :func:`build`, :func:`builds`: one compile, and every one a call can reach;
  :func:`checked`: those the PTX tests and the pre-flight compile; :data:`KERNELS`.

The scale recipes arrive as a plain name, ``"blockwise"``, ``"rowwise"`` or
``"tensorwise"`` (``grouped_gemm_fp8_sm90_config.RECIPES``): the kernels know nothing
of ts_moe (data flows down), and the op layer's parsed value
(``ts_moe.fp8.recipes.Pair``) is a ``str`` enum whose members are exactly these names,
so it is handed down as it is (the compile keys take its ``str``).

Conventions (``torch.nn.functional.scaled_grouped_mm``'s, for 2-D ``a`` and 3-D ``b``):

- ``a`` (M, K) ``torch.float8_e4m3fn``, K a multiple of 16; read row-major with
  16-byte rows (another layout is copied into that one here);
- ``b`` (E, K, N) e4m3, read K-major with 16-byte strides: the ``transpose(-2, -1)``
  view of the (E, N, K) checkpoint stack (another layout is copied, the whole stack:
  convert the weights once instead);
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
  bf16 Hopper path gathers; ``offs`` then indexes the M' gathered rows;
- ``out`` (M', N) of bf16, fp16 or fp32 (N / 2 columns for the SwiGLU kernel), a unit
  stride on its columns and 16-byte rows, no empty dimension anywhere (the op answers
  those).

Nothing here reads a device value on the host: no sync; all launches on the current stream.
"""

import functools
import itertools

import cutlass
import cutlass.cute as cute
import torch

from ..common import compile as kcompile
from ..common.family import Build, Kernels, Op
from ..common.kernel_config import Declined
from ..hopper.grouped_gemm_sm90_config import MAX_EXPERTS
from .grouped_gemm_fp8_sm90 import GroupedGemmFp8Sm90, GroupedGemmFp8SwigluSm90
from .grouped_gemm_fp8_sm90_config import (CONFIGS, RECIPES, SCALE_A, SCALE_BLOCK, TileConfig,
                                           choose_config, swiglu_supported)
from .quantize_fp8_sm90_launch import one_row_view

ALIGN = 16  # bytes: the kernel's row strides and pointers
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
        sfa = fake(f32, (m, kb), (1, cute.sym_int64(divisibility=SCALE_A.row_align)),
                   assumed_align=16)
        sfb = compact(f32, (e, nb, kb), stride_order=(2, 1, 0), assumed_align=4)
    elif recipe == "rowwise":
        sfa = compact(f32, (m,), assumed_align=4)
        sfb = compact(f32, (e, kcompile.sym_dims(1)[0]), stride_order=(1, 0), assumed_align=4)
    else:
        sfa = compact(f32, (1,), assumed_align=4)
        sfb = compact(f32, (e,), assumed_align=4)
    return a, b, c, offs, sfa, sfb


def build(config: TileConfig, recipe: str, out_dtype=torch.bfloat16,
          swiglu: bool = False) -> Build:
    """The build of a call: ``<config>_<recipe>``, with ``_swiglu`` and the output type
    where it is not bf16 (``_float16``, ``_float32``)."""
    cls = GroupedGemmFp8SwigluSm90 if swiglu else GroupedGemmFp8Sm90
    recipe = str(recipe)
    key = (cls.__name__, config, recipe, str(out_dtype), "sm_90a")
    name = (f"{config.name}_{recipe}" + ("_swiglu" if swiglu else "")
            + ("" if out_dtype == torch.bfloat16 else "_" + str(out_dtype).split(".")[-1]))

    def make():
        return cls(config, recipe), (*fake_args(recipe, _OUT_DTYPES[out_dtype], swiglu),
                                     cutlass.Int32(1), kcompile.fake_stream())

    return Build(name, key, make, {"config": config, "recipe": recipe,
                                   "out_dtype": out_dtype, "swiglu": swiglu})


def builds():
    """Every build a call can reach: each configuration x recipe x (plain, SwiGLU) x
    output type."""
    for config, recipe, swiglu, out in itertools.product(
            CONFIGS.values(), RECIPES, (False, True), tuple(_OUT_DTYPES)):
        yield build(config, recipe, out, swiglu)


def checked(b: Build) -> bool:
    """Every configuration x recipe x (plain, SwiGLU) with bf16 output; the other
    output types once (``fp8_mid``, blockwise)."""
    s = b.spec
    return s["out_dtype"] == torch.bfloat16 or (
        s["config"].name == "fp8_mid" and s["recipe"] == "blockwise" and not s["swiglu"])


@functools.cache
def compiled_kernel(config: TileConfig, recipe: str, out_dtype: torch.dtype,
                    swiglu: bool = False):
    """The compiled kernel of one configuration, recipe (its plain name), output dtype
    (memoized)."""
    b = build(config, recipe, out_dtype, swiglu)
    return kcompile.get_compiled(b)


@functools.cache
def _ctas(config: TileConfig, device_index: int) -> int:
    """One CTA per SM, whole clusters."""
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return sms // config.cluster_m * config.cluster_m


def fast_scale_a(scale_a: torch.Tensor) -> torch.Tensor:
    """Blockwise ``scale_a`` (M, KB) in the kernel's layout: M-major with a 16-byte
    column stride and a 16-byte aligned start (returned as is when it already is)."""
    m, kb = scale_a.shape
    if (scale_a.stride(0) == 1 and scale_a.stride(1) % SCALE_A.row_align == 0
            and scale_a.stride(1) >= m and scale_a.data_ptr() % 16 == 0) or m == 0 or kb == 0:
        return scale_a
    return scale_a.new_empty(kb, SCALE_A.padded_rows(m))[:, :m].t().copy_(scale_a)


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
    out = scale_a.new_empty(kb, SCALE_A.padded_rows(index.shape[0]))[:, :index.shape[0]].t()
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


def _rows(a: torch.Tensor) -> torch.Tensor:
    """``a`` (M, K) as the kernel reads it: row-major, 16-byte row stride and pointer."""
    if (a.stride(-1) == 1 and (a.shape[0] <= 1 or a.stride(0) % ALIGN == 0)
            and a.data_ptr() % ALIGN == 0):
        return a
    return a.contiguous()


def _weights(b: torch.Tensor) -> torch.Tensor:
    """``b`` (E, K, N) as the kernel reads it: K-major (the transposed view of an (E, N, K)
    stack) with 16-byte strides."""
    e, _, n = b.shape
    if (b.stride(1) == 1 and (n <= 1 or b.stride(2) % ALIGN == 0)
            and (e <= 1 or b.stride(0) % ALIGN == 0) and b.data_ptr() % ALIGN == 0):
        return b
    return b.transpose(-2, -1).contiguous().transpose(-2, -1)


def launch(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
           offs: torch.Tensor, out: torch.Tensor, config: TileConfig, recipe: str, *,
           swiglu: bool = False, a_index: torch.Tensor | None = None) -> torch.Tensor:
    """``out[r] = (a[r] @ b[e]) * scales`` for the rows ``r`` of expert ``e`` (``swiglu``:
    ``silu(a @ gate) * (a @ up)``, ``b`` the (E, K, 2I) view of the (E, 2I, H) gate_up
    stack), zeros past ``offs[-1]``; returns ``out``.  Arguments as in the module
    docstring; ``config`` one that ``choose_config`` of :data:`GROUPED_GEMM` (or of
    :data:`GROUPED_GEMM_SWIGLU`) took for them, or a test's."""
    if a_index is not None:
        a, scale_a = _gather(a, scale_a, a_index, recipe)
    scale_a, scale_b = _prepare_scales(scale_a, scale_b, recipe)
    fn = compiled_kernel(config, recipe, out.dtype, swiglu)
    fn(one_row_view(_rows(a)), _weights(b), one_row_view(out), offs, scale_a, scale_b,
       _ctas(config, a.get_device()))
    return out


class ScaledGroupedGemmBackend:
    """The sm_90 backend of ``ts_moe.scaled_grouped_gemm``: tiles from the shapes, or the
    limit the call meets."""

    allocates = False  # it writes the op's output

    def choose_config(self, a, b, scale_a, scale_b, offs, out, a_index, pair):
        num_experts, k, n = b.shape
        if pair not in RECIPES:
            return Declined(f"{pair}: the sm_90 FP8 kernel serves the {', '.join(RECIPES)} "
                            f"pairs")
        if num_experts > MAX_EXPERTS:
            return Declined(f"{num_experts} experts: the sm_90 FP8 kernel takes at most "
                            f"{MAX_EXPERTS}")
        if k % ALIGN:
            return Declined(f"K = {k}: the sm_90 FP8 kernel reads 16-byte rows (K a "
                            f"multiple of 16)")
        return choose_config(num_experts, n, k, out.shape[0], recipe=pair)

    def run(self, a, b, scale_a, scale_b, offs, out, config, pair, *, a_index=None):
        return launch(a, b, scale_a, scale_b, offs, out, config, pair, a_index=a_index)


class ScaledGroupedGemmSwigluBackend:
    """The sm_90 backend of ``ts_moe.scaled_grouped_gemm_swiglu``: the fused kernel where
    its tiles cover I (:func:`swiglu_supported`); otherwise the op runs the path's GEMM to
    fp32 and the activation apart."""

    def choose_config(self, a, gate_up, scale_a, scale_b, offs, out, a_index, pair):
        config = GROUPED_GEMM.choose_config(a, gate_up.transpose(-2, -1), scale_a, scale_b,
                                            offs, out, a_index, pair)
        two_i = gate_up.shape[1]
        if config and not swiglu_supported(two_i, pair, config):
            return Declined(f"I = {two_i // 2}: the fused FP8 SwiGLU kernel needs a multiple "
                            f"of {config.tile_n // 2}"
                            + (f" and of {SCALE_BLOCK}" if pair == "blockwise" else ""))
        return config

    def run(self, a, gate_up, scale_a, scale_b, offs, out, config, pair, *, a_index=None):
        return launch(a, gate_up.transpose(-2, -1), scale_a, scale_b, offs, out, config, pair,
                      swiglu=True, a_index=a_index)


GROUPED_GEMM = ScaledGroupedGemmBackend()
GROUPED_GEMM_SWIGLU = ScaledGroupedGemmSwigluBackend()


KERNELS = Kernels(backends={Op.SCALED_GROUPED_GEMM: GROUPED_GEMM,
                            Op.SCALED_GROUPED_GEMM_SWIGLU: GROUPED_GEMM_SWIGLU},
                  builds=builds, checked=checked, max_experts=MAX_EXPERTS)
