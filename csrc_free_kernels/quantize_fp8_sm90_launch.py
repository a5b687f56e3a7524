"""Torch launch code of the activation quantizer (sm_90a): :func:`quantize`.

Arguments are validated by the caller (the op layer); this module allocates the outputs
in the GEMM's layouts and launches :class:`~csrc_free_kernels.quantize_fp8_sm90.QuantizeFp8Sm90`
on the current stream, with no host sync.
"""

import functools

import cutlass
import cutlass.cute as cute
import torch

from . import compile as kcompile
from .quantize_fp8_sm90 import FP8_MAX, GROUP, RECIPES, QuantizeFp8Sm90

def fake_args(recipe: str, dtype) -> tuple:
    """Symbolic (M, K) input and e4m3 output (rows of 16-byte multiples, K a multiple
    of 16), the recipe's scale tensor, the (1,) amax, the CTA cap and the stream."""
    m = cute.sym_int()
    k = cute.sym_int(divisibility=16)
    fake, compact = cute.runtime.make_fake_tensor, cute.runtime.make_fake_compact_tensor
    x = fake(dtype, (m, k), (cute.sym_int64(divisibility=128 // dtype.width), 1),
             assumed_align=16)
    q = fake(cutlass.Float8E4M3FN, (m, k), (cute.sym_int64(divisibility=16), 1),
             assumed_align=16)
    if recipe == "blockwise_1x128":
        scale = fake(cutlass.Float32, (m, cute.sym_int()), (1, cute.sym_int64(divisibility=4)),
                     assumed_align=16)
    elif recipe == "rowwise":
        scale = compact(cutlass.Float32, (m,), assumed_align=4)
    else:
        scale = compact(cutlass.Float32, (1,), assumed_align=4)
    amax = compact(cutlass.Float32, (1,), assumed_align=4)
    return x, q, scale, amax, cutlass.Int32(1), kcompile.fake_stream()


@functools.cache
def compiled_kernel(recipe: str, dtype: torch.dtype):
    """The compiled quantizer for ``recipe`` and input dtype (memoized)."""
    key = ("QuantizeFp8Sm90", recipe, str(dtype), "sm_90a")

    def build():
        return QuantizeFp8Sm90(recipe), fake_args(recipe, kcompile.CUTE_DTYPES[dtype])

    return kcompile.get_compiled(key, build)


@functools.cache
def _max_ctas(device_index: int) -> int:
    """Rowwise CTAs: enough to fill the SMs several times over."""
    return 8 * torch.cuda.get_device_properties(device_index).multi_processor_count


def one_row_view(t: torch.Tensor) -> torch.Tensor:
    """A one-row (M, K) tensor may carry any row stride: the same memory with one the
    compiled signatures accept (16-byte rows; never used to address)."""
    if t.shape[0] == 1 and t.stride(0) * t.element_size() % 16:
        per_row = 16 // t.element_size()
        return t.as_strided(t.shape, (-(-t.shape[1] // per_row) * per_row, t.stride(1)))
    return t


def quantize(x: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scale)`` of ``x`` (M, K) bf16 / fp16 / fp32 on a CUDA device,
    ``stride(-1) == 1``, 16-byte aligned rows, ``K % 16 == 0`` (and ``K % 128 == 0`` for
    ``blockwise_1x128``).  ``scale = amax / 448`` per group, ``x_fp8 = satfinite(x /
    scale)``; a group of zeros gets scale 0 and zeros.

    - ``blockwise_1x128``: scale (M, K/128), M-major: ``stride() == (1, Mp)``, ``Mp`` =
      M rounded up to 4 (a view of a contiguous (K/128, Mp) tensor): the FP8 GEMM's
      fast layout;
    - ``rowwise``: scale (M,); ``tensorwise``: scale a 0-d tensor (the amax comes from
      one device reduction, ``x.abs().amax()``, before the quantizing launch).
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    amax = None
    if recipe == "blockwise_1x128":
        if k % GROUP:
            raise ValueError(f"blockwise_1x128 needs K % {GROUP} == 0, got K = {k}")
        mp = -(-m // 4) * 4
        scale = torch.empty(k // GROUP, mp, dtype=torch.float32, device=x.device)[:, :m].t()
    elif recipe == "rowwise":
        scale = torch.empty(m, dtype=torch.float32, device=x.device)
    else:
        amax = (x.abs().amax().float().reshape(1) if x.numel()
                else torch.zeros(1, dtype=torch.float32, device=x.device))
        scale = (amax / FP8_MAX).reshape(())
    if m == 0 or k == 0:
        if recipe == "rowwise":
            scale.zero_()
        return q, scale
    if k % 16:
        raise ValueError(f"K must be a multiple of 16, got K = {k}")
    fn = compiled_kernel(recipe, x.dtype)
    if recipe == "tensorwise":  # the kernel writes no scale: the amax is its input
        fn(one_row_view(x), one_row_view(q), amax, amax, _max_ctas(x.get_device()))
    else:
        fn(one_row_view(x), one_row_view(q), scale, _unused(x.get_device()),
           _max_ctas(x.get_device()))
    return q, scale


@functools.cache
def _unused(device_index: int) -> torch.Tensor:
    """The amax argument of the recipes that compute their own (never read)."""
    return torch.zeros(1, dtype=torch.float32, device=f"cuda:{device_index}")
