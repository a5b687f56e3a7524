"""CPU: the decode-graph switch of the layer (ts_moe.decode_graphs) where no
graph can be captured: calls run eagerly and give the eager stages' result;
which paths count as capturable; the environment switch.  The replays
themselves: tests/test_decode_graphs_gpu.py."""

import pytest
import torch

import ts_moe
from ts_moe import decode_graphs
from ts_moe.ops import Path, paths


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


@pytest.mark.parametrize("path,dtype,graphed", [
    (Path.KERNEL_SM90, torch.bfloat16, True),
    (Path.KERNEL_SM100, torch.float16, True),
    (Path.TORCH_GROUPED_MM, torch.bfloat16, True),
    (Path.TORCH_GROUPED_MM, torch.float32, False),  # torch's per-expert loop reads offs
    (Path.REFERENCE, torch.bfloat16, False),
])
def test_graph_paths(monkeypatch, path, dtype, graphed):
    seen = []

    def fake_paths_for(op, capability, dt, out_dtype=None, num_experts=1):
        seen.append((op, dt, num_experts))
        return (path,)

    monkeypatch.setattr(paths, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(paths, "paths_for", fake_paths_for)
    assert paths.graph_path(0, dtype, 300) is (path if graphed else None)
    assert seen == [(paths.Op.GROUPED_GEMM, dtype, 300)]  # the expert count decides the path


# ------------------------------------------- admission and eviction, on the CPU
class _Entry:
    def __init__(self, fn, fixed, static):
        self.fn, self.fixed, self.static, self.last_use = fn, fixed, static, 0

    def replay(self, dynamic):
        return ("graph", self.fn(*dynamic, *self.fixed, *self.static))


class _Graphs(decode_graphs.DecodeGraphs):
    """The cache's policy with every call graphable and a capture that records
    itself: the signature is the static arguments."""

    def __init__(self, fail=False, **kwargs):
        super().__init__(**kwargs)
        self.enabled, self.fail, self.captured = True, fail, []

    def _signature(self, fn, num_experts, dynamic, fixed, static):
        return static

    def _capture(self, key, fn, dynamic, fixed, static):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured.append(key)
        return _Entry(fn, fixed, static)


def _plus(x, w, s):
    return x + w + s


def test_the_second_call_captures_and_later_ones_replay():
    cache = _Graphs()
    got = [cache.call(_plus, 1, (1,), (10,), 100) for _ in range(4)]
    assert got == [111, ("graph", 111), ("graph", 111), ("graph", 111)]
    assert cache.captured == [(100,)] and cache.captures == 1


def test_a_full_cache_evicts_only_idle_graphs():
    cache = _Graphs(max_graphs=2)
    for s in (1, 2, 1, 2):
        cache.call(_plus, 1, (0,), (0,), s)
    assert cache.captured == [(1,), (2,)]
    for _ in range(3):  # no room: graphs 1 and 2 were used a moment ago
        assert cache.call(_plus, 1, (0,), (0,), 3) == 3
    assert cache.captured == [(1,), (2,)]
    for _ in range(cache.IDLE_FACTOR * cache.max_graphs):  # graph 1 goes idle
        cache.call(_plus, 1, (0,), (0,), 2)
    cache.call(_plus, 1, (0,), (0,), 3)
    assert cache.call(_plus, 1, (0,), (0,), 3) == ("graph", 3)
    assert cache.captured == [(1,), (2,), (3,)] and set(cache._graphs) == {(2,), (3,)}


def test_a_working_set_larger_than_the_cache_does_not_thrash():
    cache = _Graphs(max_graphs=2)
    for _ in range(50):
        for s in range(5):
            assert cache.call(_plus, 1, (0,), (0,), s) in (s, ("graph", s))
    assert len(cache.captured) == 2  # two captures, then eager calls: never one per call


def test_a_refused_capture_warns_once_and_stays_eager():
    cache = _Graphs(fail=True)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        got = [cache.call(_plus, 1, (1,), (2,), 3) for _ in range(4)]
    assert got == [6] * 4 and cache._eager == {(3,)} and cache.captures == 0
