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


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of the references: fp32, fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def grouped_gemm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out[r] = a[r] @ b[e]`` for rows ``r`` of expert ``e``; zeros after the last expert.

    fp32 accumulation, like the kernels.  Reads ``offs`` on the host: a sync
    when it is on the GPU (a reference, not a fast path); a CPU ``offs`` with
    GPU ``a`` and ``b`` needs none, so it can run inside a CUDA-graph capture.
    """
    if b.dim() == 2:
        return grouped_gemm_k_reference(a, b, offs, out_dtype)
    acc = acc_dtype(a.dtype)
    out = torch.zeros(a.shape[0], b.shape[-1], dtype=out_dtype or a.dtype, device=a.device)
    start = 0
    for e, end in enumerate(segment_ends(offs, a.shape[0]).tolist()):
        if end > start:
            out[start:end] = (a[start:end].to(acc) @ b[e].to(acc)).to(out.dtype)
        start = end
    return out


def grouped_gemm_k_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The k-grouped form: a (K, M), b (M, N) -> (E, K, N), ``out[e] = a[:, rows e] @ b[rows e]``.

    The experts split the shared dim M (``offs`` as in :func:`grouped_gemm_reference`);
    an expert without rows gets zeros, rows past ``offs[-1]`` count nowhere.
    This is the weight gradient of the row-grouped form: ``dW = grouped(x.t(), dy)``.
    """
    acc = acc_dtype(a.dtype)
    out = torch.zeros(offs.shape[0], a.shape[0], b.shape[1], dtype=out_dtype or a.dtype,
                      device=a.device)
    start = 0
    for e, end in enumerate(segment_ends(offs, b.shape[0]).tolist()):
        if end > start:
            out[e] = (a[:, start:end].to(acc) @ b[start:end].to(acc)).to(out.dtype)
        start = end
    return out


def swiglu(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``silu(gate) * up`` of ``h = [gate | up]`` (..., 2I), in h's precision
    (fp32 in every caller), rounded once to ``dtype``."""
    inter = h.shape[-1] // 2
    return (F.silu(h[..., :inter]) * h[..., inter:]).to(dtype)


def swiglu_backward(dy: torch.Tensor, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """d/dh of :func:`swiglu`: ``[dy * up * silu'(gate) | dy * silu(gate)]`` (..., 2I).

    ``silu'(g) = s * (1 + g * (1 - s))`` with ``s = sigmoid(g)``; computed in
    fp32 (fp64 for fp64 inputs), rounded once to ``dtype``.
    """
    acc = acc_dtype(h.dtype)
    inter = h.shape[-1] // 2
    gate, up = h[..., :inter].to(acc), h[..., inter:].to(acc)
    dy = dy.to(acc)
    s = torch.sigmoid(gate)
    dh = torch.empty(h.shape, dtype=dtype, device=h.device)
    dh[..., inter:] = dy * gate * s
    dh[..., :inter] = dy * up * s * (1 + gate * (1 - s))
    return dh


def grouped_gemm_swiglu_reference(a: torch.Tensor, gate_up: torch.Tensor,
                                  offs: torch.Tensor) -> torch.Tensor:
    """``silu(a @ gate^T) * (a @ up^T)`` per expert; ``gate_up`` is (E, 2I, H), gate rows first.

    The activation is applied in fp32, before the single rounding to ``a.dtype``.
    """
    acc = acc_dtype(a.dtype)
    inter = gate_up.shape[1] // 2
    out = torch.zeros(a.shape[0], inter, dtype=a.dtype, device=a.device)
    start = 0
    for e, end in enumerate(segment_ends(offs, a.shape[0]).tolist()):
        if end > start:
            out[start:end] = swiglu(a[start:end].to(acc) @ gate_up[e].to(acc).t(), out.dtype)
        start = end
    return out
