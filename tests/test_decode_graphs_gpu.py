"""GPU: eager decode calls replaying CUDA graphs of themselves (ts_moe.decode_graphs).

A replay must give what the same call gives with every stage run eagerly, bit
for bit, on fresh data at every call (the inputs are copied in), see weights
updated in place, take new weight tensors as a new signature, return fresh
tensors, never sync with the host, and step aside where it cannot be exact
(gradients, large batches, a capture that fails).
"""

import pytest
import torch

import ts_moe
from ts_moe.decode_graphs import DecodeGraphs, graphs
from ts_moe.moe import moe_forward_reference

from .helpers import rel_err

pytestmark = pytest.mark.gpu

H, I, E, K = 1024, 512, 8, 2


def _moe(seed=0, **kwargs):
    torch.manual_seed(seed)
    return ts_moe.MoE(H, I, E, K, device="cuda", dtype=torch.bfloat16, **kwargs)


def _eager(moe, x, **kwargs):
    return ts_moe.moe_forward(x, moe.router, moe.gate_up_proj, moe.down_proj, moe.top_k,
                              decode_graphs=False, **kwargs)


@pytest.fixture(autouse=True)
def fresh_graphs():
    graphs.clear()
    graphs.enable()
    yield
    graphs.clear()


@pytest.mark.parametrize("tokens", [1, 3, 16, 64, 128])
def test_replay_is_the_eager_call_on_fresh_data(tokens):
    moe = _moe()
    outs = []
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
            got = moe(x)
            outs.append(got)
            assert torch.equal(got, _eager(moe, x)), (tokens, step)
            if step == 0:
                assert rel_err(got, moe_forward_reference(x, moe.router, moe.gate_up_proj,
                                                          moe.down_proj, K)) < 1e-2
    assert graphs.captures == 1 and len(graphs) == 1
    assert len({o.data_ptr() for o in outs}) == len(outs)  # fresh tensors, no aliasing


def test_batched_input_shape_and_router_logits():
    moe = _moe()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 3, H, device="cuda", dtype=torch.bfloat16)
            out, logits = moe(x, return_router_logits=True)
            ref_out, ref_logits = _eager(moe, x, return_router_logits=True)
            assert out.shape == x.shape and torch.equal(out, ref_out)
            assert torch.equal(logits, ref_logits)
    assert graphs.captures == 1


def test_weights_in_place_and_new_weight_tensors():
    moe = _moe()
    x = torch.randn(4, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        moe(x), moe(x)
        moe.down_proj.mul_(-2.0)  # read in place by the graph
        assert torch.equal(moe(x), _eager(moe, x))
        assert graphs.captures == 1
        moe.gate_up_proj = torch.nn.Parameter(moe.gate_up_proj * 0.5)  # a new address
        first = moe(x)  # a new signature: eager, then captured
        assert torch.equal(first, _eager(moe, x)) and torch.equal(moe(x), first)
    assert graphs.captures == 2


def test_outputs_are_not_overwritten_by_the_next_replay():
    moe = _moe()
    with torch.no_grad():
        xs = [torch.randn(2, H, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        outs = [moe(x) for x in xs]
        for x, out in zip(xs, outs):
            assert torch.equal(out, _eager(moe, x))


def test_gradients_run_eagerly():
    moe = _moe()
    x = torch.randn(3, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        out = moe(x)
        out.float().square().sum().backward()
    assert graphs.captures == 0 and x.grad is not None and moe.gate_up_proj.grad is not None


def test_too_many_tokens_and_the_switches_run_eagerly():
    moe = _moe()
    big = torch.randn(graphs.max_tokens + 1, H, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            moe(big)
            ts_moe.moe_forward(x, moe.router, moe.gate_up_proj, moe.down_proj, K,
                               decode_graphs=False)
        assert graphs.captures == 0
        graphs.disable()
        for _ in range(3):
            assert torch.equal(moe(x), _eager(moe, x))
        assert graphs.captures == 0


def test_inference_mode_and_no_grad_are_separate_signatures():
    moe = _moe()
    x = torch.randn(2, H, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        a = [moe(x) for _ in range(3)]
    with torch.no_grad():
        b = [moe(x) for _ in range(3)]
    assert graphs.captures == 2
    for t in a + b:
        assert torch.equal(t, a[0])


def test_other_stream_and_no_host_sync():
    moe = _moe()
    x = torch.randn(5, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = _eager(moe, x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            on_default = [moe(x) for _ in range(3)]  # eager, capture + replay, replay
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                on_side = [moe(x) for _ in range(3)]
            torch.cuda.current_stream().wait_stream(side)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert graphs.captures == 2
    for t in on_default + on_side:
        assert torch.equal(t, ref)


def test_inside_a_user_capture_the_call_is_captured_eagerly():
    moe = _moe()
    x = torch.randn(2, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = _eager(moe, x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = moe(x)
        g.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, ref) and graphs.captures == 0


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_experts_forward_replays(index_dtype):
    moe = _moe()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(6, H, device="cuda", dtype=torch.bfloat16)
            ids = torch.randint(0, E + 1, (6, K), device="cuda", dtype=index_dtype)  # E: dropped
            w = torch.rand(6, K, device="cuda")
            got = ts_moe.experts_forward(x, ids, w, moe.gate_up_proj, moe.down_proj)
            ref = ts_moe.experts_forward(x, ids, w, moe.gate_up_proj, moe.down_proj,
                                         decode_graphs=False)
            assert torch.equal(got, ref)
    assert graphs.captures == 1


def test_a_call_that_raises_while_captured_stays_eager():
    """``fn`` raising during the capture (nothing half-captured): the signature
    stays eager, the calls give fn's results, and the process's CUDA state
    (the RNG's capture bookkeeping) is intact."""
    cache = DecodeGraphs()
    calls = []

    def fn(x, w, scale):
        calls.append(torch.cuda.is_current_stream_capturing())
        if calls[-1]:
            raise ValueError("not while captured")
        return x @ w * scale

    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    for _ in range(4):
        x = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(cache.call(fn, 1, (x,), (w,), 2.0), x @ w * 2.0)
    # eager; the warm-up before the capture, then the capture; eager from then on
    assert calls == [False, False, True, False, False, False]
    assert cache.captures == 0 and len(cache._eager) == 1


def test_bad_arguments_raise_at_every_call():
    moe = _moe()
    x = torch.randn(2, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            with pytest.raises(TypeError, match="router_weight"):
                ts_moe.moe_forward(x, moe.router.float(), moe.gate_up_proj, moe.down_proj, K)
            with pytest.raises(ValueError, match="top_k"):
                ts_moe.moe_forward(x, moe.router, moe.gate_up_proj, moe.down_proj, E + 1)
    assert graphs.captures == 0
    assert torch.randn(3, device="cuda").isfinite().all()
