"""CPU: the FP8 fallback (weights dequantized to bf16, then the bf16 grouped GEMM) is right
on every recipe and routing, dequantizes only the experts the rows use, in chunks, with no
host sync; its transient bytes and bytes moved at DeepSeek-V3, Qwen3 and Mixtral sizes,
measured on fake tensors against the FP8 weight bytes and against dequantizing the whole
stack; and every call it hands torch's FP8 grouped GEMM is one torch accepts."""

import pytest
import torch
from bench import fp8_fallback
from ts_moe.fp8 import backends, dequantize_path
from ts_moe.fp8.recipes import Pair, Recipe
from ts_moe.ops import Op
from ts_moe.ops import scaled as scaled_ops
from ts_moe.ops.paths import Path

from .helpers import on_path, pairs_on_path, rel_err
from .test_fp8_ops import PAIRS, problem, ref64

DEQUANTIZE = on_path(Path.DEQUANTIZE, Op.SCALED_GROUPED_GEMM)
TORCH_SCALED = on_path(Path.TORCH_SCALED, Op.SCALED_GROUPED_GEMM)
DEQUANTIZE_SWIGLU = pairs_on_path(Path.DEQUANTIZE, Op.SCALED_GROUPED_GEMM_SWIGLU,
                                  Op.SCALED_GROUPED_GEMM)

RECIPE_PAIRS = {p: Pair.of(*map(Recipe, p)) for p in PAIRS}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 16 weight rows and steps of a few rows: every loop runs many times."""
    monkeypatch.setattr(dequantize_path, "CHUNK_BYTES", 1)
    monkeypatch.setattr(dequantize_path, "STEP_BYTES", 4096)


@pytest.mark.parametrize("pair", PAIRS, ids=RECIPE_PAIRS.values())
@pytest.mark.parametrize("counts", [(9, 0, 20, 13), (0, 0, 1, 0), (45, 0, 0, 0), (3, 5, 0, 7)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gemm_matches_float64(pair, counts, out_dtype, small_chunks):
    m = sum(counts) + 3  # rows past offs[-1]
    xq, wq, sx, sw, offs = problem(m=m, k=256, n=200, counts=counts, pair=pair)
    out = scaled_ops.run_gemm(DEQUANTIZE, xq, wq.mT, sx, sw, offs, out_dtype,
                              RECIPE_PAIRS[pair])
    ref = ref64(xq, wq, sx, pair[0], sw, pair[1], offs)
    assert out.dtype == out_dtype and out.shape == ref.shape
    assert rel_err(out, ref) <= 1e-2
    for r in range(m):  # per row, and the rows past the last expert exactly zero
        if ref[r].abs().max() > 0:
            assert rel_err(out[r], ref[r]) <= 1e-2, r
        else:
            assert out[r].abs().max() == 0, r


@pytest.mark.parametrize("pair", PAIRS, ids=RECIPE_PAIRS.values())
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_swiglu_and_a_index(pair, out_dtype, small_chunks):
    g = torch.Generator().manual_seed(4)
    counts = (7, 0, 11, 2)
    xq, wq, sx, sw, offs = problem(m=30, k=256, n=2 * 80, counts=counts, pair=pair)
    index = torch.randint(-3, 33, (sum(counts) + 2,), generator=g).to(torch.int32)
    out = scaled_ops.run_swiglu(DEQUANTIZE_SWIGLU, xq, wq, sx, sw, offs, out_dtype,
                                RECIPE_PAIRS[pair], index)
    h = ref64(xq, wq, sx, pair[0], sw, pair[1], offs, a_index=index)
    ref = torch.nn.functional.silu(h[:, :80]) * h[:, 80:]
    assert out.dtype == out_dtype and rel_err(out, ref) <= 1e-2


def test_used_experts_in_order_then_empty():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        e = int(torch.randint(1, 40, (1,), generator=g))
        counts = torch.randint(0, 3, (e,), generator=g) * (torch.rand(e, generator=g) < 0.3)
        m = int(counts.sum()) + int(torch.randint(0, 3, (1,), generator=g))
        offs = counts.cumsum(0).to(torch.int32)
        if m == 0:
            continue
        ids, compact = dequantize_path.used_experts(offs, m)
        used = [i for i in range(e) if counts[i] > 0]
        assert ids.shape[0] == min(m, e)
        assert ids[:len(used)].tolist() == used  # in expert order
        assert compact[:len(used)].tolist() == offs[counts > 0].tolist()
        assert compact[len(used):].tolist() == [int(offs[-1])] * (ids.shape[0] - len(used))


# ------------------------------------------------------------- memory
def _measure(e, n, k, tokens, top_k) -> dict:
    """The fallback's and the whole stack's meters for a blockwise call on fake tensors:
    no memory, and no value can be read on the host (a sync would raise there)."""
    return fp8_fallback.measure("blockwise", e, n, k, tokens * top_k)


@pytest.mark.parametrize("model, e, n, k, top_k", [
    ("deepseek-v3 gate_up", 256, 2 * 2048, 7168, 8),
    ("qwen3-30b-a3b gate_up", 128, 2 * 768, 2048, 8),
    ("mixtral-8x7b gate_up", 8, 2 * 14336, 4096, 2),
])
def test_decode_transient_is_the_routed_experts_share(model, e, n, k, top_k):
    """At T = 1 the fallback holds at most top_k / E of what dequantizing the whole stack
    held, plus one expert's bf16 matrix, and moves a fraction of its bytes."""
    got = _measure(e, n, k, 1, top_k)
    new, old = got["fallback_transient_bytes"], got["whole_stack_transient_bytes"]
    assert new <= top_k / e * old + n * k * 2, (new, old)  # + one expert's bf16 matrix
    assert got["fallback_moved_bytes"] < got["whole_stack_moved_bytes"] / 4
    assert got["fp8_weight_bytes"] == e * n * k
    print(f"{model} T=1: transient {new / 1e9:.3f} GB (whole stack {old / 1e9:.2f}), "
          f"moved {got['fallback_moved_bytes'] / 1e9:.2f} GB (whole stack "
          f"{got['whole_stack_moved_bytes'] / 1e9:.1f}), FP8 weights {e * n * k / 1e9:.2f} GB")


def test_prefill_transient_is_bounded_by_the_chunk():
    """DeepSeek-V3 at T = 4096 (every expert used): the bf16 weights stay within one
    chunk, beside the tokens' bf16 copy and a step's temporaries."""
    e, n, k, top_k, tokens = 256, 4096, 7168, 8, 4096
    got = _measure(e, n, k, tokens, top_k)
    new = got["fallback_transient_bytes"]
    tokens_bf16 = tokens * top_k * k * 2
    out = tokens * top_k * n * 2
    assert new <= dequantize_path.CHUNK_BYTES + tokens_bf16 + 2 * out + n * k * 2
    assert new < got["whole_stack_transient_bytes"] / 5
    assert got["fallback_moved_bytes"] < got["whole_stack_moved_bytes"]


# ---------------------------------------------------- torch's FP8 GEMM
def test_torch_gets_rows_and_weights_it_accepts():
    """A one-row ``a`` of stride (1, 1) and a weight whose column stride is below K pass
    torch's checks (its meta kernel) after :func:`torch_rows` / :func:`torch_weights`."""
    e4, k, n, e = torch.float8_e4m3fn, 256, 128, 4
    sb, offs = torch.empty(e, n, device="meta"), torch.empty(e, dtype=torch.int32, device="meta")
    one_row = torch.empty_strided((1, k), (1, 1), device="meta", dtype=e4)
    narrow = torch.empty_strided((e, k, n), (k * n, 1, 64), device="meta", dtype=e4)
    rows8 = torch.empty(8, k, device="meta", dtype=e4)
    weights = torch.empty(e, n, k, device="meta", dtype=e4).mT
    for a, b in ((one_row, weights), (rows8, narrow)):
        with pytest.raises(RuntimeError):
            torch._scaled_grouped_mm(a, b, torch.empty(a.shape[0], device="meta"), sb,
                                     offs=offs, out_dtype=torch.bfloat16)
        out = torch._scaled_grouped_mm(backends.torch_rows(a), backends.torch_weights(b),
                                       torch.empty(a.shape[0], device="meta"), sb, offs=offs,
                                       out_dtype=torch.bfloat16)
        assert out.shape == (a.shape[0], n)
    assert backends.torch_rows(rows8) is rows8 and backends.torch_weights(weights) is weights


def test_torch_path_names_the_recipes(monkeypatch):
    """Where ``F.scaled_grouped_mm`` exists it is called with RowWise named for both
    operands (a newer torch infers recipes from scale shapes: M == E is ambiguous)."""
    if not hasattr(torch.nn.functional, "scaled_grouped_mm"):
        pytest.skip("this torch has no torch.nn.functional.scaled_grouped_mm")
    calls = []

    def fake(a, b, sa, ra, sb, rb, offs=None, output_dtype=None):
        calls.append((ra, rb, output_dtype, a.stride(), b.stride()))
        return torch.zeros(a.shape[0], b.shape[2], dtype=torch.bfloat16)

    monkeypatch.setattr(torch.nn.functional, "scaled_grouped_mm", fake)
    xq, wq, sx, sw, offs = problem(m=8, k=256, n=128, counts=(4, 4, 0, 0), pair=PAIRS[1])
    scaled_ops.run_gemm(TORCH_SCALED, xq[:1], wq.mT, sx[:1], sw, offs.clamp(max=1),
                        torch.bfloat16, Pair.ROWWISE)
    ((ra, rb, dtype, a_stride, b_stride),) = calls
    rowwise = torch.nn.functional.ScalingType.RowWise
    assert ra == rb == rowwise and dtype == torch.bfloat16
    assert a_stride[0] % 16 == 0 and a_stride[0] >= 256 and b_stride[1] == 1


def test_swiglu_docstring_names_the_torch_path_rounding():
    doc = scaled_ops.scaled_grouped_gemm_swiglu.__doc__
    assert "two roundings" in doc and "_scaled_grouped_mm" in doc


def test_the_output_is_allocated_only_for_a_backend_that_writes_it(monkeypatch):
    """torch's FP8 GEMM returns its own output: the op allocates none beside it; the
    fallback writes into the one the op allocates."""
    allocated = []
    real = scaled_ops.empty_output
    monkeypatch.setattr(scaled_ops, "empty_output",
                        lambda *args: allocated.append(args[1:]) or real(*args))
    monkeypatch.setattr(torch.nn.functional, "scaled_grouped_mm",
                        lambda a, b, *_, **__: torch.zeros(a.shape[0], b.shape[2],
                                                           dtype=torch.bfloat16), raising=False)
    monkeypatch.setattr(torch, "_scaled_grouped_mm",
                        lambda a, b, *_, **__: torch.zeros(a.shape[0], b.shape[2],
                                                           dtype=torch.bfloat16), raising=False)
    xq, wq, sx, sw, offs = problem(m=8, k=256, n=128, counts=(4, 4, 0, 0), pair=PAIRS[1])
    scaled_ops.run_gemm(TORCH_SCALED, xq, wq.mT, sx, sw, offs, torch.bfloat16, Pair.ROWWISE)
    assert allocated == []
    scaled_ops.run_gemm(DEQUANTIZE, xq, wq.mT, sx, sw, offs, torch.bfloat16, Pair.ROWWISE)
    assert allocated == [(8, 128, torch.bfloat16)]
