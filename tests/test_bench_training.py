"""The training suite on the CPU: its cases, inputs and fp32 reference, its backends
agreeing (and wrong ones flagged), peak memory in the records, the JSON and
RESULTS.md section of a run, and the targets logic on synthetic records."""

import json
import math

import pytest
import torch

from bench import __main__ as cli
from bench import backends, cases, moe_layer, report, runner, targets, training
from bench.cases import Model
from bench.runner import SUITES, Settings, rel_err, run_suite

TINY = Model("tiny", experts=6, hidden=32, inter=24, top_k=2)
CPU = Settings(torch.device("cpu"), target_ms=1.0)
GEMM_BACKENDS = ["ts_moe", "torch_grouped_mm", "cublas_loop"]
LAYER_BACKENDS = ["ts_moe", "hf_grouped_mm", "torch_layer"]


def _step_case(step, gemm="gate_up", T=4, routing="skewed", layout="nmajor"):
    return cases.make_case(TINY, gemm, T, routing, weight_layout=layout, step=step)


def _layer_case(T=8, routing="skewed"):
    return cases.make_case(TINY, "layer", T, routing, weight_layout="hf", step="fwd+bwd")


@pytest.fixture
def tiny_model(monkeypatch):
    models = dict(cases.MODELS)
    models["tiny"] = TINY
    monkeypatch.setattr(cases, "MODELS", models)


def _resolve(argv):
    parser = cli.build_parser()
    return cli.resolve(parser.parse_args(argv), parser)


# ------------------------------------------------------------------ cases
def test_case_list_of_the_full_suite():
    got = cases.training_cases(list(cases.MODELS), cases.TRAIN_T, cases.TRAIN_GEMMS,
                               cases.ROUTINGS)
    # per model: 2 GEMMs x 3 steps x 2 routings x 2 T, then the layer x 2 routings x 2 T
    assert len(got) == 3 * (2 * 3 * 2 * 2 + 2 * 2) == 84
    mix = [c for c in got if c.model.name == "mixtral-8x7b"]
    assert [(c.gemm, c.step, c.routing, c.T) for c in mix[:4]] == [
        ("gate_up", "fwd", "uniform", 4096), ("gate_up", "fwd", "uniform", 16384),
        ("gate_up", "fwd", "skewed", 4096), ("gate_up", "fwd", "skewed", 16384)]
    assert {(c.gemm, c.step) for c in got} == {
        (g, s) for g in cases.GEMMS for s in cases.GEMM_STEPS} | {("layer", "fwd+bwd")}
    assert {c.T for c in got} == {4096, 16384}
    layer = [c for c in mix if c.gemm == "layer"]
    assert len(layer) == 4 and all(c.weight_layout == "hf" for c in layer)
    # a step is part of the case's identity; gate_up and down share the routing
    up_dw = next(c for c in mix if (c.gemm, c.step, c.T) == ("gate_up", "dW", 4096))
    assert up_dw.key() == {"model": "mixtral-8x7b", "gemm": "gate_up", "T": 4096,
                           "routing": "uniform", "step": "dW"}
    assert up_dw.describe() == "mixtral-8x7b gate_up dW T=4096 uniform M=8192 N=28672 K=4096 E=8"
    assert "step" not in cases.make_case(TINY, "down", 4, "uniform").key()  # other suites


def test_flops_and_bytes_of_the_steps():
    fwd, d_a, d_w = (_step_case(s, "down") for s in ("fwd", "dA", "dW"))
    assert cases.flops(fwd) == cases.flops(d_a) == cases.flops(d_w) == 2 * fwd.M * fwd.N * fwd.K
    M, N, K, E = fwd.M, fwd.N, fwd.K, fwd.E
    touched = fwd.touched_experts
    assert cases.traffic(d_a) == {"weights": touched * K * N * 2, "act_in": M * N * 2,
                                  "out": M * K * 2}
    # dW reads x and dy, writes every expert's (K, N) block (zeros where no rows)
    assert cases.traffic(d_w) == {"weights": 0, "act_in": M * (K + N) * 2, "out": E * K * N * 2}
    layer = _layer_case()
    plain = cases.make_case(TINY, "layer", 8, "skewed", weight_layout="hf")
    assert cases.flops(layer) == 3 * cases.flops(plain)
    assert cases.bytes_moved(layer) > cases.bytes_moved(plain)
    assert cases.traffic(layer)["weight_grads"] == TINY.experts * 3 * TINY.hidden * TINY.inter * 2


# ------------------------------------------------------------------- CLI
def test_cli_selection_of_the_training_suite(gpu_machine):
    sel = _resolve(["--suite", "training"])
    assert sel["T"] == [4096, 16384] and sel["models"] == list(cases.MODELS)
    assert sel["gemms"] == ["gate_up", "down", "layer"]
    assert sel["routing"] == ["uniform", "skewed"]
    assert sel["backends"] == list(training.DEFAULT_BACKENDS)
    sel = _resolve(["--suite", "training", "--quick"])
    assert (sel["models"], sel["T"], sel["routing"]) == (
        list(cases.QUICK_MODELS), list(cases.TRAIN_QUICK_T), ["uniform"])
    args = cli.build_parser().parse_args(["--suite", "training", "--steps", "dw,DA",
                                          "--gemms", "down,layer", "--models", "qwen3"])
    made = cli.make_cases(args, cli.resolve(args, cli.build_parser()))
    assert [(c.gemm, c.step) for c in made if c.T == 4096 and c.routing == "uniform"] == [
        ("down", "dA"), ("down", "dW"), ("layer", "fwd+bwd")]
    with pytest.raises(SystemExit):
        _resolve(["--suite", "training", "--steps", "d"])  # ambiguous: dA or dW
    with pytest.raises(SystemExit):
        _resolve(["--suite", "grouped_gemm", "--gemms", "layer"])  # training only
    assert SUITES["training"].default_target_ms < SUITES["grouped_gemm"].default_target_ms


def test_cli_list(gpu_machine, capsys):
    assert cli.main(["--suite", "training", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "backends: " + ", ".join(training.DEFAULT_BACKENDS)
    assert len(out) == 1 + 84
    assert "deepseek-v3 layer fwd+bwd T=16384 skewed M=131072 H=7168 I=2048 E=256 k=8" in out


# ------------------------------------------------------ inputs, reference
def test_step_inputs_are_the_gemm_of_each_step():
    dev = torch.device("cpu")
    fwd, d_a, d_w = (training.make_training_inputs(_step_case(s), dev)
                     for s in ("fwd", "dA", "dW"))
    case = _step_case("fwd")
    M, N, K, E = case.M, case.N, case.K, case.E
    assert fwd.a.shape == (M, K) and fwd.b.shape == (E, K, N) and fwd.b.stride(2) == 1
    assert d_a.a.shape == (M, N) and d_a.b.shape == (E, N, K) and d_a.b.stride(1) == 1
    # dW: a = x.t() (M-major view of the (M, K) activations), b = dy (M, N)
    assert d_w.a.shape == (K, M) and d_w.a.stride() == (1, K) and d_w.b.shape == (M, N)
    assert d_w.clone().a.stride() == (1, K)  # the copies keep the layout
    assert d_w.offs.tolist() == torch.tensor(case.counts).cumsum(0).tolist()
    # the reference of dW is each expert's x_e^T dy_e, zeros without rows
    ref = training.reference_training(d_w)
    assert ref.shape == (E, K, N) and ref.dtype == torch.float32
    start = 0
    for e, rows in enumerate(case.counts):
        want = d_w.a[:, start:start + rows].float() @ d_w.b[start:start + rows].float()
        torch.testing.assert_close(ref[e], want, rtol=1e-5, atol=1e-5)
        start += rows
    assert 0 in case.counts  # skewed T=4 leaves experts idle: their zeros are checked


def test_layer_reference_gradients_match_autograd():
    inp = training.make_training_inputs(_layer_case(T=6), torch.device("cpu"))
    got = training.reference_layer_train(inp)
    leaves = [t.detach().double().requires_grad_() for t in
              (inp.x, inp.gate_up, inp.down, inp.topk_weights)]
    x, gate_up, down, weights = leaves
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(TINY.top_k):
            e = int(inp.topk_ids[t, j])
            h = gate_up[e] @ x[t]
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out = out.index_add(0, torch.tensor([t]), (weights[t, j] * (down[e] @ act))[None])
    grads = torch.autograd.grad(out, leaves, inp.dout.double())
    for mine, want in zip(got, (out, *grads)):
        torch.testing.assert_close(mine.double(), want, rtol=1e-4, atol=1e-4)


def test_torch_layer_forward_is_the_layer():
    case = cases.make_case(TINY, "layer", 16, "skewed", weight_layout="hf")
    inp = moe_layer.make_layer_inputs(case, torch.device("cpu"))
    out = moe_layer.torch_layer_forward(inp.x, inp.topk_ids, inp.topk_weights, inp.gate_up,
                                        inp.down)
    assert out.dtype == inp.x.dtype
    assert rel_err(out, moe_layer.reference_layer(inp)) < 1e-2


def test_cublas_loop_dw_zero_fills_idle_experts():
    case = _step_case("dW", "down")
    inp = training.make_training_inputs(case, torch.device("cpu"))
    run = backends.cublas_loop(case, torch.device("cpu"))(inp)
    for _ in range(3):  # a fresh output each call, idle experts zero every time
        out = run()
        for e, rows in enumerate(case.counts):
            if not rows:
                assert torch.count_nonzero(out[e]) == 0
    assert rel_err(out, training.reference_training(inp)) < 1e-2


# ---------------------------------------------------------------- runner
def test_every_backend_right_and_only_where_it_applies():
    case_list = [_step_case(s, g, T, "skewed") for g in cases.GEMMS for s in cases.GEMM_STEPS
                 for T in (3, 16)] + [_layer_case(T) for T in (3, 16)]
    case_list.append(_step_case("dA", "gate_up", 16, "uniform", layout="kmajor"))
    names = list(training.DEFAULT_BACKENDS) + ["reference"]
    records = run_suite(SUITES["training"], case_list, names, CPU, progress=None)
    for r in records:
        assert r["status"] == "ok", r
        assert r["max_rel_err"] <= 1e-2
        assert "peak_mem_bytes" in r and r["peak_mem_bytes"] is None  # CPU: not measured
        assert r["step"] in ("fwd", "dA", "dW", "fwd+bwd")
    per_case = report.case_groups(records)
    assert len(per_case) == len(case_list)  # the steps are separate cases
    for group in per_case.values():
        got = [r["backend"] for r in group]
        want = LAYER_BACKENDS if group[0]["gemm"] == "layer" else GEMM_BACKENDS
        assert got == want + ["reference"]


def _scaled(factory, scale=1.0, member=None):
    """``factory``'s backend with its result (or one member of a tuple) scaled."""
    def wrapped(case, device):
        bind = factory(case, device)

        def bound(inp):
            run = bind(inp)

            def scaled_run():
                out = run()
                if isinstance(out, tuple):
                    return tuple(o * scale if i == member else o for i, o in enumerate(out))
                return out * scale
            return scaled_run
        return bound
    wrapped.applies = getattr(factory, "applies", None) or (lambda case: True)
    return wrapped


def test_wrong_backends_are_flagged_not_timed():
    registry = training.training_backends()
    factories = {
        "ts_moe": registry["ts_moe"],
        "wrong_dw": _scaled(registry["torch_grouped_mm"], 1.5),
        "wrong_d_down": _scaled(registry["torch_layer"], 0.0, member=3),
        "wrong_d_weights": _scaled(registry["hf_grouped_mm"], -1.0, member=4),
    }
    case_list = [_step_case("dW"), _layer_case()]
    records = run_suite(SUITES["training"], case_list, list(factories), CPU,
                        factories=factories, progress=None)
    status = {(r["gemm"], r["backend"]): r for r in records}
    assert status["gate_up", "ts_moe"]["status"] == "ok"
    assert status["layer", "ts_moe"]["status"] == "ok"
    wrong = status["gate_up", "wrong_dw"]
    assert wrong["status"] == "wrong" and wrong["ms"] is None
    assert wrong["max_rel_err"] == pytest.approx(0.5, rel=2e-2)
    assert status["layer", "wrong_d_down"]["max_rel_err"] == pytest.approx(1.0)
    assert status["layer", "wrong_d_weights"]["max_rel_err"] == pytest.approx(2.0, rel=1e-2)
    assert status["layer", "wrong_d_down"]["status"] == "wrong"
    # ts_moe runs both cases; wrong_dw applies to GEMMs only, the other two to layers
    assert len(records) == 2 + 3


def test_rel_err_of_tuples_and_in_slabs(monkeypatch):
    ref = (torch.ones(4, 3), torch.full((5, 6, 7), 2.0))
    out = (torch.ones(4, 3), torch.full((5, 6, 7), 2.0).bfloat16() * 1.25)
    assert rel_err(out, ref) == pytest.approx(0.25)
    assert rel_err(out[:1], ref) == math.inf
    assert rel_err(out[0], ref) == math.inf
    assert rel_err((out[1], out[0]), ref) == math.inf  # shapes swapped
    big = torch.randn(9, 5, 4)
    noisy = big + 0.01 * torch.randn(9, 5, 4)
    whole = rel_err(noisy, big)
    monkeypatch.setattr(runner, "CHUNK_ELEMENTS", 30)  # 20 elements a row: slabs of 1 row
    assert len(list(runner._slabs(big))) == 9
    assert rel_err(noisy, big) == pytest.approx(whole, rel=1e-5)
    nan = noisy.clone()
    nan[7, 1, 1] = float("nan")
    assert rel_err(nan, big) == math.inf


class FakeCuda:
    """torch.cuda's memory counters, played by a script: a call allocates ``bytes``."""

    def __init__(self):
        self.allocated, self.peak = 1000, 1000

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                            lambda device=None: setattr(self, "peak", self.allocated))

    def call(self, nbytes):
        def run():
            self.peak = max(self.peak, self.allocated + nbytes)
            return "out"
        return run


def test_peak_memory_is_the_delta_over_one_call(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    fake.peak = 10**9  # an earlier peak is forgotten: the counter is reset first
    assert runner.peak_memory(fake.call(4096), torch.device("cuda")) == 4096
    assert runner.peak_memory(fake.call(4096), torch.device("cpu")) is None


def test_peak_memory_in_records_and_the_table(monkeypatch):
    """The runner measures each checked backend once and puts it in its record."""
    peaks = {"ts_moe": 3 << 30, "hf_grouped_mm": 5 << 29, "torch_layer": None}
    measured = []

    def fake_peak(run, device):
        measured.append(run.tag)
        return peaks[run.tag]

    def tagged(name):
        def factory(case, device):
            bind = training.reference(case, device)

            def bound(inp):
                run = bind(inp)
                run.tag = name
                return run
            return bound
        return factory

    monkeypatch.setattr(runner, "peak_memory", fake_peak)
    factories = {name: tagged(name) for name in peaks}
    records = run_suite(SUITES["training"], [_layer_case()], list(factories), CPU,
                        factories=factories, progress=None)
    assert measured == list(peaks)  # once each, before the timing
    assert [r["peak_mem_bytes"] for r in records] == [3 << 30, 5 << 29, None]
    head, _, *rows = report.render_text(records).splitlines()
    assert "vs best peer  peak GiB  status" in head
    assert [row.split()[-2] for row in rows[:2]] == ["3.00", "2.50"]
    # suites that measure no memory keep their columns
    assert report.PEAK_COLUMN not in report.render_text(
        [{k: v for k, v in r.items() if k != "peak_mem_bytes"} for r in records])


# ------------------------------------------------------------ a whole run
def test_cpu_run_writes_json_markdown_and_exit_status(tiny_model, tmp_path, capsys,
                                                      monkeypatch):
    md = tmp_path / "RESULTS.md"
    argv = ["--suite", "training", "--device", "cpu", "--models", "tiny", "--T", "4,16",
            "--routing", "skewed", "--gemms", "down,layer", "--target-ms", "1",
            "--out-dir", str(tmp_path), "--results-md", str(md), "--no-plots"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert sum(line.startswith("[") for line in captured.err.splitlines()) == 2 * 3 + 2
    data = json.loads((tmp_path / "cpu-training.json").read_text())
    assert data["suite"] == "training" and data["settings"]["target_ms"] == 1
    assert len(data["cases"]) == (2 * 3 + 2) * 3  # cases x the 3 backends that apply
    for r in data["cases"]:
        assert {"model", "gemm", "step", "T", "routing", "backend", "ms", "tflops",
                "max_rel_err", "status", "peak_mem_bytes", "speedup_vs"} <= set(r)
        assert r["status"] == "ok", r
    layer = [r for r in data["cases"] if r["gemm"] == "layer"]
    assert {r["backend"] for r in layer} == set(LAYER_BACKENDS)
    assert all(set(r["speedup_vs"]) <= set(LAYER_BACKENDS) for r in layer)
    text = md.read_text()
    assert "<!-- bench:cpu-training begin -->" in text and "| peak GiB |" in text
    assert "| tiny | down dW | 16 | skewed | cublas_loop |" in text
    assert "| tiny | layer fwd+bwd | 4 | skewed | hf_grouped_mm |" in text

    # a backend with wrong gradients fails the run
    suite = runner.SUITES["training"]

    def registry():
        reg = suite.backends()
        reg["wrong"] = _scaled(reg["torch_layer"], 2.0, member=1)
        return reg

    monkeypatch.setitem(runner.SUITES, "training", runner.Suite(
        suite.name, suite.make_inputs, suite.reference, registry, suite.default_backends,
        suite.default_target_ms, suite.memory))
    monkeypatch.setattr(cli, "SUITES", runner.SUITES)
    assert cli.main(["--suite", "training", "--device", "cpu", "--models", "tiny", "--T", "4",
                     "--routing", "skewed", "--gemms", "layer", "--target-ms", "1",
                     "--backends", "ts_moe,wrong", "--no-save"]) == 1


# ---------------------------------------------------------------- targets
def _rec(gemm, step, T, backend, ms, tflops=100.0, peak=None, model="qwen3-30b-a3b",
         status="ok"):
    return {"model": model, "gemm": gemm, "step": step, "T": T, "routing": "uniform",
            "backend": backend, "status": status, "ms": ms, "tflops": tflops,
            "tbps": 1.0, "peak_mem_bytes": peak, "flops": 4e11, "bytes": 1e6}


def test_training_targets_rules():
    roofs = {"hbm_read_tbps": 4.0, "bf16_dense_tflops": 800.0}
    records = [
        # dW: 1.2x torch and 1.05x the loop: both met
        _rec("down", "dW", 4096, "ts_moe", 1.0, 500),
        _rec("down", "dW", 4096, "torch_grouped_mm", 1.2, 417),
        _rec("down", "dW", 4096, "cublas_loop", 1.05, 476),
        # dW near the roof: 1.10x torch would need 802 > 95% of 800 = 760 TFLOP/s, and so
        # would 1.0x the loop (773): >= 760 TFLOP/s is what counts for both
        _rec("gate_up", "dW", 16384, "ts_moe", 1.0, 765),
        _rec("gate_up", "dW", 16384, "torch_grouped_mm", 1.05, 729),
        _rec("gate_up", "dW", 16384, "cublas_loop", 0.99, 773),
        # dW with a faster loop, far from the roof: missed
        _rec("down", "dW", 16384, "ts_moe", 1.0, 500),
        _rec("down", "dW", 16384, "torch_grouped_mm", 1.5, 333),
        _rec("down", "dW", 16384, "cublas_loop", 0.95, 526),
        # dA: the forward targets (at T >= 4096 1.10x torch and 1.0x the cuBLAS loop)
        _rec("gate_up", "dA", 16384, "ts_moe", 1.0, 690, model="mixtral-8x7b"),
        _rec("gate_up", "dA", 16384, "torch_grouped_mm", 1.2, 575, model="mixtral-8x7b"),
        _rec("gate_up", "dA", 16384, "cublas_loop", 0.9, 766, model="mixtral-8x7b"),
        _rec("down", "fwd", 4096, "ts_moe", 1.0),
        _rec("down", "fwd", 4096, "torch_grouped_mm", 1.15),
        # layer: 1.3x HF with less memory, 1.2x the torch layer with more memory
        _rec("layer", "fwd+bwd", 4096, "ts_moe", 10.0, peak=5 << 30),
        _rec("layer", "fwd+bwd", 4096, "hf_grouped_mm", 13.0, peak=6 << 30),
        _rec("layer", "fwd+bwd", 4096, "torch_layer", 12.0, peak=4 << 30),
        # a layer below T = 4096 and a case without ts_moe: no verdict
        _rec("layer", "fwd+bwd", 1024, "ts_moe", 1.0, peak=1),
        _rec("layer", "fwd+bwd", 1024, "hf_grouped_mm", 2.0, peak=1),
        _rec("down", "dW", 16384, "ts_moe", None, status="error", model="deepseek-v3"),
        _rec("down", "dW", 16384, "torch_grouped_mm", 1.0, model="deepseek-v3"),
    ]
    result = {"suite": "training", "roofs": roofs, "cases": records}
    got = {(v.case[1], v.step, v.case[2], v.peer): v for v in targets.verdicts(result)}
    assert set(got) == {
        ("down", "dW", 4096, "torch_grouped_mm"), ("down", "dW", 4096, "cublas_loop"),
        ("gate_up", "dW", 16384, "torch_grouped_mm"), ("gate_up", "dW", 16384, "cublas_loop"),
        ("down", "dW", 16384, "torch_grouped_mm"), ("down", "dW", 16384, "cublas_loop"),
        ("gate_up", "dA", 16384, "cublas_loop"), ("down", "fwd", 4096, "torch_grouped_mm"),
        ("layer", "fwd+bwd", 4096, "hf_grouped_mm"), ("layer", "fwd+bwd", 4096, "torch_layer")}
    assert got["down", "dW", 4096, "torch_grouped_mm"].met
    assert got["down", "dW", 4096, "cublas_loop"].met
    capped = got["gate_up", "dW", 16384, "torch_grouped_mm"]
    assert capped.met and capped.ratio < 1.10 and "95% of the bf16 roof" in capped.target
    assert got["gate_up", "dW", 16384, "cublas_loop"].met
    assert got["down", "dW", 16384, "torch_grouped_mm"].met
    slower = got["down", "dW", 16384, "cublas_loop"]
    assert not slower.met and slower.target == ">= 1.00x"
    d_a = got["gate_up", "dA", 16384, "cublas_loop"]
    assert not d_a.met and d_a.ratio < 1.0  # 1.2x torch, slower than the loop
    assert got["down", "fwd", 4096, "torch_grouped_mm"].met
    assert got["layer", "fwd+bwd", 4096, "hf_grouped_mm"].met
    heavy = got["layer", "fwd+bwd", 4096, "torch_layer"]
    assert not heavy.met and heavy.ratio >= 1.10 and "peak memory" in heavy.target
    text = targets.render_training_markdown(targets.verdicts(result))
    assert text.startswith("**7 of 10 met, 3 missed.**")
    assert "| qwen3-30b-a3b | layer | fwd+bwd | 4096 | uniform | 10.000 | torch_layer 12.000 " \
           "| 1.20x |" in text
    assert "| 5.00 / 4.00 | **no** |" in text


def test_targets_command_on_a_training_run(tmp_path, capsys):
    result = {"suite": "training", "device": "NVIDIA H200",
              "roofs": {"hbm_read_tbps": 4.0, "bf16_dense_tflops": 800.0},
              "cases": [_rec("down", "dW", 4096, "ts_moe", 1.0, 500),
                        _rec("down", "dW", 4096, "torch_grouped_mm", 1.2, 417)]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(result))
    assert cli.main(["targets", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("**1 of 1 met, 0 missed.**") and "| down | dW | 4096 |" in out
    path.write_text(json.dumps({**result, "cases": result["cases"][1:]}))
    with pytest.raises(SystemExit) as exc:
        cli.main(["targets", str(path)])
    assert exc.value.code == 2
    assert "hf_grouped_mm, torch_layer" in capsys.readouterr().err
