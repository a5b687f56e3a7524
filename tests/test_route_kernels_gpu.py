"""GPU (sm_90): the decode block's small kernels against the plain-torch functions.

Routing and slot order must match exactly (the same experts, the same order),
the weights to fp32 rounding; the combine against an fp32 reference per row.
"""

import pytest
import torch

import ts_moe
from ts_moe import ops, routing
from ts_moe.moe import moe_forward_reference

from .conftest import rel_err

pytestmark = pytest.mark.gpu


def rk():
    from csrc_free_kernels import route_sm90
    return route_sm90


CASES = [(1, 8, 2), (2, 8, 2), (16, 8, 2), (64, 8, 2), (1, 128, 8), (16, 128, 8),
         (128, 256, 8), (7, 60, 3), (512, 8, 2), (1024, 16, 1), (3, 256, 1), (5, 33, 33)]


@pytest.mark.parametrize("tokens,experts,top_k", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_route_slots_matches_torch(tokens, experts, top_k, dtype):
    torch.manual_seed(tokens * 1000 + experts)
    logits = torch.randn(tokens, experts, device="cuda", dtype=dtype)
    assert rk().fits(tokens * top_k, experts)
    w, ex, tok, offs, inv = rk().route_slots(logits, top_k)
    w_ref, ex_ref = routing.route(logits, top_k)
    s_ref = routing.sort_slots(ex_ref, experts)
    assert torch.equal(ex, ex_ref)  # bf16 ties too: the lower expert first in both
    assert torch.allclose(w, w_ref, rtol=2e-6, atol=1e-7), (w - w_ref).abs().max()
    assert torch.equal(tok, s_ref.token_index) and torch.equal(offs, s_ref.offs)
    assert torch.equal(inv, s_ref.inverse)


def test_route_slots_ties_and_infinities():
    logits = torch.zeros(4, 8, device="cuda", dtype=torch.bfloat16)
    logits[1, 5] = float("-inf")
    logits[2] = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1], dtype=torch.bfloat16)
    w, ex, *_ = rk().route_slots(logits, 3)
    w_ref, ex_ref = routing.route(logits, 3)
    assert torch.equal(ex, ex_ref)
    assert torch.equal(ex[0], torch.tensor([0, 1, 2], device="cuda"))
    assert torch.equal(ex[2], torch.tensor([1, 2, 4], device="cuda"))
    assert torch.allclose(w, w_ref)


@pytest.mark.parametrize("experts,top_k", [(128, 8), (256, 8), (64, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_route_slots_many_ties(experts, top_k, dtype):
    """Small integer logits, -0.0 among them: most rounds break ties (bf16 takes one
    reduction per round on packed keys, fp16 two)."""
    torch.manual_seed(experts + top_k)
    tokens = 1024 // top_k if top_k > 16 else 64  # up to the kernel's 1024 slots
    assert rk().fits(tokens * top_k, experts)
    logits = torch.randint(-2, 3, (tokens, experts), device="cuda").to(dtype)
    logits[logits == 0] = torch.where(torch.rand_like(logits[logits == 0].float()) < 0.5,
                                      -0.0, 0.0).to(dtype)
    w, ex, tok, offs, inv = rk().route_slots(logits, top_k)
    w_ref, ex_ref = routing.route(logits, top_k)
    assert torch.equal(ex, ex_ref)
    assert torch.allclose(w, w_ref, rtol=2e-6, atol=1e-7), (w - w_ref).abs().max()
    s_ref = routing.sort_slots(ex_ref, experts)
    assert torch.equal(offs, s_ref.offs) and torch.equal(inv, s_ref.inverse)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (40, 16, 4), (256, 256, 4),
                                                   (333, 8, 3), (1024, 1, 1)])
def test_sort_slots_matches_torch(dtype, tokens, experts, top_k):
    ids = torch.randint(0, experts + 3, (tokens, top_k), device="cuda", dtype=dtype)
    ids[0, 0] = experts + 7  # sentinels (expert parallel): after offs[-1]
    got = rk().sort_slots(ids, experts)
    ref = routing.sort_slots(ids, experts)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


@pytest.mark.parametrize("fill", ["one_expert", "negative", "descending"])
def test_sort_slots_extremes(fill):
    """Every slot on one expert (32 chunks of one id), invalid negative ids (sorted
    before expert 0, as torch sorts them), and ids in descending order."""
    tokens, experts, top_k = 512, 64, 2
    if fill == "one_expert":
        ids = torch.full((tokens, top_k), 63, device="cuda", dtype=torch.int64)
    elif fill == "negative":
        ids = torch.randint(-3, experts, (tokens, top_k), device="cuda")
    else:
        ids = torch.arange(tokens * top_k, 0, -1, device="cuda").reshape(tokens, top_k) % 70
    got = rk().sort_slots(ids, experts)
    ref = routing.sort_slots(ids, experts)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 2, 4096), (3, 8, 7168), (300, 2, 64),
                                                  (4096, 8, 2048)])
def test_combine_matches_fp32_reference(tokens, top_k, hidden):
    y = torch.randn(tokens * top_k, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(tokens, top_k, device="cuda")
    inv = torch.randperm(tokens * top_k, device="cuda")
    out = torch.full((tokens, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    rk().weighted_row_sum(y, inv, w, out)
    ref = (y.float()[inv].view(tokens, top_k, hidden) * w.unsqueeze(-1)).sum(1)
    assert rel_err(out, ref) < 1e-2
    per_row = ((out.double() - ref.double()).norm(dim=1) / ref.double().norm(dim=1))
    assert per_row.max() < 1e-2
    assert rel_err(ops.combine(y, w, inv), ref) < 1e-2


def test_gather_rows_zero_rows_out_of_range():
    a = torch.randn(10, 64, device="cuda", dtype=torch.bfloat16)
    idx = torch.tensor([3, -1, 9, 10, 0, 2**31 - 1], device="cuda", dtype=torch.int32)
    out = torch.full((6, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    rk().weighted_row_sum(a, idx, None, out)
    assert torch.equal(out[0], a[3]) and torch.equal(out[2], a[9]) and torch.equal(out[4], a[0])
    assert (out[[1, 3, 5]] == 0).all()


def test_block_is_six_launches_and_graph_capturable():
    """Mixtral-shaped decode block: router GEMM, routing, gather, gate/up + SwiGLU,
    down, combine; no host sync; replayed in a CUDA graph it gives the eager result.
    (Every stage eagerly: the layer's own decode graphs are tested in
    test_decode_graphs_gpu.py.)"""
    torch.manual_seed(0)
    moe = ts_moe.MoE(1024, 512, 8, 2, device="cuda", dtype=torch.bfloat16, decode_graphs=False)
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = moe_forward_reference(x, moe.router, moe.gate_up_proj, moe.down_proj, 2)
        moe(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                eager = moe(x)
                torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) <= 6, [e.name for e in kernels]
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = moe(x)
        g.replay()
        torch.cuda.synchronize()
    assert rel_err(eager, ref) < 1e-2
    assert torch.equal(out, eager)
