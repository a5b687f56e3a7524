"""The moe_block suite on the CPU: its cases, the routing its counts come from, a
smoke run through ``python -m bench`` with eager and (empty) graph fields, a wrong
backend flagged, the graph fields' rules, ts_moe's NVTX stages."""

import json

import pytest
import torch
import torch.nn.functional as F

import ts_moe
from bench import __main__ as cli
from bench import cases, moe_block, report, runner
from bench.cases import Model
from bench.timing import Timing

TINY = Model("tiny-block", experts=6, hidden=32, inter=24, top_k=2)
CPU = runner.Settings(torch.device("cpu"), target_ms=1.0)
SUITE = runner.SUITES["moe_block"]


def _resolve(argv):
    parser = cli.build_parser()
    return cli.resolve(parser.parse_args(argv), parser)


def test_suite_registered_with_its_defaults(gpu_machine):
    sel = _resolve(["--suite", "moe_block"])
    assert sel["suite"] is SUITE and SUITE.graph_timing
    assert sel["models"] == ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"]
    assert sel["T"] == [1, 16, 64, 128, 1024, 4096]
    assert sel["routing"] == ["router"]
    assert sel["backends"] == ["ts_moe", "ts_moe_stages", "ts_moe_hf", "hf_eager",
                               "hf_grouped_mm", "hf_batched_mm"]
    quick = _resolve(["--suite", "moe_block", "--quick"])
    assert quick["models"] == list(cases.QUICK_MODELS) and quick["T"] == list(cases.BLOCK_QUICK_T)
    assert quick["routing"] == ["router"]
    args = cli.build_parser().parse_args(["--suite", "moe_block"])
    cli.resolve(args, cli.build_parser())
    assert args.graph_max_t == 4096  # every case's graph is timed
    args = cli.build_parser().parse_args([])
    cli.resolve(args, cli.build_parser())
    assert args.graph_max_t == 1024  # the other suites keep theirs


@pytest.mark.parametrize("argv", [["--routing", "uniform"], ["--backends", "ts_moe,magic"]])
def test_bad_block_arguments_exit(argv, gpu_machine):
    with pytest.raises(SystemExit) as exc:
        _resolve(["--suite", "moe_block", *argv])
    assert exc.value.code == 2


def test_list_names_the_block_cases(gpu_machine, capsys):
    assert cli.main(["--suite", "moe_block", "--list", "--models", "mixtral", "--T", "1,16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("backends: ts_moe, ts_moe_stages, ts_moe_hf, hf_eager, hf_grouped_mm, "
                      "hf_batched_mm")
    assert out[1:] == ["mixtral-8x7b block T=1 router M=2 H=4096 I=14336 E=8 k=2",
                       "mixtral-8x7b block T=16 router M=32 H=4096 I=14336 E=8 k=2"]


def test_block_cases_counts_are_the_inputs_routing():
    case_list = moe_block.block_cases(["cpu-qwen3", "cpu-mixtral"], [128, 1, 16], base_seed=3)
    assert [(c.model.name, c.T) for c in case_list] == [
        ("cpu-qwen3", 1), ("cpu-qwen3", 16), ("cpu-qwen3", 128),
        ("cpu-mixtral", 1), ("cpu-mixtral", 16), ("cpu-mixtral", 128)]
    for case in case_list:
        assert case.gemm == "block" and case.routing == "router" and case.weight_layout == "hf"
        inp = moe_block.make_block_inputs(case, torch.device("cpu"))
        _, ids = ts_moe.route(F.linear(inp.x, inp.router), case.model.top_k)
        counts = tuple(torch.bincount(ids.flatten(), minlength=case.E).tolist())
        assert counts == case.counts == inp.counts
        assert sum(case.counts) == case.M
        assert not moe_block.near_ties(inp.x, inp.router, case.model.top_k).any()
    # deterministic with the seed, another seed another routing
    again = moe_block.block_case(cases.SMOKE_MODELS["cpu-qwen3"], 128, base_seed=3)
    assert again == case_list[2]
    other = moe_block.block_case(cases.SMOKE_MODELS["cpu-qwen3"], 128, base_seed=4)
    assert other.counts != again.counts


def test_inputs_weights_scaled_and_copies_independent():
    case = moe_block.block_case(TINY, 8)
    inp = moe_block.make_block_inputs(case, torch.device("cpu"))
    assert inp.x.shape == (8, 32) and inp.router.shape == (6, 32)
    assert inp.gate_up.shape == (6, 48, 32) and inp.down.shape == (6, 32, 24)
    assert all(t.dtype == torch.bfloat16 for t in (inp.x, inp.router, inp.gate_up, inp.down))
    assert 0.5 < inp.router.float().std().item() * 32**0.5 < 2
    copy = inp.clone()
    for a, b in ((copy.x, inp.x), (copy.router, inp.router), (copy.gate_up, inp.gate_up)):
        assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)
    assert inp.nbytes == sum(t.nbytes for t in (inp.x, inp.router, inp.gate_up, inp.down))


def test_near_ties_are_redrawn():
    x = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.bfloat16)
    router = torch.tensor([[1.0, 0.0], [1.0, 0.5], [0.0, 0.5]], dtype=torch.bfloat16)
    # token 0: logits (1, 1, 0), a tie at the top-1 boundary; token 1: (1, 1.5, 0.5)
    assert moe_block.near_ties(x, router, 1).tolist() == [True, False]
    assert not moe_block.near_ties(x, router, 3).any()  # every expert chosen


def test_floor_and_traffic_of_a_block_case():
    case = moe_block.block_case(TINY, 4)
    w = case.touched_experts * 3 * TINY.inter * TINY.hidden * 2
    assert moe_block.floor_bytes(case) == w + TINY.experts * TINY.hidden * 2
    assert cases.bytes_moved(case) == moe_block.floor_bytes(case) + 2 * 4 * TINY.hidden * 2
    assert cases.flops(case) == (2 * case.M * 3 * TINY.inter * TINY.hidden
                                 + 2 * 4 * TINY.experts * TINY.hidden)
    assert runner.floor_ms(10**9, {"hbm_read_tbps": 4.0}) == pytest.approx(0.25)
    assert runner.floor_ms(10**9, None) is None


def test_backends_agree_with_the_reference_and_a_wrong_one_is_flagged():
    pytest.importorskip("transformers", minversion="5")
    factories = moe_block.block_backends()

    def wrong(case, device):
        return lambda inp: lambda: moe_block.reference_block(inp, inp.x.dtype) * 1.5

    factories["wrong"] = wrong
    names = ["reference", "ts_moe", "ts_moe_stages", "ts_moe_unfused", "ts_moe_router_kernel",
             "ts_moe_hf", "hf_eager", "hf_grouped_mm", "hf_batched_mm", "wrong"]
    case_list = [moe_block.block_case(TINY, T) for T in (1, 16)]
    records = runner.run_suite(SUITE, case_list, names, CPU, factories=factories, progress=None)
    assert len(records) == len(case_list) * len(names)
    for r in records:
        if r["backend"] == "wrong":
            assert r["status"] == "wrong" and r["ms"] is None
            assert r["max_rel_err"] == pytest.approx(0.5, rel=1e-2)
            assert r["graph_ms"] is None and r["graph_status"] is None
        else:
            assert r["status"] == "ok", r
            assert r["max_rel_err"] <= 1e-2 and r["ms"] > 0
            assert r["graph_ms"] is None and r["graph_status"] == "unavailable"
            assert r["graph_reason"] == "no CUDA graphs off CUDA"
            assert r["floor_ms"] is None and r["floor_frac"] is None
        assert r["floor_bytes"] == moe_block.floor_bytes(
            next(c for c in case_list if c.T == r["T"]))


def test_cpu_smoke_run_writes_eager_and_graph_fields(cpu_machine, tmp_path, capsys):
    """The CPU smoke suite through python -m bench: JSON, markdown and plot; graph
    fields there, empty (no CUDA)."""
    pytest.importorskip("transformers", minversion="5")
    argv = ["--suite", "moe_block", "--T", "1,16", "--target-ms", "1",
            "--out-dir", str(tmp_path), "--results-md", str(tmp_path / "RESULTS.md")]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "running 4 cases of cpu-mixtral, cpu-qwen3 at T=1,16 on the CPU" in captured.err
    data = json.loads((tmp_path / "cpu-moe_block.json").read_text())
    assert data["suite"] == "moe_block" and data["settings"]["graph_max_t"] == 4096
    assert len(data["cases"]) == 4 * len(SUITE.default_backends)
    for r in data["cases"]:
        assert r["status"] == "ok", r
        assert r["routing"] == "router" and r["gemm"] == "block"
        assert r["ms"] > 0 and not r["graphed"]
        assert {"graph_ms", "graph_status", "floor_bytes", "floor_ms", "floor_frac"} <= set(r)
        assert r["graph_ms"] is None and r["graph_status"] == "unavailable"
    assert "| graph ms | floor ms |" in (tmp_path / "RESULTS.md").read_text()
    assert (tmp_path / "cpu-moe_block.png").exists()
    head = next(line for line in captured.out.splitlines() if line.startswith("model"))
    assert head.split()[5:9] == ["ms", "graph", "ms", "floor"]


def _timing(ms):
    return Timing(ms, 10, True, [ms] * 10)


def test_graph_fields_ok_failed_and_skipped():
    base = {"status": "ok", "flops": 10**9, "bytes": 10**9, "floor_ms": 0.1,
            "graph_ms": None, "graph_status": None}
    roofs = {"hbm_read_tbps": 4.0, "bf16_dense_tflops": 800.0}
    r = runner.graph_fields(base, [_timing(0.2), _timing(0.4)], None, roofs)
    assert r["graph_ms"] == pytest.approx(0.3) and r["graph_status"] == "ok"
    assert r["graph_floor_frac"] == pytest.approx(0.1 / 0.3)
    assert r["graph_roof_frac"] == pytest.approx(0.25 / 0.3)
    assert r["graph_iters"] == 20 and r["graph_pass_ms"] == [0.2, 0.4]
    failed = runner.graph_fields(base, [RuntimeError("operation not permitted when stream "
                                                     "is capturing\nmore")], None, roofs)
    assert failed["graph_ms"] is None and failed["graph_status"] == "unavailable"
    assert failed["graph_reason"] == ("capture or replay failed: RuntimeError: operation not "
                                      "permitted when stream is capturing")
    oom = runner.graph_fields(base, [torch.OutOfMemoryError("CUDA out of memory")], None, roofs)
    assert oom["graph_status"] == "oom"
    skipped = runner.graph_fields(base, None, "T > --graph-max-t 16", roofs)
    assert skipped["graph_status"] == "unavailable" and skipped["graph_ms"] is None
    wrong = {**base, "status": "wrong"}
    assert runner.graph_fields(wrong, None, None, roofs) is wrong
    # the table shows the failure in the graph cell and why in the status
    row = dict(zip(report.columns([failed]), report.table_rows(
        [{**failed, "model": "m", "gemm": "block", "T": 1, "routing": "router",
          "backend": "hf_eager", "ms": 1.0, "tflops": 1.0, "tbps": 1.0, "max_rel_err": 0.0}])[0]))
    assert row["graph ms"] == "unavailable"
    assert row["status"].startswith("ok; graph unavailable: capture or replay failed")


def test_graph_passes_stop_after_a_failed_capture(monkeypatch):
    """A backend whose capture fails is tried once; the others get both passes."""
    tried = []

    def fake_time_backend(runs, case, settings, target_ms, graph=None):
        assert graph is True
        tried.append(runs)
        try:  # as time_backend returns a failure: the exception, its traceback set
            if runs == "hf_eager":
                raise RuntimeError("capture failed")
        except RuntimeError as exc:
            return exc
        return _timing(0.1)

    monkeypatch.setattr(runner, "time_backend", fake_time_backend)
    checked = {"ts_moe": ("ts_moe", 0.0), "hf_eager": ("hf_eager", 0.0)}
    passes = {"ts_moe": [_timing(1.0)], "hf_eager": [_timing(1.0)]}
    got = runner.time_graphs(checked, passes, moe_block.block_case(TINY, 1), CPU)
    assert tried == ["ts_moe", "hf_eager", "ts_moe"]
    assert len(got["ts_moe"]) == 2 and len(got["hf_eager"]) == 1
    assert got["hf_eager"][0].__traceback__ is None


def test_ts_moe_backend_keeps_its_nvtx_stages(monkeypatch):
    """The suite's ts_moe call goes through moe_forward's ranged stages (which
    Nsight Systems shows): route (router GEMM, top-k and the slot order: one
    launch of the routing kernel for a decode batch), gate_up, down, combine."""
    import contextlib

    import ts_moe.block

    seen = []

    def recording(name):
        seen.append(name)
        return contextlib.nullcontext()

    monkeypatch.setattr(ts_moe.block, "nvtx_range", recording)
    case = moe_block.block_case(TINY, 4)
    inp = moe_block.make_block_inputs(case, torch.device("cpu"))
    moe_block.block_backends()["ts_moe"](case, torch.device("cpu"))(inp)()
    assert seen == ["route", "gate_up", "down", "combine"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_block_suite_on_gpu_eager_and_graphed():
    """Qwen3's block at decode sizes: every backend right (the routing has no near
    ties, so transformers' topk and ts_moe's route agree); ts_moe timed both ways."""
    pytest.importorskip("transformers", minversion="5")
    case_list = moe_block.block_cases(["qwen3-30b-a3b"], [1, 128])
    settings = runner.Settings(torch.device("cuda"), target_ms=5.0,
                               graph_max_t=SUITE.graph_max_t)
    roofs = {"hbm_read_tbps": 4.0, "bf16_dense_tflops": 800.0}
    records = runner.run_suite(SUITE, case_list, ["reference", *SUITE.default_backends],
                               settings, roofs)
    for r in records:
        assert r["status"] == "ok", r
        assert r["max_rel_err"] <= 1e-2 and r["ms"] > 0 and not r["graphed"]
        assert r["graph_status"] in ("ok", "unavailable"), r
        assert r["floor_ms"] > 0 and r["floor_frac"] > 0
    for r in records:
        if r["backend"] in ("ts_moe", "ts_moe_stages", "ts_moe_hf"):
            assert r["graph_status"] == "ok" and 0 < r["graph_ms"], r


# ------------------------------------------------------------ the decode-block targets
def _block_rec(model, T, backend, ms, graph_ms=None, floor_ms=0.1, status="ok"):
    return {"model": model, "gemm": "block", "T": T, "routing": "router", "backend": backend,
            "status": status, "ms": ms, "graph_ms": graph_ms, "floor_ms": floor_ms,
            "tbps": 1.0, "tflops": 1.0}


def test_block_targets_rules(tmp_path, capsys):
    from bench import targets

    records = [
        # Mixtral T=1: graph 0.17 <= 0.18 met; eager 0.25 > 0.22 missed; beats HF
        _block_rec("mixtral-8x7b", 1, "ts_moe", 0.25, 0.17),
        _block_rec("mixtral-8x7b", 1, "hf_batched_mm", 0.5),
        _block_rec("mixtral-8x7b", 1, "hf_grouped_mm", 0.6),
        # Qwen3 T=16: graph within 1.15x of the floor (0.2 -> 0.23) missed at 0.24;
        # eager slower than the fastest HF implementation
        _block_rec("qwen3-30b-a3b", 16, "ts_moe", 0.3, 0.24, floor_ms=0.2),
        _block_rec("qwen3-30b-a3b", 16, "hf_grouped_mm", 0.29),
        _block_rec("qwen3-30b-a3b", 16, "hf_eager", None, status="error"),
        # DeepSeek T=128: no bound, only the transformers comparison; a variant of
        # ts_moe is no peer
        _block_rec("deepseek-v3", 128, "ts_moe", 1.0, 0.9),
        _block_rec("deepseek-v3", 128, "ts_moe_stages", 0.5),
        _block_rec("deepseek-v3", 128, "hf_grouped_mm", 2.0),
        # no ts_moe: no verdict
        _block_rec("deepseek-v3", 1, "hf_grouped_mm", 2.0),
    ]
    result = {"suite": "moe_block", "device": "NVIDIA H200", "roofs": None, "cases": records}
    got = {(v.case[0], v.case[2], v.step, v.peer): v for v in targets.verdicts(result)}
    assert set(got) == {
        ("mixtral-8x7b", 1, "graph", "bound"), ("mixtral-8x7b", 1, "eager", "bound"),
        ("mixtral-8x7b", 1, "eager", "hf_batched_mm"), ("qwen3-30b-a3b", 16, "graph", "floor"),
        ("qwen3-30b-a3b", 16, "eager", "hf_grouped_mm"),
        ("deepseek-v3", 128, "eager", "hf_grouped_mm")}
    assert got["mixtral-8x7b", 1, "graph", "bound"].met
    assert not got["mixtral-8x7b", 1, "eager", "bound"].met
    assert got["mixtral-8x7b", 1, "eager", "hf_batched_mm"].ratio == pytest.approx(2.0)
    floor = got["qwen3-30b-a3b", 16, "graph", "floor"]
    assert not floor.met and floor.peer_ms == pytest.approx(0.23)
    assert not got["qwen3-30b-a3b", 16, "eager", "hf_grouped_mm"].met
    assert got["deepseek-v3", 128, "eager", "hf_grouped_mm"].met
    path = tmp_path / "block.json"
    path.write_text(json.dumps(result))
    assert cli.main(["targets", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("**3 of 6 met, 3 missed.**")
    assert "| mixtral-8x7b | 1 | graph | 0.1700 | bound 0.1800 | 1.06x | <= 0.180 ms | yes |" in out
    # a variant timed in the same run, judged by name (ts_moe_stages: its eager time
    # against the bound-free T=128 case's transformers peer)
    assert cli.main(["targets", str(path), "--backend", "ts_moe_stages"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("**1 of 1 met, 0 missed.**") and "ts_moe_stages ms" in out
    assert "| deepseek-v3 | 128 | eager | 0.5000 | hf_grouped_mm 2.0000 | 4.00x |" in out


def test_shaped_inputs_are_the_suites_block_case():
    """The profiling scripts' inputs: the block case of the given shapes, routed by
    its own router, with the suite's tensors."""
    case, inp = moe_block.shaped_inputs(64, 32, 4, 2, 3, torch.device("cpu"))
    assert (case.gemm, case.T, case.model.hidden, case.model.inter) == ("block", 3, 64, 32)
    assert (case.model.experts, case.model.top_k, inp.top_k) == (4, 2, 2)
    assert inp.x.shape == (3, 64) and inp.router.shape == (4, 64)
    assert inp.gate_up.shape == (4, 64, 64) and inp.down.shape == (4, 64, 32)
    assert sum(case.counts) == 6 and inp.counts == case.counts
