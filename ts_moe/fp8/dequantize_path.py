"""The FP8 fallback where no FP8 kernel serves a call: the weights dequantized to bf16,
then ts_moe's bf16 grouped GEMM (or its fused SwiGLU) - with its memory and traffic
bounded by the rows of the call, not by the weight stack.

- **Only the experts the rows use.**  At most ``U = min(M, E)`` experts can own a row of
  an ``M``-row call, so the used experts are listed on the device, in order, padded with
  empty ones to ``U`` (:func:`used_experts`: no host sync, sizes from shapes only), and
  only their weights are dequantized; ``offs`` is renumbered to them.  At T = 1 of a
  DeepSeek-V3 layer (top-8 of 256) that is 8 experts' weights instead of 256.
- **By chunks of weight rows.**  Each chunk of output columns (N, or I of the SwiGLU
  form's gate and up rows together) holds at most :data:`CHUNK_BYTES` of bf16 weights of
  the ``U`` experts; every chunk is one grouped GEMM over all the rows, into its columns
  of the output.  Many rows and many experts (prefill) read the tokens once per chunk
  instead of holding every expert's bf16 copy at once.
- **A block of rows at a time.**  The fp8 -> fp32 -> bf16 conversion's temporaries stay
  within :data:`STEP_BYTES` and one weight matrix's bf16 bytes, for the weights and the
  tokens alike.

The bf16 GEMM and SwiGLU accumulate in fp32 and round once (the fused SwiGLU where the
output is bf16; otherwise the GEMM to fp32 and the activation, rounded once).
``tests/test_fp8_dequantize_path.py`` measures its transient bytes and bytes moved
against the FP8 weight bytes and the whole-stack dequantization (``bench/memory_meter.py``),
at DeepSeek-V3, Qwen3 and Mixtral sizes on fake tensors.
"""

import torch

from ..reference import segment_ends, swiglu
from .recipes import Recipe
CHUNK_BYTES = 1 << 30   # bf16 weights of one chunk (of the used experts), at most
STEP_BYTES = 32 << 20   # the fp32 temporary of one dequantization step, at most
_ROW_ALIGN = 8          # bf16 elements per 16 bytes: the GEMM's row stride


def used_experts(offs: torch.Tensor, m_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, ends)``: the ``U = min(M, E)`` first experts in expert order of those
    that own rows (then unused ones, empty), and their segment ends as int32 ``offs`` of
    the compacted stack (an unused one ends where the last used one does).  On the
    device, from shapes and ``offs`` alone."""
    num_experts = offs.shape[0]
    ends = segment_ends(offs, m_rows)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    order = torch.arange(num_experts, device=offs.device)
    used = ends > starts
    key = torch.where(used, order, order + num_experts)  # used experts first, in order
    ids = torch.argsort(key)[:min(m_rows, num_experts)]
    compact = torch.where(used[ids], ends[ids], ends[-1])
    return ids, compact.to(torch.int32)


def _dequantize_into(dst: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     block_cols: int | None) -> None:
    """``dst`` <- ``q`` (..., rows, K) e4m3 times ``scale`` in fp32, rounded once:
    ``scale`` (..., rows or 1, K / block_cols or 1) broadcasts over ``q``'s column blocks
    (:func:`_block_scales`); one fp32 temporary of ``q``'s size."""
    t = q.float()
    if block_cols:
        t.unflatten(-1, (-1, block_cols)).mul_(scale.unsqueeze(-1))
    else:
        t.mul_(scale)
    dst.copy_(t)


def _block_scales(scale: torch.Tensor, recipe: str, r0: int, r1: int) -> torch.Tensor:
    """The fp32 scales of rows ``r0:r1`` of an operand of ``recipe``, (..., r1 - r0 or 1,
    column blocks or 1), from its format's block: whatever the recipe, one multiply
    (:func:`_dequantize_into`)."""
    br, bc = Recipe(recipe).format.block
    s = scale.float()
    s = s.unsqueeze(-1) if bc is None else s  # one column block
    s = s.unsqueeze(-2) if br is None else s  # one row block: broadcast over the rows
    if br == 1:
        s = s[..., r0:r1, :]
    elif br is not None:
        s = s[..., torch.arange(r0, r1, device=s.device) // br, :]
    return s


def _rows_per_step(experts: int, rows: int, cols: int) -> int:
    """Rows per dequantization step: its temporaries, the gathered e4m3 rows and their
    fp32 product (5 bytes an element), within :data:`STEP_BYTES` and one matrix's bf16
    bytes (``rows x cols x 2``)."""
    budget = min(STEP_BYTES, rows * cols * 2)
    return max(budget // max(5 * experts * cols, 1), 1)


def dequantize_weight_rows(dst: torch.Tensor, b_stored: torch.Tensor, scale, recipe: str,
                           ids, r0: int, r1: int) -> None:
    """``dst`` (U, r1 - r0, K) bf16 <- rows ``r0:r1`` of the experts ``ids`` of the
    (E, N, K) e4m3 stack, times their scales, a step of rows at a time (K is whole column
    blocks of the recipe's format: the op's checks)."""
    step = _rows_per_step(ids.shape[0], b_stored.shape[1], b_stored.shape[2])
    block_cols = Recipe(recipe).format.block[1]
    for s in range(r0, r1, step):
        e = min(s + step, r1)
        _dequantize_into(dst[:, s - r0:e - r0], b_stored[ids, s:e],
                         _block_scales(scale[ids], recipe, s, e), block_cols)


def dequantize_tokens(a: torch.Tensor, scale_a: torch.Tensor, recipe: str) -> torch.Tensor:
    """``a`` (M, K) e4m3 times its scales in bf16 with 16-byte rows, a step of rows at a
    time."""
    m, k = a.shape
    out = a.new_empty((m, -(-k // _ROW_ALIGN) * _ROW_ALIGN), dtype=torch.bfloat16)[:, :k]
    step = _rows_per_step(1, max(m, 1), k)
    block_cols = Recipe(recipe).format.block[1]
    for s in range(0, m, step):
        e = min(s + step, m)
        _dequantize_into(out[s:e], a[s:e], _block_scales(scale_a, recipe, s, e), block_cols)
    return out


def _chunk_rows(experts: int, rows: int, cols: int, parts: int) -> int:
    """Weight rows per chunk (per part: gate and up are two), a multiple of 16."""
    per_row = max(experts * cols * 2 * parts, 1)
    fit = max(CHUNK_BYTES // per_row // 16 * 16, 16)
    return min(fit, rows)


def gemm(a, scale_a, recipe_a, b_stored, scale_b, recipe_b, offs, out, a_index=None):
    """``out`` (M', N) <- the rows of ``a`` (gathered by ``a_index``) times the
    dequantized (E, N, K) ``b_stored`` of their experts (``offs``), in ``out``'s dtype."""
    m_rows, n = out.shape
    ids, compact = used_experts(offs, m_rows)
    x = dequantize_tokens(a, scale_a, recipe_a)
    k = b_stored.shape[2]
    chunk = _chunk_rows(ids.shape[0], n, k, 1)
    buf = x.new_empty((ids.shape[0], chunk, -(-k // _ROW_ALIGN) * _ROW_ALIGN))
    wide = None if out.dtype == torch.bfloat16 else torch.float32
    for n0 in range(0, n, chunk):
        n1 = min(n0 + chunk, n)
        w = buf[:, :n1 - n0, :k]
        dequantize_weight_rows(w, b_stored, scale_b, recipe_b, ids, n0, n1)
        out[:, n0:n1].copy_(torch.ops.ts_moe.grouped_gemm(
            x, w.transpose(-2, -1), compact, wide, a_index=a_index))
    return out


def gemm_swiglu(a, scale_a, recipe_a, gate_up, scale_b, recipe_b, offs, out, a_index=None):
    """``out`` (M', I) <- ``silu(x @ gate^T) * (x @ up^T)`` per expert, ``gate_up`` the
    (E, 2I, K) e4m3 stack; chunks of I take their gate rows and up rows together."""
    m_rows, inter = out.shape
    ids, compact = used_experts(offs, m_rows)
    x = dequantize_tokens(a, scale_a, recipe_a)
    k = gate_up.shape[2]
    chunk = _chunk_rows(ids.shape[0], inter, k, 2)
    buf = x.new_empty((ids.shape[0], 2 * chunk, -(-k // _ROW_ALIGN) * _ROW_ALIGN))
    for i0 in range(0, inter, chunk):
        c = min(chunk, inter - i0)
        w = buf[:, :2 * c, :k]
        dequantize_weight_rows(w[:, :c], gate_up, scale_b, recipe_b, ids, i0, i0 + c)
        dequantize_weight_rows(w[:, c:], gate_up, scale_b, recipe_b, ids, inter + i0,
                               inter + i0 + c)
        if out.dtype == torch.bfloat16:  # the fused GEMM + activation: one rounding
            h = torch.ops.ts_moe.grouped_gemm_swiglu(x, w, compact, a_index=a_index)
        else:
            h = swiglu(torch.ops.ts_moe.grouped_gemm(x, w.transpose(-2, -1), compact,
                                                     torch.float32, a_index=a_index),
                       out.dtype)
        out[:, i0:i0 + c].copy_(h)
    return out
