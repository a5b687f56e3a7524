"""The NVTX ranges (ts_moe.nvtx): what a range records, in which domain, nested
and reused; nothing while torch.compile traces or without the nvtx package;
the layer's stages in order.  The nvtx package is replaced by a recorder (its
real ranges record only under a profiler)."""

import pytest
import torch

import ts_moe
from ts_moe import nvtx as ts_nvtx


class _Recorder:
    """Stands in for the ``nvtx`` package: ``annotate(message, domain=...)`` gives
    a reusable context manager that logs its pushes and pops."""

    def __init__(self):
        self.events, self.made = [], []

    def annotate(self, message=None, domain=None):
        self.made.append((message, domain))
        events = self.events

        class _Range:
            def __enter__(self):
                events.append(("push", message, domain))
                return self

            def __exit__(self, *exc):
                events.append(("pop", message, domain))
                return False

        return _Range()


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(ts_nvtx, "nvtx", rec)
    ts_nvtx._annotation.cache_clear()
    yield rec
    ts_nvtx._annotation.cache_clear()


def test_a_range_pushes_and_pops_its_name_in_the_ts_moe_domain(recorder):
    with ts_nvtx.nvtx_range("route"):
        assert recorder.events == [("push", "route", "ts_moe")]
    assert recorder.events == [("push", "route", "ts_moe"), ("pop", "route", "ts_moe")]


def test_nested_ranges_of_one_name_reuse_one_annotation(recorder):
    with ts_nvtx.nvtx_range("route"):
        with ts_nvtx.nvtx_range("route"):
            with ts_nvtx.nvtx_range("down"):
                pass
    assert [(kind, name) for kind, name, _ in recorder.events] == [
        ("push", "route"), ("push", "route"), ("push", "down"),
        ("pop", "down"), ("pop", "route"), ("pop", "route")]
    assert recorder.made == [("route", "ts_moe"), ("down", "ts_moe")]  # made once per name


def test_an_exception_still_pops_the_range(recorder):
    with pytest.raises(RuntimeError):
        with ts_nvtx.nvtx_range("combine"):
            raise RuntimeError("inside")
    assert [kind for kind, *_ in recorder.events] == ["push", "pop"]


def test_no_range_while_compiling_or_without_nvtx(recorder, monkeypatch):
    def fn(x):
        with ts_nvtx.nvtx_range("inside"):
            return x * 2

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert recorder.events == []  # traced away: a host range would break the graph
    fn(torch.ones(3))
    assert [name for _, name, _ in recorder.events] == ["inside", "inside"]
    monkeypatch.setattr(ts_nvtx, "nvtx", None)
    with ts_nvtx.nvtx_range("without"):
        pass
    assert len(recorder.events) == 2


def test_the_layer_marks_its_stages_in_order(recorder):
    torch.manual_seed(0)
    moe = ts_moe.MoE(32, 16, 4, 2)
    x = torch.randn(5, 32)
    with torch.no_grad():
        moe(x)
        pushes = [name for kind, name, _ in recorder.events if kind == "push"]
        assert pushes == ["route", "gate_up", "down", "combine"]
        assert len(recorder.events) == 8 and recorder.events[-1][0] == "pop"
        recorder.events.clear()
        ts_moe.experts_forward(x, torch.tensor([[0, 1]] * 5), torch.rand(5, 2),
                               moe.gate_up_proj, moe.down_proj)
    assert [name for kind, name, _ in recorder.events if kind == "push"] == [
        "permute", "gate_up", "down", "combine"]


def test_the_benchmark_ranges_are_the_same_ranges():
    from bench import timing

    assert timing.nvtx_range is ts_nvtx.nvtx_range
