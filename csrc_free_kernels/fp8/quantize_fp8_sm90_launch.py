"""Torch launch code of the activation quantizer (sm_90a).

- :data:`QUANTIZE`: the sm_90 backend of the FP8 quantizer family
  (``ts_moe.ops.backend.QuantizeFp8``): ``choose_config`` takes a 2-D activation of
  bf16, fp16 or fp32 with rows to quantize, K a multiple of 16 (of 128 for
  ``blockwise_1x128``), or answers a :class:`~csrc_free_kernels.common.kernel_config.Declined` naming what the
  call lacks; ``run`` is :func:`quantize`;
- :func:`quantize`: the one entry point, on arguments the op layer validated and this
  backend took: it allocates the outputs in the GEMM's layouts and launches
  :class:`~csrc_free_kernels.fp8.quantize_fp8_sm90.QuantizeFp8Sm90` on the current stream,
  with no host sync.  It checks nothing;
- :func:`build`, :func:`builds`: one compile, and every one a call can reach (each
  recipe x input type, all checked on the CPU); :data:`KERNELS`.

The recipe arrives as its plain name (:data:`~.quantize_fp8_sm90.RECIPES`): ts_moe's
parsed ``Recipe`` is a ``str`` enum of these names, handed down as it is.
"""

import functools

import cutlass
import cutlass.cute as cute
import torch

from ..common import compile as kcompile
from ..common.family import Build, Kernels, Op
from ..common.formats import FORMATS
from ..common.kernel_config import Declined
from .quantize_fp8_sm90 import GROUP, RECIPES, QuantizeFp8Sm90

ALIGN = 16  # bytes: the kernel's row strides and pointers
SCALE_A = FORMATS["blockwise_1x128"]  # the blockwise scales' layout (M-major, rows padded)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

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
        scale = fake(cutlass.Float32, (m, cute.sym_int()),
                     (1, cute.sym_int64(divisibility=SCALE_A.row_align)), assumed_align=16)
    elif recipe == "rowwise":
        scale = compact(cutlass.Float32, (m,), assumed_align=4)
    else:
        scale = compact(cutlass.Float32, (1,), assumed_align=4)
    amax = compact(cutlass.Float32, (1,), assumed_align=4)
    return x, q, scale, amax, cutlass.Int32(1), kcompile.fake_stream()


def build(recipe: str, dtype: torch.dtype) -> Build:
    """The quantizer of ``dtype`` activations for ``recipe``: ``quantize_<recipe>_<dtype>``."""
    recipe = str(recipe)
    key = ("QuantizeFp8Sm90", recipe, str(dtype), "sm_90a")
    return Build(f"quantize_{recipe}_{str(dtype).split('.')[-1]}", key,
                 lambda: (QuantizeFp8Sm90(recipe), fake_args(recipe, kcompile.CUTE_DTYPES[dtype])),
                 {"recipe": recipe, "dtype": dtype})


def builds():
    """Every build a call can reach: each activation recipe x input type."""
    for recipe in RECIPES:
        for dtype in _DTYPES:
            yield build(recipe, dtype)


@functools.cache
def compiled_kernel(recipe: str, dtype: torch.dtype):
    """The compiled quantizer for ``recipe`` (its plain name) and input dtype (memoized)."""
    b = build(recipe, dtype)
    return kcompile.get_compiled(b)


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
    """``(x_fp8, scale)`` of ``x`` (M, K) bf16 / fp16 / fp32 on a CUDA device, M and K
    positive, ``K % 16 == 0`` (and ``K % 128 == 0`` for ``blockwise_1x128``): what
    :data:`QUANTIZE` takes.  ``scale = amax / 448`` per group, ``x_fp8 = satfinite(x /
    scale)``; a group of zeros gets scale 0 and zeros.  ``x`` is read row-major with a
    16-byte row stride and pointer (another layout is copied into that one).

    - ``blockwise_1x128``: scale (M, K/128), M-major: ``stride() == (1, Mp)``, ``Mp`` =
      M rounded up to 4 (a view of a contiguous (K/128, Mp) tensor): the FP8 GEMM's
      fast layout;
    - ``rowwise``: scale (M,); ``tensorwise``: scale a 0-d tensor (the amax comes from
      one device reduction, ``x.abs().amax()``, before the quantizing launch; the kernel
      writes the scale it divides by).
    """
    x = _rows(x)
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    fn = compiled_kernel(recipe, x.dtype)
    if recipe == "tensorwise":  # the amax is the kernel's input, the scale its output
        amax = x.abs().amax().float().reshape(1)
        scale = torch.empty(1, dtype=torch.float32, device=x.device)
        fn(one_row_view(x), one_row_view(q), scale, amax, _max_ctas(x.get_device()))
        return q, scale.reshape(())
    if recipe == "blockwise_1x128":
        scale = torch.empty(k // GROUP, SCALE_A.padded_rows(m), dtype=torch.float32,
                            device=x.device)[:, :m].t()
    else:
        scale = torch.empty(m, dtype=torch.float32, device=x.device)
    fn(one_row_view(x), one_row_view(q), scale, _unused(x.get_device()),
       _max_ctas(x.get_device()))
    return q, scale


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` row-major with a 16-byte row stride and pointer; a contiguous copy otherwise."""
    rows_ok = x.shape[0] <= 1 or (x.stride(0) * x.element_size()) % ALIGN == 0
    if x.stride(-1) == 1 and rows_ok and x.data_ptr() % ALIGN == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


class QuantizeBackend:
    """The sm_90 backend of ``ts_moe.quantize_fp8``: 2-D activations (module docstring)."""

    def choose_config(self, x, recipe):
        if recipe not in RECIPES:
            return Declined(f"{recipe}: the quantize kernel serves the activation recipes "
                            f"({', '.join(RECIPES)})")
        if x.dim() != 2 or x.dtype not in _DTYPES:
            return Declined(f"a {x.dim()}-D {x.dtype} x: the quantize kernel takes a 2-D "
                            f"bf16, fp16 or fp32 activation")
        m, k = x.shape
        if m == 0 or k == 0:
            return Declined(f"x {tuple(x.shape)}: nothing to quantize")
        if k % ALIGN or (recipe == "blockwise_1x128" and k % GROUP):
            return Declined(f"K = {k}: the quantize kernel needs a multiple of "
                            f"{GROUP if recipe == 'blockwise_1x128' else ALIGN}")
        return recipe

    def run(self, x, recipe, config):
        return quantize(x, recipe)


QUANTIZE = QuantizeBackend()


@functools.cache
def _unused(device_index: int) -> torch.Tensor:
    """The amax argument of the recipes that compute their own (never read)."""
    return torch.zeros(1, dtype=torch.float32, device=f"cuda:{device_index}")


KERNELS = Kernels(backends={Op.QUANTIZE_FP8: QUANTIZE}, builds=builds)
