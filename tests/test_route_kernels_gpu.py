"""GPU (sm_90): the decode block's small kernels against the plain-torch functions.

Routing and slot order must match exactly (the same experts, the same order),
the weights to fp32 rounding; the combine against an fp32 reference per row.
"""

import pytest
import torch

import ts_moe
from ts_moe import ops, reference
from ts_moe.decode_graphs import graphs
from ts_moe.moe import moe_forward_reference

from .helpers import rel_err

pytestmark = pytest.mark.gpu


def rk():
    from csrc_free_kernels.routing import route_sm90_launch
    return route_sm90_launch


def kc():
    from . import kernel_calls
    return kernel_calls


def rtr():
    from csrc_free_kernels.routing import router_sm90_launch
    return router_sm90_launch


CASES = [(1, 8, 2), (2, 8, 2), (16, 8, 2), (64, 8, 2), (1, 128, 8), (16, 128, 8),
         (128, 256, 8), (7, 60, 3), (512, 8, 2), (1024, 16, 1), (3, 256, 1), (5, 33, 33)]


@pytest.mark.parametrize("tokens,experts,top_k", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_route_slots_matches_torch(tokens, experts, top_k, dtype):
    torch.manual_seed(tokens * 1000 + experts)
    logits = torch.randn(tokens, experts, device="cuda", dtype=dtype)
    assert rk().fits(tokens * top_k, experts)
    w, ex, tok, offs, inv = kc().route_slots(logits, top_k)
    w_ref, ex_ref = reference.route(logits, top_k)
    s_ref = reference.sort_slots(ex_ref, experts)
    assert torch.equal(ex, ex_ref)  # bf16 ties too: the lower expert first in both
    assert torch.allclose(w, w_ref, rtol=2e-6, atol=1e-7), (w - w_ref).abs().max()
    assert torch.equal(tok, s_ref.token_index) and torch.equal(offs, s_ref.offs)
    assert torch.equal(inv, s_ref.inverse)


def test_route_slots_ties_and_infinities():
    logits = torch.zeros(4, 8, device="cuda", dtype=torch.bfloat16)
    logits[1, 5] = float("-inf")
    logits[2] = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1], dtype=torch.bfloat16)
    w, ex, *_ = kc().route_slots(logits, 3)
    w_ref, ex_ref = reference.route(logits, 3)
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
    w, ex, tok, offs, inv = kc().route_slots(logits, top_k)
    w_ref, ex_ref = reference.route(logits, top_k)
    assert torch.equal(ex, ex_ref)
    assert torch.allclose(w, w_ref, rtol=2e-6, atol=1e-7), (w - w_ref).abs().max()
    s_ref = reference.sort_slots(ex_ref, experts)
    assert torch.equal(offs, s_ref.offs) and torch.equal(inv, s_ref.inverse)


@pytest.mark.parametrize("tokens,experts,top_k", CASES + [(5000, 64, 6), (33, 256, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("ties", [False, True])
def test_route_topk_is_route_slots_bit_for_bit(tokens, experts, top_k, dtype, ties):
    """The routing on many CTAs: the experts and weights of the one-CTA kernel,
    bit for bit (it runs the same rounds), outputs poisoned first; past the
    one-CTA kernel's 1024 slots, against ts_moe.route.  Tied logits: small
    integers, -0.0 among them."""
    torch.manual_seed(tokens + experts + top_k + 7 * ties)
    if ties:
        logits = torch.randint(-2, 3, (tokens, experts), device="cuda").to(dtype)
        zero = logits == 0
        logits[zero] = torch.where(torch.rand(int(zero.sum()), device="cuda") < 0.5,
                                   -0.0, 0.0).to(dtype)
    else:
        logits = torch.randn(tokens, experts, device="cuda", dtype=dtype)
    w = torch.full((tokens, top_k), float("nan"), device="cuda")
    ex = torch.full((tokens, top_k), -1, dtype=torch.int64, device="cuda")
    got_w, got_ex = kc().route_topk(logits, top_k)
    w.copy_(got_w), ex.copy_(got_ex)
    w_ref, ex_ref = reference.route(logits, top_k)
    assert torch.equal(ex, ex_ref)
    assert torch.allclose(w, w_ref, rtol=2e-6, atol=1e-7), (w - w_ref).abs().max()
    if rk().fits(tokens * top_k, experts):
        w1, ex1, *_ = kc().route_slots(logits, top_k)
        assert torch.equal(w, w1) and torch.equal(ex, ex1)


def test_route_op_split_is_the_one_cta_result():
    """ops.route_slots with use_router_kernel on a batch it splits (Qwen3-30B-A3B
    T=64, DeepSeek-V3 T=16): all five outputs bit-equal to the switch off; two
    launches, no host sync, captured in a CUDA graph."""
    for tokens, experts in ((64, 128), (16, 256)):
        torch.manual_seed(tokens)
        logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
        assert tokens * rk().lane_width(experts) >= rtr().ROUTE_SPLIT_MIN_WORK
        previous = ops.use_router_kernel(False)
        try:
            w0, ex0, s0 = ops.route_slots(logits, 8)
            ops.use_router_kernel(True)
            ops.route_slots(logits, 8)  # builds or loads the kernels outside the checks
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                    w, ex, slots = ops.route_slots(logits, 8)
                    torch.cuda.synchronize()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            names = [e.name for e in sorted(p.events(), key=lambda e: e.time_range.start)
                     if e.device_type == torch.autograd.DeviceType.CUDA]
            assert len(names) == 2 and "RouteTopK" in names[0], names
            assert "RouteSlots" in names[1], names
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                wg, exg, sg = ops.route_slots(logits, 8)
            g.replay()
            torch.cuda.synchronize()
        finally:
            ops.use_router_kernel(previous)
        for got in ((w, ex, *slots), (wg, exg, *sg)):
            for a, b in zip(got, (w0, ex0, *s0), strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (40, 16, 4), (256, 256, 4),
                                                   (333, 8, 3), (1024, 1, 1)])
def test_sort_slots_matches_torch(dtype, tokens, experts, top_k):
    ids = torch.randint(0, experts + 3, (tokens, top_k), device="cuda", dtype=dtype)
    ids[0, 0] = experts + 7  # sentinels (expert parallel): after offs[-1]
    got = kc().sort_slots(ids, experts)
    ref = reference.sort_slots(ids, experts)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


@pytest.mark.parametrize("fill", ["one_expert", "negative", "descending"])
def test_sort_slots_extremes(fill):
    """Every slot on one expert (32 chunks of one id), negative ids (dropped slots:
    after offs[-1], in slot order, as the reference orders them), and ids in
    descending order."""
    tokens, experts, top_k = 512, 64, 2
    if fill == "one_expert":
        ids = torch.full((tokens, top_k), 63, device="cuda", dtype=torch.int64)
    elif fill == "negative":
        ids = torch.randint(-3, experts, (tokens, top_k), device="cuda")
    else:
        ids = torch.arange(tokens * top_k, 0, -1, device="cuda").reshape(tokens, top_k) % 70
    got = kc().sort_slots(ids, experts)
    ref = reference.sort_slots(ids, experts)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 2, 4096), (3, 8, 7168), (300, 2, 64),
                                                  (4096, 8, 2048)])
def test_combine_matches_fp32_reference(tokens, top_k, hidden):
    y = torch.randn(tokens * top_k, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(tokens, top_k, device="cuda")
    inv = torch.randperm(tokens * top_k, device="cuda")
    out = torch.full((tokens, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    out.copy_(kc().weighted_row_sum(y, inv, w))
    ref = (y.float()[inv].view(tokens, top_k, hidden) * w.unsqueeze(-1)).sum(1)
    assert rel_err(out, ref) < 1e-2
    per_row = ((out.double() - ref.double()).norm(dim=1) / ref.double().norm(dim=1))
    assert per_row.max() < 1e-2
    assert rel_err(ops.combine(y, w, inv), ref) < 1e-2


def test_gather_rows_zero_rows_out_of_range():
    a = torch.randn(10, 64, device="cuda", dtype=torch.bfloat16)
    idx = torch.tensor([3, -1, 9, 10, 0, 2**31 - 1], device="cuda", dtype=torch.int32)
    out = torch.full((6, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    out.copy_(kc().weighted_row_sum(a, idx, None))
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


# ------------------------------------------------------------ router kernel
@pytest.fixture
def fresh_graphs():
    graphs.clear()
    graphs.enable()
    yield
    graphs.clear()


ROUTER_CASES = [(1, 8, 4096), (1, 128, 2048), (1, 256, 7168), (2, 8, 4096), (3, 60, 264),
                (8, 1, 8), (9, 33, 1024), (16, 128, 2048), (16, 256, 7168), (5, 7, 16),
                (64, 128, 2048), (128, 8, 4096), (300, 3, 40)]


def _router_inputs(tokens, experts, hidden, dtype, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(experts, hidden, device="cuda", generator=g).mul_(hidden**-0.5).to(dtype)
    return x, w


def _assert_router_close(got, x, w):
    """Within one output spacing of the exact logits, plus fp32 summation error
    (2**-16 of the sum of |products|), elementwise; and per row and overall
    against float64 by relative error."""
    exact = x.double() @ w.double().t()
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[got.dtype]
    spacing = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2.0**-24))) - mantissa)
    bound = spacing + 2.0**-16 * (x.double().abs() @ w.double().abs().t())
    assert torch.isfinite(got).all()
    assert ((got.double() - exact).abs() <= bound).all(), (got.double() - exact).abs().max()
    assert rel_err(got, exact) < 1e-2
    for row, ref in zip(got, exact):
        assert rel_err(row, ref) < 1e-2


@pytest.mark.parametrize("tokens,experts,hidden", ROUTER_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_logits_matches_float64(tokens, experts, hidden, dtype):
    """Every logit written (the output poisoned first), each within its rounding
    of the exact value; two calls bit-identical (fixed summation order)."""
    x, w = _router_inputs(tokens, experts, hidden, dtype, seed=tokens * 1000 + experts)
    out = torch.full((tokens, experts), float("nan"), device="cuda", dtype=dtype)
    got = out.copy_(kc().router_logits(x, w))
    _assert_router_close(got, x, w)
    assert torch.equal(kc().router_logits(x, w), got)


def test_router_logits_strided_rows_and_fresh_data():
    """Rows with a free 16-byte stride and an offset start (views of wider
    buffers), four draws of fresh data through the same build."""
    for seed in range(4):
        x_buf, w_buf = _router_inputs(6, 40, 1024 + 24, torch.bfloat16, seed=seed)
        x, w = x_buf[:, 8:1032], w_buf[:, 16:1040]
        assert x.stride(0) == 1048 and x.data_ptr() % 16 == 0
        _assert_router_close(kc().router_logits(x, w), x, w)


def test_router_logits_op_takes_the_kernel_only_where_it_applies():
    """With use_router_kernel: a small batch runs the kernel (bit-identical to the
    module entry; x's misaligned rows copied first, so the choice never rests on
    x's strides); a batch past the kernel's read limit, a misaligned weight,
    float32 and a gradient take F.linear; off, F.linear everywhere."""
    x, w = _router_inputs(16, 128, 2048, torch.bfloat16, seed=7)
    previous = ops.use_router_kernel(True)
    try:
        assert torch.equal(ops.router_logits(x, w), kc().router_logits(x, w))
        xl, wl = _router_inputs(128, 128, 2048, torch.bfloat16, seed=8)
        assert rtr().router_read_bytes(128, 128, 2048) > rtr().ROUTER_KERNEL_MAX_READ
        assert torch.equal(ops.router_logits(xl, wl), torch.nn.functional.linear(xl, wl))
        buf = torch.randn(3, 2056, device="cuda", dtype=torch.bfloat16)
        odd = buf[:, 1:2049]  # 2-byte offset: copied to 16-byte rows, then the kernel
        assert torch.equal(ops.router_logits(odd, w), kc().router_logits(odd.contiguous(), w))
        w_odd = torch.randn(128, 2056, device="cuda", dtype=torch.bfloat16)[:, 1:2049]
        assert torch.equal(ops.router_logits(x, w_odd), torch.nn.functional.linear(x, w_odd))
        xf, wf = x.float(), w.float()
        assert torch.equal(ops.router_logits(xf, wf), torch.nn.functional.linear(xf, wf))
        xg = x.clone().requires_grad_()
        out = ops.router_logits(xg, w)
        assert out.grad_fn is not None
        compiled = torch.compile(ops.router_logits, fullgraph=True)(x, w)
        assert torch.equal(compiled, kc().router_logits(x, w))
    finally:
        ops.use_router_kernel(previous)
    assert torch.equal(ops.router_logits(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_block_with_the_router_kernel(tokens, fresh_graphs):
    """Mixtral-shaped block with use_router_kernel: six launches (router kernel,
    routing, gather, gate/up + SwiGLU, down, combine), no host sync, the CUDA-graph
    replay and the layer's own decode graphs equal to the eager stages, the output
    against an fp32 reference routed on the logits the block returned."""
    torch.manual_seed(tokens)
    moe = ts_moe.MoE(1024, 512, 8, 2, device="cuda", dtype=torch.bfloat16, decode_graphs=False)
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    previous = ops.use_router_kernel(True)
    try:
        with torch.no_grad():
            moe(x)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                    eager, logits = moe(x, return_router_logits=True)
                    torch.cuda.synchronize()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            names = [e.name for e in p.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA]
            assert len(names) == 6, names
            assert sum("RouterLogits" in n for n in names) == 1, names
            assert torch.equal(logits, kc().router_logits(x, moe.router))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = moe(x)
            x_fresh = torch.randn_like(x)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)
            ref = moe_forward_reference(x, moe.router, moe.gate_up_proj, moe.down_proj, 2,
                                        router_logits=logits)
            moe.decode_graphs = True
            before = graphs.captures
            for _ in range(3):  # eager, capture, replay
                assert torch.equal(moe(x_fresh), moe_forward_eager(moe, x_fresh))
            assert graphs.captures == before + 1
    finally:
        ops.use_router_kernel(previous)
    assert rel_err(eager, ref) < 1e-2
    for row, ref_row in zip(eager, ref):
        assert rel_err(row, ref_row) < 1e-2


def moe_forward_eager(moe, x):
    return ts_moe.moe_forward(x, moe.router, moe.gate_up_proj, moe.down_proj, moe.top_k,
                              decode_graphs=False)


def test_decode_graphs_key_on_the_router_setting(fresh_graphs):
    """Turning use_router_kernel on or off gives the next decode call a graph of
    its own (the old one would replay the other router); a misaligned x takes
    the router the aligned graph inputs take."""
    torch.manual_seed(3)
    moe = ts_moe.MoE(1024, 512, 8, 2, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16)
    previous = ops.use_router_kernel(False)
    try:
        with torch.no_grad():
            for _ in range(3):
                moe(x)
            before = graphs.captures
            ops.use_router_kernel(True)
            for _ in range(3):
                out = moe(x)
            assert graphs.captures == before + 1
            assert torch.equal(out, moe_forward_eager(moe, x))
            odd = torch.empty(2, 1032, device="cuda", dtype=torch.bfloat16)[:, 4:1028]
            odd.copy_(x)
            assert torch.equal(moe(odd), out) and graphs.captures == before + 1
            assert torch.equal(moe_forward_eager(moe, odd), out)
    finally:
        ops.use_router_kernel(previous)


@pytest.mark.gpu
def test_combine_kernel_reads_an_index_outside_as_a_zero_row():
    """The row kernel and the reference agree on an ``inverse`` with entries outside the
    slots: those contribute nothing."""
    y = torch.randn(6, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(3, 2, device="cuda")
    inverse = torch.tensor([0, -1, 3, 7, 99, 2], device="cuda")
    torch.testing.assert_close(ops.combine(y, w, inverse).float(),
                               reference.combine(y, w, inverse).float(), rtol=0, atol=0)
