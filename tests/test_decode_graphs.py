"""CPU: the decode-graph switch of the layer (ts_moe.decode_graphs) where no
graph can be captured: calls run eagerly and give the eager stages' result;
which paths count as capturable; the environment switch.  The replays
themselves: tests/test_decode_graphs_gpu.py."""

import pytest
import torch

import ts_moe
from ts_moe import decode_graphs, ops
from ts_moe.ops import Path


def test_cpu_calls_run_eagerly_and_match_the_stages():
    torch.manual_seed(0)
    moe = ts_moe.MoE(64, 32, 4, 2)
    x = torch.randn(3, 64)
    before = decode_graphs.graphs.captures
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(moe(x), ts_moe.moe_forward(x, moe.router, moe.gate_up_proj,
                                                          moe.down_proj, 2, decode_graphs=False))
        ids, w = torch.tensor([[0, 1], [2, 3], [1, 1]]), torch.rand(3, 2)
        got = ts_moe.experts_forward(x, ids, w, moe.gate_up_proj, moe.down_proj)
        ref = ts_moe.experts_forward(x, ids, w, moe.gate_up_proj, moe.down_proj,
                                     decode_graphs=False)
        assert torch.equal(got, ref)
    assert decode_graphs.graphs.captures == before and len(decode_graphs.graphs) == 0


def test_a_graphs_object_runs_the_function_where_it_cannot_capture():
    cache = decode_graphs.DecodeGraphs()
    calls = []

    def fn(x, w, scale):
        calls.append(scale)
        return x @ w * scale

    x, w = torch.randn(2, 8), torch.randn(8, 8)
    for _ in range(3):
        assert torch.equal(cache.call(fn, 1, (x,), (w,), 2.0), x @ w * 2.0)
    assert calls == [2.0] * 3 and cache.captures == 0 and not cache._seen


@pytest.mark.parametrize("value,enabled", [("0", False), ("1", True), (None, True)])
def test_environment_switch(monkeypatch, value, enabled):
    if value is None:
        monkeypatch.delenv("TS_MOE_DECODE_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("TS_MOE_DECODE_GRAPHS", value)
    cache = decode_graphs.DecodeGraphs()
    assert cache.enabled is enabled
    cache.disable()
    assert not cache.enabled
    cache.enable()
    assert cache.enabled


@pytest.mark.parametrize("path,dtype,capturable", [
    (Path.KERNEL_SM90, torch.bfloat16, True),
    (Path.KERNEL_SM100, torch.float16, True),
    (Path.TORCH_GROUPED_MM, torch.bfloat16, True),
    (Path.TORCH_GROUPED_MM, torch.float32, False),  # torch's per-expert loop reads offs
    (Path.REFERENCE, torch.bfloat16, False),
])
def test_capturable_paths(monkeypatch, path, dtype, capturable):
    seen = []

    def fake_cuda_path(device_index, dt, out_dtype=None, num_experts=1):
        seen.append((device_index, dt, num_experts))
        return path, None

    monkeypatch.setattr(ops, "cuda_path", fake_cuda_path)
    assert ops.capturable(0, dtype, 300) is capturable
    assert seen == [(0, dtype, 300)]  # the expert count decides the kernel path
