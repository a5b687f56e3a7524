"""Routing, permutation and combine: the plain-torch versions (ts_moe.reference)
against loops, and the ops (ts_moe.route, ...), which take them on the CPU."""

import pytest
import torch

import ts_moe
from ts_moe.nvtx import nvtx_range
from ts_moe.reference import combine, permute, route

from .helpers import combine_loop, permute_loop, route_loop


def _logits(tokens, experts, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(tokens, experts, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (37, 8, 2), (200, 16, 4), (64, 4, 1)])
def test_route_matches_loop_reference(dtype, tokens, experts, top_k):
    logits = _logits(tokens, experts, dtype, seed=tokens * experts + top_k)
    weights, ids = route(logits, top_k)
    ref_weights, ref_ids = route_loop(logits, top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (tokens, top_k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(tokens), rtol=1e-6, atol=1e-6)
    assert (weights[:, :-1] >= weights[:, 1:]).all()


def test_route_softmax_over_all_experts_then_renormalise():
    # Mixtral: the top-k weights are the softmax over all E, renormalised over the k
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2)
    p = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights[0], torch.stack([p[0], p[1]]) / (p[0] + p[1]))


def test_route_ties_lower_expert_index_wins():
    # all logits equal: every token takes experts 0..k-1 (torch.topk on CPU takes the highest)
    weights, ids = route(torch.zeros(4096, 8, dtype=torch.bfloat16), 2)
    assert (ids == torch.tensor([0, 1])).all()
    assert (weights == 0.5).all()
    # ties at the top-k boundary: [1, 3, 3, 3, 0] picks 1, then the lowest of the tied 2, 3, 4
    logits = torch.tensor([[0.0, 5.0, 2.0, 2.0, 2.0, -1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 4.0]])
    _, ids = route(logits, 2)
    assert ids.tolist() == [[1, 2], [5, 0]]
    # random ties: the tied maxima of each row are a random subset; the lowest indices win
    g = torch.Generator().manual_seed(1)
    tied = torch.rand(300, 16, generator=g) < 0.4
    tied[:, 7] = True
    logits = torch.where(tied, torch.tensor(2.0), torch.randn(300, 16, generator=g).clamp(max=1.0))
    _, ids = route(logits, 3)
    for t in range(300):
        winners = tied[t].nonzero().flatten()
        assert ids[t, :min(3, len(winners))].tolist() == winners[:3].tolist()
    assert torch.equal(ids, route_loop(logits, 3)[1])


def test_route_ranks_by_logit_where_probabilities_underflow():
    # fp32 softmax underflows to 0 for logits ~100 below the largest: ranked by
    # probability, experts 1 (-inf) and 2 (-200) would tie and 1 would win
    logits = torch.tensor([[0.0, float("-inf"), -200.0, -300.0, -300.0, -150.0]])
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        weights, ids = route(logits.to(dtype), 4)
        assert ids.tolist() == [[0, 5, 2, 3]]
        if dtype == torch.float64:  # an fp64 softmax: tiny, not zero
            assert weights[0, 0] == 1.0 and (weights[0, 1:] > 0).all()
        else:
            assert weights.tolist() == [[1.0, 0.0, 0.0, 0.0]]
        assert torch.equal(ids, route_loop(logits.to(dtype), 4)[1])
    # -0.0 and +0.0 tie: the lower expert first
    _, ids = route(torch.tensor([[-1.0, 0.0, -0.0, 0.0]]), 3)
    assert ids.tolist() == [[1, 2, 3]]
    _, ids = route(torch.tensor([[-1.0, -0.0, 0.0]]), 2)
    assert ids.tolist() == [[1, 2]]


def test_route_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        route(torch.zeros(3, 4), 5)
    with pytest.raises(ValueError, match="top_k"):
        route(torch.zeros(3, 4), 0)
    with pytest.raises(TypeError, match="top_k"):
        route(torch.zeros(3, 4), 2.0)
    with pytest.raises(ValueError, match="logits"):
        route(torch.zeros(4), 1)
    with pytest.raises(TypeError, match="logits"):
        route(torch.zeros(3, 4, dtype=torch.int64), 1)


def _random_ids(tokens, top_k, experts, seed):
    """Distinct expert ids per token, like routing produces."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, experts, generator=g).argsort(-1)[:, :top_k]


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (50, 8, 2), (333, 16, 4), (20, 4, 1)])
def test_permute_counts_offs_order_and_round_trip(tokens, experts, top_k):
    x = torch.randn(tokens, 24, dtype=torch.bfloat16)
    ids = _random_ids(tokens, top_k, experts, seed=tokens)
    d = permute(x, ids, experts)
    counts = torch.bincount(ids.flatten(), minlength=experts)
    assert d.offs.dtype == torch.int32
    assert torch.equal(d.offs, counts.cumsum(0).to(torch.int32))
    assert d.x_sorted.shape == (tokens * top_k, 24)
    # rows in expert order, and (token, k) order within an expert (stable)
    slot_of_row = torch.empty_like(d.inverse).scatter_(0, d.inverse, torch.arange(tokens * top_k))
    expert_of_row = ids.flatten()[slot_of_row]
    assert (expert_of_row[1:] >= expert_of_row[:-1]).all()
    same = expert_of_row[1:] == expert_of_row[:-1]
    assert (slot_of_row[1:][same] > slot_of_row[:-1][same]).all()
    # round trip: slot (t, k) reads token t back
    back = d.x_sorted[d.inverse].view(tokens, top_k, 24)
    assert torch.equal(back, x[:, None].expand(tokens, top_k, 24))
    ref = permute_loop(x, ids, experts)
    for got, want in zip(d, ref, strict=True):
        assert torch.equal(got, want)


def test_permute_all_experts_empty_but_one():
    x = torch.randn(9, 16)
    d = permute(x, torch.full((9, 1), 2), 5)
    assert d.offs.tolist() == [0, 0, 9, 9, 9]
    assert torch.equal(d.x_sorted, x)


def test_permute_drops_ids_past_the_last_expert():
    # expert-parallel sentinels (>= E) land after offs[-1]
    x = torch.randn(4, 8)
    ids = torch.tensor([[0, 3], [1, 0], [3, 1], [0, 2]])
    d = permute(x, ids, 3)
    assert d.offs.tolist() == [3, 5, 6]
    assert torch.equal(d.x_sorted[6:], x[[0, 2]])
    for got, want in zip(d, permute_loop(x, ids, 3), strict=True):
        assert torch.equal(got, want)


def test_permute_zero_tokens():
    d = permute(torch.zeros(0, 8), torch.zeros(0, 2, dtype=torch.int64), 4)
    assert d.x_sorted.shape == (0, 8) and d.offs.tolist() == [0, 0, 0, 0]


def test_permute_rejects_bad_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="experts"):
        permute(x, torch.zeros(4, 2), 4)
    with pytest.raises(ValueError, match="rows"):
        permute(x, torch.zeros(3, 2, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="num_experts"):
        permute(x, torch.zeros(4, 2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="x must be 2-D"):
        permute(x[0], torch.zeros(4, 2, dtype=torch.int64), 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (77, 2), (40, 4), (16, 1)])
def test_combine_matches_per_token_reference_and_is_deterministic(dtype, tokens, top_k):
    experts = 8
    ids = _random_ids(tokens, top_k, experts, seed=tokens + top_k)
    weights, _ = route(_logits(tokens, experts, torch.float32, seed=tokens), top_k)
    d = permute(torch.randn(tokens, 32, dtype=dtype), ids, experts)
    y_sorted = torch.randn(tokens * top_k, 32, dtype=dtype)
    out = combine(y_sorted, weights, d.inverse)
    assert out.dtype == dtype and out.shape == (tokens, 32)
    assert torch.equal(out, combine(y_sorted, weights, d.inverse))
    ref = combine_loop(y_sorted, weights, d.inverse)
    # both sum in fp32 and round once; only the fp32 summation order may differ
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    # against a plain weighted sum in float64
    exact = (y_sorted.double()[d.inverse].view(tokens, top_k, 32)
             * weights.double()[..., None]).sum(1)
    assert ((out.double() - exact).norm() / exact.norm()) < {torch.float32: 1e-6,
                                                              torch.bfloat16: 4e-3}[dtype]


def test_combine_rejects_bad_arguments():
    with pytest.raises(ValueError, match="slots"):
        combine(torch.zeros(5, 8), torch.zeros(2, 2), torch.arange(4))
    with pytest.raises(TypeError, match="inverse"):
        combine(torch.zeros(4, 8), torch.zeros(2, 2), torch.zeros(4))


@pytest.mark.parametrize("fn", [combine, ts_moe.combine, torch.ops.ts_moe.combine],
                         ids=["reference", "public", "op"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.bool],
                         ids=str)
def test_combine_refuses_a_y_sorted_that_is_not_float(fn, dtype):
    """An integer y_sorted came back truncated (0.5 * 1 + 0.26 * 2 as 1)."""
    y = torch.tensor([[1], [2]]).to(dtype)
    with pytest.raises(TypeError, match=rf"y_sorted must be bfloat16, float16, float32 or "
                                        rf"float64, got {dtype}"):
        fn(y, torch.tensor([[0.5, 0.26]]), torch.tensor([0, 1]))


@pytest.mark.parametrize("fn", [combine, ts_moe.combine], ids=["reference", "op"])
def test_combine_in_float64_weighs_in_float64(fn):
    """fp64 inputs sum and weigh in fp64 (fp32 weights failed gradcheck); bf16 and fp32
    inputs weigh in fp32 as before, bit for bit."""
    g = torch.Generator().manual_seed(3)
    y = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    inverse = torch.randperm(6, generator=g)
    exact = _gather_formula(y, w, inverse)
    torch.testing.assert_close(fn(y, w, inverse), exact, rtol=1e-15, atol=1e-15)
    assert torch.autograd.gradcheck(lambda y, w: fn(y, w, inverse), (y, w))
    for dtype in (torch.float32, torch.bfloat16):
        low = y.detach().to(dtype)
        want = (low[inverse].view(3, 2, 5) * w.detach().float()[..., None]).sum(1).to(dtype)
        assert torch.equal(fn(low, w.detach(), inverse), want)


@pytest.mark.parametrize("ops", [False, True], ids=["reference", "ops"])
def test_routing_compiles_fullgraph(ops):
    """No host sync or data-dependent shape: dynamo traces route -> permute ->
    combine whole (an NVTX range inside), the references and the public ops
    (ts_moe.route, .permute, .combine), which on the CPU give the references'
    results bit for bit."""
    fns = (ts_moe.route, ts_moe.permute, ts_moe.combine) if ops else (route, permute, combine)

    def layer(x, logits):
        weights, ids = fns[0](logits, 2)
        d = fns[1](x, ids, logits.shape[1])
        with nvtx_range("combine"):
            return fns[2](d.x_sorted * 2, weights, d.inverse)

    torch._dynamo.reset()
    x, logits = torch.randn(33, 16), torch.randn(33, 8)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    weights, ids = route(logits, 2)
    d = permute(x, ids, 8)
    want = combine(d.x_sorted * 2, weights, d.inverse)
    torch.testing.assert_close(want, 2 * x, rtol=1e-6, atol=1e-6)
    assert torch.equal(layer(x, logits), want)
    assert torch.equal(compiled(x, logits), want)


def _gather_formula(y_sorted, weights, inverse):
    """combine as the plain gather it is, for torch.autograd to differentiate."""
    tokens, top_k = weights.shape
    return (y_sorted[inverse.long()].view(tokens, top_k, -1) * weights[..., None]).sum(1)


@pytest.mark.parametrize("fn", [combine, ts_moe.combine], ids=["reference", "op"])
def test_combine_gradient_is_the_gathers_adjoint_for_any_inverse(fn):
    """An inverse with repeated and missing rows (combine accepts one, though sort_slots
    never makes it): y_sorted's gradient sums the rows read more than once and is zero
    for the rows never read, and the weights' follows, as torch.autograd gives them for
    the gather formula in float64, trial after trial."""
    g = torch.Generator().manual_seed(0)
    repeated = 0
    for trial in range(60):
        tokens, top_k = 1 + trial % 7, 1 + trial % 3
        slots = tokens * top_k
        inverse = torch.randint(0, slots, (slots,), generator=g,
                                dtype=torch.int32 if trial % 2 else torch.int64)
        repeated += inverse.unique().numel() < slots
        y = torch.randn(slots, 8, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.rand(tokens, top_k, generator=g, dtype=torch.float64, requires_grad=True)
        grad_out = torch.randn(tokens, 8, generator=g, dtype=torch.float64)
        want = torch.autograd.grad(_gather_formula(y, w, inverse), (y, w), grad_out)
        got = torch.autograd.grad(fn(y, w, inverse), (y, w), grad_out)
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
    assert repeated >= 30  # most trials repeat (and so miss) rows


def test_combine_gradient_for_any_inverse_compiles():
    inverse = torch.tensor([0, 0, 3, 1, 1, 1])
    y = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    w = torch.rand(3, 2, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(ts_moe.combine, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(y, w, inverse).sum(), (y, w))
    want = torch.autograd.grad(_gather_formula(y, w, inverse).sum(), (y, w))
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
    assert torch.equal(got[0][[2, 4, 5]], torch.zeros(3, 8, dtype=torch.float64))


@pytest.mark.parametrize("fn", [combine, ts_moe.combine], ids=["reference", "op"])
def test_combine_reads_an_index_outside_the_slots_as_a_zero_row(fn):
    """An ``inverse`` entry outside [0, T * top_k) contributes nothing, forward and
    backward, as the sm_90 row kernel reads it (no host check, no error): the same on
    every path, NaN in the row it would clamp to included."""
    y = torch.randn(6, 8, dtype=torch.float64)
    y[5] = float("nan")  # the clamped index of 7 and 99: must not leak
    w = torch.rand(3, 2).double()
    inverse = torch.tensor([0, -1, 3, 7, 99, 2])
    out = fn(y, w, inverse)
    inside = (inverse >= 0) & (inverse < 6)
    want = (torch.where(inside[:, None], y[inverse.clamp(0, 5)], 0).view(3, 2, 8)
            * w[..., None]).sum(1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    yg = y.clone().nan_to_num_().requires_grad_()
    (grad,) = torch.autograd.grad(fn(yg, w, inverse).sum(), (yg,))
    assert torch.equal(grad[[1, 4, 5]], torch.zeros(3, 8, dtype=torch.float64))
    assert torch.equal(grad[0], w[0, 0].expand(8)) and torch.equal(grad[3], w[1, 0].expand(8))


# ------------------------------------------------ devices, counts, dtypes, compile
@pytest.mark.parametrize("moved", ["weights", "inverse", "y_sorted"])
def test_combine_refuses_tensors_on_two_devices(moved):
    """One of the three on ``meta`` among CPU tensors: the CPU kernel read the others and
    returned uninitialized memory; now a ValueError naming the tensor, alike from the
    reference, the public function and the op (whose fake, under torch.compile, checks
    the same)."""
    args = {"y_sorted": torch.randn(8, 16), "weights": torch.rand(4, 2),
            "inverse": torch.arange(8)}
    args[moved] = args[moved].to("meta")
    named, where = ("weights", "cpu") if moved == "y_sorted" else (moved, "meta")
    y_where = "meta" if moved == "y_sorted" else "cpu"
    for fn in (combine, ts_moe.combine, torch.ops.ts_moe.combine):
        with pytest.raises(ValueError, match=rf"^{named} is on {where} but y_sorted is on "
                                             rf"{y_where}$"):
            fn(*args.values())


def test_experts_forward_refuses_routing_on_another_device():
    x, ids = torch.randn(4, 16), torch.tensor([[0, 1]] * 4)
    gate_up, down = torch.randn(4, 32, 16), torch.randn(4, 16, 16)
    for weights, experts, named in ((torch.rand(4, 2, device="meta"), ids, "weights"),
                                    (torch.rand(4, 2), ids.to("meta"), "experts")):
        with pytest.raises(ValueError, match=rf"^{named} is on meta but x is on cpu$"):
            ts_moe.experts_forward(x, experts, weights, gate_up, down)


def test_sort_slots_refuses_more_experts_than_ids_hold():
    """num_experts = 2**40 tried to allocate offs (8 TiB) first; the check bounds it by
    the ids int32 experts hold, without allocating anything."""
    from ts_moe.checks import MAX_EXPERTS, check_experts
    from ts_moe.reference import sort_slots

    experts = torch.zeros(2, 2, dtype=torch.int64)
    for fn in (ts_moe.sort_slots, sort_slots, torch.ops.ts_moe.sort_slots,
               lambda e, n: ts_moe.permute(torch.zeros(2, 8), e, n)):
        with pytest.raises(ValueError, match=r"^num_experts must be at most 2\*\*31 - 1 \(the "
                                             r"ids int32 experts hold\), got 1099511627776$"):
            fn(experts, 2**40)
    assert MAX_EXPERTS == torch.iinfo(torch.int32).max
    check_experts(experts.int(), MAX_EXPERTS)  # the largest count is the caller's to allocate


def _chain(exc: BaseException) -> list:
    found = []
    while exc is not None:
        found.append(exc)
        exc = exc.__cause__ or exc.__context__
    return found


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph breaks"])
@pytest.mark.parametrize("case", ["shape", "device", "dtype", "count"])
def test_a_bad_call_under_compile_is_dynamos_error_holding_the_ops(case, fullgraph):
    """What torch.compile makes of a bad call (README, "Ops"): dynamo raises no error of
    an op's fake kernel as it is, so the call raises its TorchRuntimeError, a
    RuntimeError whose message quotes the op's error and whose chain holds it, the very
    ValueError/TypeError the eager call raises."""
    y, w, inv = torch.randn(8, 16), torch.rand(4, 2), torch.arange(8)
    fn, args = {
        "shape": (ts_moe.combine, (y, torch.rand(3, 2), inv)),
        "device": (ts_moe.combine, (y, w.to("meta"), inv)),
        "dtype": (ts_moe.combine, (y.int(), w, inv)),
        "count": (lambda e: ts_moe.sort_slots(e, 2**40), (torch.zeros(2, 2, dtype=torch.long),)),
    }[case]
    with pytest.raises((ValueError, TypeError)) as eager:
        fn(*args)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError) as compiled:
        torch.compile(fn, fullgraph=fullgraph, backend="eager")(*args)
    assert type(compiled.value).__module__.startswith("torch._dynamo")
    assert repr(eager.value) in str(compiled.value)
    assert [repr(e) for e in _chain(compiled.value) if type(e) is type(eager.value)] == \
        [repr(eager.value)]


def test_a_float64_layer_routes_in_float64():
    """The routing weights keep float64 logits' dtype: a float64 layer is float64-accurate
    through its router (fp32 weights left it at about 1e-8 and failed this gradcheck of
    the router's gradient)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    router = torch.randn(4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    gate_up = torch.randn(4, 16, 8, generator=g, dtype=torch.float64) * 0.3
    down = torch.randn(4, 8, 8, generator=g, dtype=torch.float64) * 0.3
    logits = x.detach() @ router.detach().T
    weights, ids = ts_moe.route(logits, 2)
    assert weights.dtype == torch.float64
    assert ts_moe.route(logits.bfloat16(), 2)[0].dtype == torch.float32
    # the layer against the float64 per-token formula
    p = torch.softmax(logits, -1)
    exact = torch.zeros(3, 8, dtype=torch.float64)
    for t in range(3):
        top = p[t, ids[t]] / p[t, ids[t]].sum()
        for k, e in enumerate(ids[t].tolist()):
            h = gate_up[e] @ x[t].detach()
            exact[t] += top[k] * (down[e] @ (torch.nn.functional.silu(h[:8]) * h[8:]))
    out = ts_moe.moe_forward(x.detach(), router.detach(), gate_up, down, 2, decode_graphs=False)
    assert ((out - exact).norm() / exact.norm()).item() < 1e-13
    # the router's gradient (the composed ops: the experts node's backward runs once)
    assert torch.autograd.gradcheck(
        lambda x, r: ts_moe.moe_forward(x, r, gate_up, down, 2, fused=False,
                                        decode_graphs=False), (x, router))
