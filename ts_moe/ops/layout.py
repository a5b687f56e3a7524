"""The memory layouts of the ops: what they allocate, and the views they hand
their backends.

An op's outputs have their rows padded to 16 bytes, as torch's grouped_mm
allocates them (the fake kernels declare these strides).  A backend receives
its operands in one layout, whatever strides the caller passed (within what
:mod:`ts_moe.checks` accepts): a unit stride on one dim, every other stride a
positive multiple of 16 bytes (:func:`tma_view`, the layout of a TMA
descriptor and of torch's grouped_mm).
"""

import torch

from ..checks import ALIGN_BYTES, layout_ok


def row_pad(n, dtype: torch.dtype):
    """``n`` rounded up to whole 16-byte vectors of ``dtype`` (SymInt-safe)."""
    align = ALIGN_BYTES // dtype.itemsize
    return (n + align - 1) // align * align


def empty_output(like: torch.Tensor, m: int, n: int, dtype: torch.dtype,
                 experts: int | None = None) -> torch.Tensor:
    """(m, n), or (experts, m, n), with rows padded to 16 bytes, as torch's
    grouped_mm allocates them; the padding is real memory: the kernels store
    whole 16-byte vectors."""
    pad = row_pad(n, dtype)
    if pad == n and experts is None and dtype == like.dtype:
        return like.new_empty(m, n)  # the cheapest call (no dtype argument): the hot path's
    lead = (m,) if experts is None else (experts, m)
    if pad == n:
        return like.new_empty((*lead, n), dtype=dtype)
    return like.new_empty((*lead, pad), dtype=dtype)[..., :n]


def padded_strides(shape, major: int, align: int) -> list[int]:
    """Strides of a dense tensor of ``shape``, stride 1 on ``major``, its rows padded."""
    order = [major] + [d for d in reversed(range(len(shape))) if d != major]
    strides, step = [0] * len(shape), 1
    for i, d in enumerate(order):
        strides[d] = step
        step *= -(-shape[d] // align) * align if i == 0 else shape[d]
    return strides


def tma_view(t: torch.Tensor, major: int) -> torch.Tensor:
    """``t`` as a TMA descriptor (and torch's grouped_mm) reads it: stride 1 on
    ``major``, positive 16-byte aligned strides elsewhere.  A validated tensor
    differs from that only in strides that are never used (size-1 dims:
    replaced), in broadcast dims (stride 0) or in its major dim (an M-major
    ``a`` for the K-major kernels): those are copied, rows padded."""
    shape = t.shape
    natural = padded_strides(shape, major, ALIGN_BYTES // t.element_size())
    stride = [natural[d] if size == 1 else s for d, (size, s) in enumerate(zip(shape, t.stride()))]
    if stride[major] != 1 or any(s == 0 and size > 1 for size, s in zip(shape, stride)):
        return torch.empty_strided(shape, natural, dtype=t.dtype, device=t.device).copy_(t)
    return t if tuple(stride) == t.stride() else t.as_strided(shape, stride)


def one_segment(b: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b, offs)`` of a row-grouped call, where ``b`` (E, K, N) broadcasts one matrix
    over its experts (stride 0 on E, as ``w.expand(E, K, N)``): that matrix and one
    segment, the rows up to the call's last segment end (``offs.amax()``: the backends'
    segment ends are ``cummax(clamp(offs, 0, M))``), the same product for every row.
    :func:`tma_view` would otherwise copy the broadcast whole (E matrices, however few
    rows the call has).  Any other ``b`` as it is."""
    if b.shape[0] > 1 and b.stride(0) == 0:
        return b[:1], offs.amax(0, keepdim=True)
    return b, offs


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (M, K) K-major with 16-byte row strides and an aligned base: the
    rows a gather reads (an ``a`` with ``a_index``, whose strides the checks
    leave free), copied where they are not."""
    t = tma_view(t, 1)
    if t.stride(0) * t.element_size() % ALIGN_BYTES or t.data_ptr() % ALIGN_BYTES:
        natural = padded_strides(t.shape, 1, ALIGN_BYTES // t.element_size())
        return torch.empty_strided(t.shape, natural, dtype=t.dtype, device=t.device).copy_(t)
    return t


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (M, N) with a unit stride on N and 16-byte rows (copied if not)."""
    return tma_view(t, t.dim() - 1)


def operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a gradient: contiguous, expanded, ...) as the ops take it: as is
    when its layout passes the checks, else a row-major copy with 16-byte rows."""
    if layout_ok(t):
        return t
    strides = padded_strides(t.shape, t.dim() - 1, ALIGN_BYTES // t.element_size())
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)
