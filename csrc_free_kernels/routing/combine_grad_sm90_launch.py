"""Torch side of :mod:`.combine_grad_sm90`: its builds, compiled once each, and the sm_90
backend of the combine's gradient (``ts_moe.ops.backend.CombineGrad``), which launches
the kernel on the current stream.

- :func:`build`, :func:`builds`: one compile per row dtype and ``order`` index type,
  every one a call can reach (all four are checked on the CPU);
- :data:`COMBINE_GRAD`: ``choose_config`` takes 16-bit rows of whole 16-byte vectors
  and an int32/int64 ``order`` on the rows' device; ``run`` allocates ``dy`` and ``dw``
  and launches once; :data:`KERNELS`.
"""

import functools

import cutlass
import torch

from ..common import compile as kcompile
from ..common.family import Build, Kernels, Op
from ..common.kernel_config import Declined
from .combine_grad_sm90 import CombineGrad
from .route_sm90_launch import INDEX, ROWS, fake_compact, fake_rows, rows_ok

_SUFFIX = {torch.bfloat16: "", torch.float16: "_fp16", torch.int64: "", torch.int32: "_i32"}


def fake_args(dtype, index_dtype) -> tuple:
    """dout (T, H), y (M, H), weights (T, k) fp32, order (M,), dy (M, H), dw (M,) fp32."""
    t, m, h, k = kcompile.sym_dims(4)
    return (fake_rows(dtype, t, h), fake_rows(dtype, m, h), fake_compact(cutlass.Float32, t, k),
            fake_compact(index_dtype, m), fake_rows(dtype, m, h), fake_compact(cutlass.Float32, m),
            kcompile.fake_stream())


def build(dtype: torch.dtype, index_dtype: torch.dtype) -> Build:
    """``combine_grad`` of ``dtype`` rows by an ``index_dtype`` order (``_fp16``, ``_i32``)."""
    key = ("CombineGrad", str(dtype), str(index_dtype), "sm_90a")
    name = "combine_grad" + _SUFFIX[dtype] + _SUFFIX[index_dtype]

    def make():
        return CombineGrad(), fake_args(kcompile.CUTE_DTYPES[dtype],
                                        kcompile.CUTE_DTYPES[index_dtype])

    return Build(name, key, make, {"dtype": dtype, "index_dtype": index_dtype})


def builds():
    """Every build a call can reach: the row dtypes by the index types."""
    for dtype in ROWS:
        for index in INDEX:
            yield build(dtype, index)


@functools.cache
def _kernel(dtype: torch.dtype, index_dtype: torch.dtype):
    return kcompile.get_compiled(build(dtype, index_dtype))


class CombineGradBackend:
    """The sm_90 backend of the combine's gradient: one launch of
    :class:`.combine_grad_sm90.CombineGrad` over 16-bit rows of whole 16-byte vectors;
    fp32 weights (others are converted)."""

    def choose_config(self, dout, y_sorted, weights, order) -> str | Declined:
        if not (rows_ok(dout) and rows_ok(y_sorted) and dout.dtype == y_sorted.dtype):
            return Declined("rows the kernel cannot read: it takes 16-bit rows of whole "
                            "16-byte vectors, dout and y_sorted of one dtype")
        if not (order.dtype in INDEX and order.device == y_sorted.device
                and weights.device == y_sorted.device):
            return Declined("an order or weights the kernel does not take")
        return "combine_grad"

    def run(self, dout, y_sorted, weights, order, config):
        rows = y_sorted.shape[0]
        dy = y_sorted.new_empty(rows, y_sorted.shape[1])
        dw = y_sorted.new_empty(rows, dtype=torch.float32)
        if rows and y_sorted.shape[1]:
            _kernel(y_sorted.dtype, order.dtype)(
                dout, y_sorted, weights.float().contiguous(), order.contiguous(), dy, dw)
        elif rows:
            dw.zero_()
        return dy, dw


COMBINE_GRAD = CombineGradBackend()
KERNELS = Kernels(backends={Op.COMBINE_GRAD: COMBINE_GRAD}, builds=builds)
