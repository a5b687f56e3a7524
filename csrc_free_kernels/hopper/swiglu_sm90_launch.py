"""Torch side of the elementwise SwiGLU kernels: compile (once per dtype) and
launch :class:`csrc_free_kernels.hopper.swiglu_sm90.SwigluElementwise` on the current stream.

- :data:`SWIGLU_ACTIVATION`: the sm_90 backend of ``ts_moe::swiglu`` and
  ``ts_moe::swiglu_backward`` (``ts_moe.ops.backend.SwigluActivation``);
- :func:`swiglu_forward`, :func:`swiglu_backward`: the module's own entries
  (tests, benchmarks), which check their arguments.
"""

import functools

import cutlass.cute as cute
import torch

from ..common import compile as kcompile
from .swiglu_sm90 import MAX_VECTORS, SwigluElementwise

DTYPES = (torch.bfloat16, torch.float16)  # the kernels' element types


def fake_args(dtype, backward: bool) -> tuple:
    """Symbolic (M, 2I) h, (M, I) out or (M, 2I) dh, (M, I) dy or None, and the
    stream: M, I and every row stride free (strides multiples of 16 bytes, I of
    8 elements), the last dim contiguous; M and the widths shared, so the
    compiled function checks that they agree."""
    vec = 128 // dtype.width
    m = cute.sym_int()
    two_i = cute.sym_int(divisibility=2 * vec)
    one_i = cute.sym_int(divisibility=vec)

    def t(cols):
        return cute.runtime.make_fake_tensor(
            dtype, (m, cols), (cute.sym_int64(divisibility=vec), 1), assumed_align=16)

    if backward:
        return t(two_i), t(two_i), t(one_i), kcompile.fake_stream()
    return t(two_i), t(one_i), None, kcompile.fake_stream()


@functools.cache
def compiled_kernel(dtype: torch.dtype, backward: bool):
    """The compiled kernel for torch ``dtype`` (memoized: it is on every call's path)."""
    key = ("SwigluElementwise", "backward" if backward else "forward", str(dtype), "sm_90a")

    def build():
        return SwigluElementwise(backward), fake_args(kcompile.CUTE_DTYPES[dtype], backward)

    return kcompile.get_compiled(key, build)


def _check_layout(name: str, t: torch.Tensor) -> None:
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor")
    if t.shape[0] > 1 and t.stride(0) * t.element_size() % 16 or t.data_ptr() % 16:
        raise ValueError(f"{name}: rows must start on 16-byte boundaries "
                         f"(stride {t.stride()}, address {t.data_ptr():#x})")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride {t.stride()})")


def _normalized(t: torch.Tensor) -> torch.Tensor:
    """A view the compiled signature accepts: a one-row tensor may carry any row
    stride, so give it a 16-byte one (the kernel never uses it)."""
    if t.shape[0] == 1 and t.stride(0) * t.element_size() % 16:
        return t.as_strided(t.shape, (t.shape[1], 1))
    return t


def _validate(h: torch.Tensor, *others) -> tuple:
    if h.dim() != 2 or h.dtype not in DTYPES:
        raise ValueError(f"h must be (M, 2I) bfloat16 or float16, got {tuple(h.shape)} {h.dtype}")
    m, two_i = h.shape
    inter = two_i // 2
    if two_i % 16:
        raise ValueError(f"I = {two_i / 2} must be a multiple of 8")
    if m * (inter // 8) > MAX_VECTORS:
        raise ValueError(f"M * I = {m * inter} elements is too many for one launch")
    tensors = (("h", h, two_i), *others)
    for name, t, width in tensors:
        if tuple(t.shape) != (m, width) or t.dtype != h.dtype:
            raise ValueError(f"{name}: expected {(m, width)} {h.dtype}, "
                             f"got {tuple(t.shape)} {t.dtype}")
    if m and inter:  # else nothing is launched
        for name, t, _ in tensors:
            _check_layout(name, t)
    return m, inter


class SwigluActivationBackend:
    """The sm_90 backend of the SwiGLU activation ops: 16-bit rows on 16-byte
    boundaries, I a multiple of 8, at most ``MAX_VECTORS`` vectors a launch."""

    def choose_config(self, h, dy) -> torch.dtype | None:
        m, two_i = h.shape
        if (h.dtype not in DTYPES or two_i % 16 or m * (two_i // 16) > MAX_VECTORS
                or h.data_ptr() % 16 or (dy is not None and dy.data_ptr() % 16)):
            return None
        return h.dtype

    def forward(self, h, out, config):
        compiled_kernel(config, False)(_normalized(h), _normalized(out), None)
        return out

    def backward(self, dy, h, dh, config):
        compiled_kernel(config, True)(_normalized(h), _normalized(dh), _normalized(dy))
        return dh


SWIGLU_ACTIVATION = SwigluActivationBackend()


def swiglu_forward(h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = silu(h[:, :I]) * h[:, I:]`` on the current stream; returns ``out``.

    h (M, 2I), out (M, I): bf16 or fp16, rows on 16-byte boundaries, last dim
    contiguous, I a multiple of 8.  No host sync; CUDA-graph capturable."""
    m, inter = _validate(h, ("out", out, h.shape[1] // 2))
    if m == 0 or inter == 0:
        return out
    compiled_kernel(h.dtype, False)(_normalized(h), _normalized(out), None)
    return out


def swiglu_backward(dy: torch.Tensor, h: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """``dh`` (M, 2I), the gradient of :func:`swiglu_forward` at ``h`` for the
    output gradient ``dy`` (M, I); same layout rules; returns ``dh``."""
    m, inter = _validate(h, ("dy", dy, h.shape[1] // 2), ("dh", dh, h.shape[1]))
    if m == 0 or inter == 0:
        return dh
    compiled_kernel(h.dtype, True)(_normalized(h), _normalized(dh), _normalized(dy))
    return dh
