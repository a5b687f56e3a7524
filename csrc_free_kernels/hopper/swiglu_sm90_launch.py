"""Torch side of the elementwise SwiGLU kernels: their builds (forward and gradient per
16-bit type, all checked on the CPU), compiled once each, and the backend that launches
:class:`csrc_free_kernels.hopper.swiglu_sm90.SwigluElementwise` on the current stream:
:data:`SWIGLU_ACTIVATION`, of ``ts_moe::swiglu`` and ``ts_moe::swiglu_backward``
(``ts_moe.ops.backend.SwigluActivation``); :data:`KERNELS`.
"""

import functools

import cutlass.cute as cute
import torch

from ..common import compile as kcompile
from ..common.family import Build, Kernels, Op
from ..common.kernel_config import Declined
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


def build(dtype: torch.dtype, backward: bool) -> Build:
    """The activation (``swiglu_ew_fwd``) or its gradient (``swiglu_ew_bwd``) in
    ``dtype`` (``_fp16``)."""
    key = ("SwigluElementwise", "backward" if backward else "forward", str(dtype), "sm_90a")
    name = ("swiglu_ew_bwd" if backward else "swiglu_ew_fwd") + (
        "_fp16" if dtype == torch.float16 else "")
    return Build(name, key,
                 lambda: (SwigluElementwise(backward),
                          fake_args(kcompile.CUTE_DTYPES[dtype], backward)),
                 {"dtype": dtype, "backward": backward})


def builds():
    """Every build a call can reach: forward and gradient per 16-bit type."""
    for dtype in DTYPES:
        for backward in (False, True):
            yield build(dtype, backward)


@functools.cache
def compiled_kernel(dtype: torch.dtype, backward: bool):
    """The compiled kernel for torch ``dtype`` (memoized: it is on every call's path)."""
    b = build(dtype, backward)
    return kcompile.get_compiled(b)


def _normalized(t: torch.Tensor) -> torch.Tensor:
    """A view the compiled signature accepts: a one-row tensor may carry any row
    stride, so give it a 16-byte one (the kernel never uses it)."""
    if t.shape[0] == 1 and t.stride(0) * t.element_size() % 16:
        return t.as_strided(t.shape, (t.shape[1], 1))
    return t


class SwigluActivationBackend:
    """The sm_90 backend of the SwiGLU activation ops: 16-bit rows on 16-byte
    boundaries, I a multiple of 8, at most ``MAX_VECTORS`` vectors a launch."""

    def choose_config(self, h, dy) -> torch.dtype | Declined:
        m, two_i = h.shape
        if h.dtype not in DTYPES:
            return Declined(f"{h.dtype} h: the activation kernel takes bf16 or fp16")
        if two_i % 16 or m * (two_i // 16) > MAX_VECTORS:
            return Declined(f"h {tuple(h.shape)}: the activation kernel needs I a multiple "
                            f"of 8 and at most {MAX_VECTORS} vectors")
        if h.data_ptr() % 16 or (dy is not None and dy.data_ptr() % 16):
            return Declined("h or dy not 16-byte aligned: the activation kernel reads "
                            "16-byte vectors")
        return h.dtype

    def forward(self, h, out, config):
        compiled_kernel(config, False)(_normalized(h), _normalized(out), None)
        return out

    def backward(self, dy, h, dh, config):
        compiled_kernel(config, True)(_normalized(h), _normalized(dh), _normalized(dy))
        return dh


SWIGLU_ACTIVATION = SwigluActivationBackend()


KERNELS = Kernels(backends={Op.SWIGLU_ACTIVATION: SWIGLU_ACTIVATION}, builds=builds)
