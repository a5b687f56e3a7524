"""Plain-torch references of the ops: the CPU kernels and the tests' yardstick."""

import torch
import torch.nn.functional as F


def segment_ends(offs: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The row ends the kernels actually use: ``cummax(clamp(offs, 0, num_rows))``.

    For valid ``offs`` (non-decreasing, ``offs[-1] <= num_rows``) this is
    ``offs`` itself.  For invalid ``offs`` it is the defined, memory-safe
    meaning of the op: a segment never starts before the previous one ends
    and never runs past the last row, so experts never overlap and no row
    outside ``a`` is read or written.
    """
    ends = offs.to(torch.int64).clamp(0, num_rows)
    return torch.cummax(ends, dim=0).values if ends.numel() else ends


def gather_rows(a: torch.Tensor, a_index: torch.Tensor) -> torch.Tensor:
    """``a[a_index]`` on the device, rows padded to 16 bytes; an index outside
    ``[0, M)`` reads as a zero row (no host sync: the range is never checked
    on the host, and no access is out of bounds)."""
    m, k = a.shape
    rows = a_index.shape[0]
    align = 16 // a.element_size()
    pad = -(-k // align) * align
    if m == 0:
        return a.new_zeros((rows, pad))[:, :k]
    index = a_index.long()
    out = a.index_select(0, index.clamp(0, m - 1))
    if pad != k:
        out = a.new_empty((rows, pad))[:, :k].copy_(out)
    return out.masked_fill_(((index < 0) | (index >= m)).unsqueeze(1), 0)


def grouped_gemm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out[r] = a[r] @ b[e]`` for rows ``r`` of expert ``e``; zeros after the last expert.

    fp32 accumulation, like the kernels.  Reads ``offs`` on the host: a sync
    when it is on the GPU (a reference, not a fast path); a CPU ``offs`` with
    GPU ``a`` and ``b`` needs none, so it can run inside a CUDA-graph capture.
    """
    out = torch.zeros(a.shape[0], b.shape[-1], dtype=out_dtype or a.dtype, device=a.device)
    start = 0
    for e, end in enumerate(segment_ends(offs, a.shape[0]).tolist()):
        if end > start:
            out[start:end] = (a[start:end].float() @ b[e].float()).to(out.dtype)
        start = end
    return out


def swiglu(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``silu(gate) * up`` of ``h = [gate | up]`` (..., 2I), in h's precision
    (fp32 in every caller), rounded once to ``dtype``."""
    inter = h.shape[-1] // 2
    return (F.silu(h[..., :inter]) * h[..., inter:]).to(dtype)


def grouped_gemm_swiglu_reference(a: torch.Tensor, gate_up: torch.Tensor,
                                  offs: torch.Tensor) -> torch.Tensor:
    """``silu(a @ gate^T) * (a @ up^T)`` per expert; ``gate_up`` is (E, 2I, H), gate rows first.

    The activation is applied in fp32, before the single rounding to ``a.dtype``.
    """
    inter = gate_up.shape[1] // 2
    out = torch.zeros(a.shape[0], inter, dtype=a.dtype, device=a.device)
    start = 0
    for e, end in enumerate(segment_ends(offs, a.shape[0]).tolist()):
        if end > start:
            out[start:end] = swiglu(a[start:end].float() @ gate_up[e].float().t(), out.dtype)
        start = end
    return out
