"""bench.runner, bench.timing, bench.roofs on the CPU: checking flags a wrong
backend without timing it, failures become records, timing and rotation rules."""

import math

import pytest
import torch

from bench import backends, moe_layer, timing
from bench.backends import Unavailable, reference_grouped_gemm
from bench.cases import Model, make_case
from bench.roofs import measure_roofs, roof_fraction
from bench.runner import SUITES, Settings, check, rel_err, run_suite

TINY = Model("tiny", experts=5, hidden=32, inter=24, top_k=2)
CPU = Settings(torch.device("cpu"), target_ms=1.0)


def _cases(gemm="gate_up", layout="nmajor"):
    return [make_case(TINY, gemm, T, "skewed", weight_layout=layout) for T in (3, 16)]


class CountingBackend:
    """A backend whose output is ``scale`` times the right one; counts its calls."""

    def __init__(self, scale):
        self.scale, self.calls = scale, 0

    def __call__(self, case, device):
        def bind(inp):
            def run():
                self.calls += 1
                return reference_grouped_gemm(inp, inp.a.dtype) * self.scale
            return run
        return bind


def _by_backend(records):
    return {(r["T"], r["backend"]): r for r in records}


def test_wrong_backend_is_reported_not_timed():
    wrong, right = CountingBackend(1.5), CountingBackend(1.0)
    factories = {"reference": backends.reference, "wrong": wrong, "right": right}
    records = run_suite(SUITES["grouped_gemm"], _cases(), list(factories), CPU,
                        factories=factories, progress=None)
    assert len(records) == 2 * 3
    for r in records:
        if r["backend"] == "wrong":
            assert r["status"] == "wrong"
            assert r["ms"] is None and r["tflops"] is None and r["tbps"] is None
            assert r["max_rel_err"] == pytest.approx(0.5, rel=1e-2)
        else:
            assert r["status"] == "ok", r
            assert r["ms"] > 0 and r["tflops"] > 0 and r["tbps"] > 0
            assert r["max_rel_err"] <= 1e-2
            assert 5 <= r["iters"] <= 200
    # the wrong backend ran once per input copy, for the check, and never again
    copies = sum(r["copies"] for r in records if r["backend"] == "wrong")
    assert wrong.calls == copies
    assert right.calls > copies


def test_backends_timed_in_order_then_reversed():
    calls = []

    def logging(tag):
        def factory(case, device):
            def bind(inp):
                def run():
                    calls.append(tag)
                    return reference_grouped_gemm(inp, inp.a.dtype)
                return run
            return bind
        return factory

    factories = {"a": logging("a"), "b": logging("b"), "c": logging("c")}
    (case,) = _cases()[:1]
    records = run_suite(SUITES["grouped_gemm"], [case], list(factories), CPU,
                        factories=factories, progress=None)
    # runs of one backend in a row: checked a, b, c; timed a, b, c, then c, b, a
    blocks = [t for i, t in enumerate(calls) if i == 0 or calls[i - 1] != t]
    assert blocks == ["a", "b", "c", "a", "b", "c", "b", "a"]
    for r in records:
        assert len(r["pass_ms"]) == 2 and min(r["pass_ms"]) <= r["ms"] <= max(r["pass_ms"])


def test_rounds_interleave_every_backend_early_and_late():
    from bench.runner import timing_orders

    assert timing_orders(["a", "b", "c"], 2) == [["a", "b", "c"], ["c", "b", "a"]]
    orders = timing_orders(["a", "b", "c"], 6)
    assert orders == [["a", "b", "c"], ["c", "b", "a"], ["b", "c", "a"], ["a", "c", "b"],
                      ["c", "a", "b"], ["b", "a", "c"]]
    for name in "abc":  # each backend once in every place of the order over six passes
        assert sorted(o.index(name) for o in orders) == [0, 0, 1, 1, 2, 2]
    calls = []

    def logging(tag):
        def factory(case, device):
            return lambda inp: lambda: calls.append(tag) or reference_grouped_gemm(
                inp, inp.a.dtype)
        return factory

    factories = {"a": logging("a"), "b": logging("b")}
    rounds = Settings(torch.device("cpu"), target_ms=1.0, rounds=5)
    records = run_suite(SUITES["grouped_gemm"], _cases()[:1], list(factories), rounds,
                        factories=factories, progress=None)
    blocks = [t for i, t in enumerate(calls) if i == 0 or calls[i - 1] != t]
    # checked a, b; timed a, b | b, a | b, a | a, b | a, b (runs of one name merge)
    assert blocks == ["a", "b"] * 5
    for r in records:
        assert len(r["pass_ms"]) == 5 and min(r["pass_ms"]) <= r["ms"] <= max(r["pass_ms"])


def test_rounds_out_of_range_is_a_usage_error(capsys):
    from bench.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", "--rounds", "0", "--no-save"])
    assert exc.value.code == 2 and "--rounds 0: must be 1 to 50" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["nmajor", "kmajor"])
def test_torch_backends_agree_on_cpu(layout):
    names = ["reference", "torch_grouped_mm", "cublas_loop", "ts_moe"]
    records = run_suite(SUITES["grouped_gemm"], _cases("down", layout), names, CPU,
                        progress=None)
    assert {r["status"] for r in records} == {"ok"}, records


def test_gpu_only_backends_unavailable_on_cpu():
    names = ["cublas_grouped", "ts_moe:band_m=16"]
    records = run_suite(SUITES["grouped_gemm"], _cases()[:1], names, CPU, progress=None)
    assert [r["status"] for r in records] == ["unavailable", "unavailable"]
    assert all("CUDA" in r["reason"] for r in records)


def _raising(exc):
    def factory(case, device):
        def bind(inp):
            def run():
                raise exc
            return run
        return bind
    return factory


def _missing(case, device):
    raise ImportError("No module named 'not_installed'")


def _unusable(case, device):
    raise Unavailable("no such GPU")


def test_failures_become_records():
    factories = {
        "reference": backends.reference,
        "missing": _missing,
        "unusable": _unusable,
        "oom": _raising(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")),
        "broken": _raising(RuntimeError("illegal instruction")),
    }
    records = run_suite(SUITES["grouped_gemm"], _cases()[:1], list(factories), CPU,
                        factories=factories, progress=None)
    status = {r["backend"]: r["status"] for r in records}
    assert status == {"reference": "ok", "missing": "unavailable", "unusable": "unavailable",
                      "oom": "oom", "broken": "error"}
    reasons = {r["backend"]: r.get("reason", "") for r in records}
    assert "not_installed" in reasons["missing"]
    assert "out of memory" in reasons["oom"]
    assert "RuntimeError" in reasons["broken"]


def test_inputs_oom_marks_every_backend():
    def no_memory(case, device):
        raise torch.OutOfMemoryError("CUDA out of memory")

    suite = SUITES["grouped_gemm"]
    oom_suite = type(suite)(suite.name, no_memory, suite.reference, suite.backends,
                            suite.default_backends)
    records = run_suite(oom_suite, _cases()[:1], ["reference", "cublas_loop"], CPU,
                        progress=None)
    assert [r["status"] for r in records] == ["oom", "oom"]


def test_unknown_backend_rejected():
    with pytest.raises(ValueError, match="unknown"):
        run_suite(SUITES["grouped_gemm"], _cases()[:1], ["nope"], CPU, progress=None)


def test_progress_one_line_per_case(capsys):
    import sys

    run_suite(SUITES["grouped_gemm"], _cases(), ["reference"], CPU, progress=sys.stderr)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[1/2] tiny gate_up T=3 skewed M=6")
    assert "reference" in lines[0] and "ms" in lines[0]


def test_layer_reference_matches_dense_loop():
    case = make_case(TINY, "layer", 6, "skewed", weight_layout="hf")
    inp = moe_layer.make_layer_inputs(case, torch.device("cpu"))
    out = moe_layer.reference_layer(inp)
    expect = torch.zeros(6, TINY.hidden)
    for t in range(6):
        for j in range(TINY.top_k):
            e = int(inp.topk_ids[t, j])
            h = inp.gate_up[e].float() @ inp.x[t].float()
            act = torch.nn.functional.silu(h[:TINY.inter]) * h[TINY.inter:]
            expect[t] += inp.topk_weights[t, j] * (inp.down[e].float() @ act)
    torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-4)
    assert sum(inp.counts) == 6 * TINY.top_k


def test_layer_backends_agree_with_the_reference_on_cpu():
    pytest.importorskip("transformers")
    names = ["reference", "ts_moe", "ts_moe_unfused", "hf_eager"]
    cases = [make_case(TINY, "layer", T, "skewed", weight_layout="hf") for T in (1, 3, 16)]
    records = run_suite(SUITES["moe_layer"], cases, names, CPU,
                        factories=moe_layer.layer_backends(), progress=None)
    assert len(records) == len(cases) * len(names)
    for r in records:
        assert r["status"] == "ok", r
        assert r["max_rel_err"] <= 1e-2


def test_gemm_inputs_layouts_and_offs():
    case = make_case(TINY, "gate_up", 16, "skewed", weight_layout="kmajor")
    inp = backends.make_gemm_inputs(case, torch.device("cpu"))
    assert inp.a.shape == (case.M, case.K)
    assert inp.b.shape == (case.E, case.K, case.N) and inp.b.stride(1) == 1
    assert inp.offs.dtype == torch.int32
    assert inp.offs.tolist() == torch.tensor(case.counts).cumsum(0).tolist()
    copy = inp.clone()
    assert copy.b.stride() == inp.b.stride() and copy.b.data_ptr() != inp.b.data_ptr()
    torch.testing.assert_close(copy.b, inp.b)


def test_rel_err_edge_cases():
    ref = torch.ones(4, 3)
    assert rel_err(ref.bfloat16(), ref) == 0.0
    assert rel_err(torch.ones(3, 4), ref) == math.inf
    assert rel_err(torch.full((4, 3), float("nan")), ref) == math.inf
    assert rel_err(torch.zeros(4, 3), torch.zeros(4, 3)) == 0.0
    assert check([lambda: ref, lambda: ref * 2], ref) == pytest.approx(1.0)


def test_iterations_clamped():
    assert timing.iterations(1.0, 100, 5, 200) == 100
    assert timing.iterations(0.001, 100, 5, 200) == 200
    assert timing.iterations(50.0, 100, 5, 200) == 5
    assert timing.iterations(0.0, 100, 5, 200) == 200


def test_rotation_copies():
    l2, budget = 60 << 20, 36 << 30
    # weights far over L2: two copies
    assert timing.rotation_copies(1 << 30, 2 << 30, l2, budget) == 2
    # small inputs: enough to read 3x L2, capped
    assert timing.rotation_copies(40 << 20, 40 << 20, l2, budget) == 5
    assert timing.rotation_copies(1 << 20, 1 << 20, l2, budget) == timing.MAX_COPIES
    # bounded by memory: DeepSeek-V3 gate_up (15 GB of weights) fits twice, not three times
    assert timing.rotation_copies(17 << 30, 17 << 30, l2, budget) == 2
    assert timing.rotation_copies(20 << 30, 20 << 30, l2, budget) == 1
    # CPU: no L2 to defeat
    assert timing.rotation_copies(100, 100, 0, budget) == 2


def test_measure_cycles_through_copies_on_cpu():
    calls = []
    thunks = [lambda i=i: calls.append(i) for i in range(3)]
    t = timing.measure(thunks, torch.device("cpu"), target_ms=0.01, min_iters=7, max_iters=9)
    assert 7 <= t.iters <= 9 and t.ms >= 0 and not t.graphed
    assert set(calls) == {0, 1, 2}


def test_roofs_on_cpu_and_fraction():
    roofs = measure_roofs(torch.device("cpu"), hbm_bytes=1 << 20, gemm_size=64)
    assert set(roofs) == {"hbm_read_tbps", "bf16_dense_tflops"}
    assert all(v > 0 for v in roofs.values())

    roofs = {"hbm_read_tbps": 4.0, "bf16_dense_tflops": 800.0}
    # 4 GB at 4 TB/s = 1 ms; 1.6 TFLOP at 800 TFLOP/s = 2 ms: flop-bound, 4 ms measured
    assert roof_fraction(4.0, int(1.6e12), int(4e9), roofs) == (pytest.approx(0.5), "flop")
    assert roof_fraction(2.0, int(1e9), int(4e9), roofs) == (pytest.approx(0.5), "hbm")
    assert roof_fraction(2.0, 1, 1, None) == (None, None)


def test_nvtx_range_is_a_context_manager():
    with timing.nvtx_range("case x M=1 N=2 K=3"):
        pass


def _emulate_cublas(plan, a, b, out):
    """What cublasGemmGroupedBatchedEx does with the plan: column-major GEMMs on raw memory."""
    for g, rows in enumerate(plan.n):
        if plan.transpose_w:  # A stored k x m, used transposed
            w = torch.as_strided(b, (plan.k, plan.m), (1, plan.lda),
                                 b.storage_offset() + plan.w_offsets[g]).t()
        else:
            w = torch.as_strided(b, (plan.m, plan.k), (1, plan.lda),
                                 b.storage_offset() + plan.w_offsets[g])
        x = torch.as_strided(a, (plan.k, rows), (1, plan.ldb),
                             a.storage_offset() + plan.a_offsets[g])
        c = torch.as_strided(out, (plan.m, rows), (1, plan.ldc),
                             out.storage_offset() + plan.out_offsets[g])
        c.copy_(w.float() @ x.float())


@pytest.mark.parametrize("layout", ["nmajor", "kmajor"])
def test_cublas_plan_column_major_mapping(layout):
    case = make_case(TINY, "gate_up", 2, "skewed", weight_layout=layout)
    assert case.touched_experts < case.E  # an empty expert gets no group
    inp = backends.make_gemm_inputs(case, torch.device("cpu"))
    out = torch.full((case.M, case.N), float("nan"))
    plan = backends.cublas_plan(inp.a, inp.b, out, case.counts)
    assert plan.transpose_w == (layout == "kmajor")
    assert len(plan.n) == case.touched_experts and sum(plan.n) == case.M
    _emulate_cublas(plan, inp.a, inp.b, out)
    torch.testing.assert_close(out, reference_grouped_gemm(inp), rtol=1e-5, atol=1e-5)



def test_ts_moe_variants_name_their_kernel_and_configuration(monkeypatch):
    import dataclasses

    from bench import backends
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as sm90

    wide = dataclasses.replace(sm90.PREFILL, name="wide", tile_n=192)
    monkeypatch.setattr(backends, "variant_kernels", lambda: {"probe": (object, {"wide": wide})})
    assert callable(backends.ts_moe_variant("kernel=probe"))  # choose_config's tiles
    assert callable(backends.ts_moe_variant("kernel=probe:config=wide:band_m=2"))
    with pytest.raises(ValueError, match="no kernel 'pong'; known: plain, probe"):
        backends.ts_moe_variant("kernel=pong")
    with pytest.raises(ValueError, match="no configuration 'prefill'; known: wide"):
        backends.ts_moe_variant("kernel=probe:config=prefill")
    with pytest.raises(ValueError, match="no configuration 'wide'"):
        backends.ts_moe_variant("config=wide")  # the plain kernel's configurations only
    records = run_suite(SUITES["grouped_gemm"], _cases()[:1], ["ts_moe:kernel=probe"], CPU,
                        progress=None)
    assert records[0]["status"] == "unavailable" and "CUDA" in records[0]["reason"]
