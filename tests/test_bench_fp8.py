"""The fp8 suite and the moe_block FP8 mode on the CPU: cases (a recipe per case),
FP8 byte counts and the FP8 roof, inputs, every backend checked against the float64
reference on the same quantized inputs, a CPU smoke run through ``python -m bench``,
and the FP8 targets."""

import json

import pytest
import torch

from bench import __main__ as cli
from bench import cases, fp8, moe_block, runner, targets
from bench.cases import Model
from bench.roofs import measure_fp8_roof, roof_fraction

CPU = runner.Settings(torch.device("cpu"), target_ms=1.0)
SUITE = runner.SUITES["fp8"]
TINY = Model("tiny-fp8", experts=6, hidden=256, inter=128, top_k=2)


def _resolve(argv):
    parser = cli.build_parser()
    return cli.resolve(parser.parse_args(argv), parser)


def test_suite_registered_with_its_defaults(gpu_machine):
    sel = _resolve(["--suite", "fp8"])
    assert sel["suite"] is SUITE
    assert sel["models"] == ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"]
    assert sel["T"] == [1, 16, 128, 1024, 4096, 16384]
    assert sel["routing"] == ["uniform", "skewed"] and sel["gemms"] == ["gate_up", "down"]
    assert sel["backends"] == list(fp8.DEFAULT_BACKENDS)


def test_cases_carry_their_recipe_and_skip_partial_blocks():
    got = fp8.fp8_cases(["cpu-qwen3"], [128, 16], ["gate_up", "down"], ["uniform"])
    assert [(c.gemm, c.step, c.T) for c in got] == [
        ("gate_up", "blockwise", 16), ("gate_up", "blockwise", 128),
        ("gate_up", "rowwise", 16), ("gate_up", "rowwise", 128),
        ("down", "rowwise", 16), ("down", "rowwise", 128)]  # down: K = I = 64
    assert all(c.weight_layout == "kmajor" for c in got)
    assert got[0].key() == {"model": "cpu-qwen3", "gemm": "gate_up", "T": 16,
                            "routing": "uniform", "step": "blockwise"}


@pytest.mark.parametrize("recipe", cases.FP8_RECIPES)
def test_fp8_bytes_and_the_fp8_roof(recipe):
    case = cases.make_case(TINY, "gate_up", 40, "skewed", weight_layout="kmajor", step=recipe)
    n, k, m, touched = case.N, case.K, case.M, case.touched_experts
    w_scales = (n // 128) * (k // 128) if recipe == "blockwise" else n
    a_scales = m * (k // 128) if recipe == "blockwise" else m
    assert cases.bytes_moved(case) == (touched * (n * k + 4 * w_scales) + m * k + 4 * a_scales
                                       + 2 * m * n)
    assert cases.flops(case) == 2 * m * n * k
    record = runner.case_record(case)
    assert record["flop_roof"] == "fp8_dense_tflops"
    assert "flop_roof" not in runner.case_record(cases.make_case(TINY, "gate_up", 40, "skewed"))
    roofs = {"hbm_read_tbps": 4.0, "bf16_dense_tflops": 800.0, "fp8_dense_tflops": 1600.0}
    assert roof_fraction(2.0, int(3.2e12), 1, roofs, "fp8_dense_tflops") == (
        pytest.approx(1.0), "flop")
    assert roof_fraction(2.0, 1, 1, {"hbm_read_tbps": 4.0, "bf16_dense_tflops": 800.0},
                         "fp8_dense_tflops") == (None, None)  # no FP8 roof measured
    assert measure_fp8_roof(torch.device("cpu"), 64) > 0


@pytest.mark.parametrize("recipe", cases.FP8_RECIPES)
def test_inputs_quantized_k_major_and_cloned_in_their_layouts(recipe):
    import ts_moe
    case = cases.make_case(TINY, "down", 24, "uniform", weight_layout="kmajor", step=recipe)
    inp = fp8.make_fp8_inputs(case, torch.device("cpu"))
    assert inp.a.dtype == inp.b.dtype == torch.float8_e4m3fn
    assert inp.b.shape == (6, 128, 256) and inp.b.stride(1) == 1  # K-major
    assert inp.a_bf16.dtype == inp.b_bf16.dtype == torch.bfloat16
    out = ts_moe.scaled_grouped_gemm(inp.a, inp.b, inp.scale_a, fp8.RECIPES[recipe][0],
                                     inp.scale_b, fp8.RECIPES[recipe][1], inp.offs)
    ref = fp8.reference_fp8(inp)
    assert runner.rel_err(out, ref) <= 1e-2
    assert runner.rel_err(ts_moe.grouped_gemm(inp.a_bf16, inp.b_bf16, inp.offs), ref) <= 1e-2
    copy = inp.clone()
    for a, b in ((copy.a, inp.a), (copy.b, inp.b), (copy.scale_a, inp.scale_a)):
        assert a.data_ptr() != b.data_ptr() and a.stride() == b.stride()
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)


def test_backends_checked_then_timed_and_a_wrong_one_flagged():
    factories = fp8.fp8_backends()
    factories["wrong"] = lambda case, device: lambda inp: lambda: fp8.reference_fp8(
        inp, torch.bfloat16) * 1.5
    names = [*fp8.DEFAULT_BACKENDS, "reference", "wrong"]
    case_list = [cases.make_case(TINY, g, 24, "skewed", weight_layout="kmajor", step=r)
                 for g in ("gate_up", "down") for r in cases.FP8_RECIPES]
    records = runner.run_suite(SUITE, case_list, names, CPU, factories=factories)
    by = {(r["gemm"], r["step"], r["backend"]): r for r in records}
    for (gemm, recipe, backend), r in by.items():
        if backend == "wrong":
            assert r["status"] == "wrong" and r["max_rel_err"] == pytest.approx(0.5, rel=1e-2)
        elif backend in ("torch_scaled_grouped_mm", "F_scaled_grouped_mm"):
            assert r["status"] == "unavailable" and "CUDA" in r["reason"]
        else:
            assert r["status"] == "ok" and r["max_rel_err"] <= 1e-2 and r["ms"] > 0, r
            assert r["flop_roof"] == "fp8_dense_tflops"
    # each torch FP8 peer only on the recipe it takes
    assert ("gate_up", "rowwise", "torch_scaled_grouped_mm") in by
    assert ("gate_up", "blockwise", "torch_scaled_grouped_mm") not in by
    assert ("gate_up", "rowwise", "F_scaled_grouped_mm") not in by


def test_cpu_smoke_run_writes_the_suite(cpu_machine, tmp_path, capsys):
    argv = ["--suite", "fp8", "--models", "cpu-qwen3", "--T", "16", "--routing", "uniform",
            "--target-ms", "1", "--out-dir", str(tmp_path), "--no-plots"]
    assert cli.main(argv) == 0
    data = json.loads((tmp_path / "cpu-fp8-kmajor.json").read_text())  # the weights K-major
    assert data["suite"] == "fp8"
    steps = {(r["gemm"], r["step"]) for r in data["cases"]}
    assert steps == {("gate_up", "blockwise"), ("gate_up", "rowwise"), ("down", "rowwise")}
    for r in data["cases"]:
        assert r["status"] in ("ok", "unavailable"), r
        assert r["status"] == "ok" or r["backend"] in ("torch_scaled_grouped_mm",
                                                       "F_scaled_grouped_mm")
    assert {"commit", "dirty"} <= set(data["provenance"])
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "cpu-fp8-kmajor.json")]) == 0
    assert "cpu-qwen3 | gate_up blockwise | 16" in capsys.readouterr().out


def test_moe_block_fp8_mode_checks_each_backend_against_its_own_reference():
    factories = moe_block.block_backends()
    names = ["ts_moe", "ts_moe_fp8_rowwise", "ts_moe_fp8_blockwise"]
    case_list = [moe_block.block_case(TINY, T) for T in (1, 8)]
    records = runner.run_suite(runner.SUITES["moe_block"], case_list, names, CPU,
                               factories=factories)
    assert [r["backend"] for r in records] == names * 2
    for r in records:
        assert r["status"] == "ok" and r["max_rel_err"] <= 1e-2, r
    # the FP8 block is not the bf16 one: checked against the bf16 reference it would fail
    inp = moe_block.make_block_inputs(case_list[1], torch.device("cpu"))
    fp8_out = factories["ts_moe_fp8_blockwise"](case_list[1], CPU.device)(inp)()
    assert runner.rel_err(fp8_out, moe_block.reference_block(inp)) > 1e-2
    # blockwise needs H and I in whole 128-blocks
    small = moe_block.block_case(cases.SMOKE_MODELS["cpu-qwen3"], 1)
    assert not runner.applies(factories["ts_moe_fp8_blockwise"], small)
    assert runner.applies(factories["ts_moe_fp8_rowwise"], small)


def _rec(backend, ms, T=16, step="blockwise", **kw):
    return {"model": "deepseek-v3", "gemm": "gate_up", "T": T, "routing": "uniform",
            "step": step, "backend": backend, "status": "ok", "ms": ms, "tbps": 1.0,
            "tflops": 1.0, **kw}


@pytest.mark.parametrize("records, met", [
    ([_rec("ts_moe_fp8", 1.0, roof_frac=0.5, bound="hbm"), _rec("ts_moe_bf16", 1.9)], True),
    ([_rec("ts_moe_fp8", 1.0, roof_frac=0.92, bound="hbm"), _rec("ts_moe_bf16", 1.2)], True),
    ([_rec("ts_moe_fp8", 1.0, roof_frac=0.85, bound="hbm"), _rec("ts_moe_bf16", 1.7)], False),
])
def test_fp8_decode_target(records, met):
    (v,) = targets.judge_fp8(records)
    assert v.met is met and v.step == "blockwise" and v.peer == "ts_moe_bf16"


def test_fp8_large_targets_per_recipe():
    block = [_rec("ts_moe_fp8", 1.0, T=4096), _rec("ts_moe_bf16", 1.7, T=4096),
             _rec("F_scaled_grouped_mm", 0.95, T=4096)]
    assert [(v.peer, v.met) for v in targets.judge_fp8(block)] == [
        ("ts_moe_bf16", True), ("F_scaled_grouped_mm", False)]
    row = [_rec("ts_moe_fp8", 1.0, T=16384, step="rowwise"),
           _rec("torch_scaled_grouped_mm", 1.15, T=16384, step="rowwise"),
           _rec("ts_moe_bf16", 1.2, T=16384, step="rowwise")]
    assert [(v.peer, v.met) for v in targets.judge_fp8(row)] == [
        ("torch_scaled_grouped_mm", True)]
    assert targets.judge_fp8([_rec("ts_moe_fp8", 1.0, T=1024)]) == []
    result = {"suite": "fp8", "cases": block + row, "roofs": None}
    assert len(targets.verdicts(result)) == 3
    assert "**2 of 3 met, 1 missed.**" in targets.render_training_markdown(targets.verdicts(result))


def test_fp8_block_graph_bound():
    r = {"model": "mixtral-8x7b", "gemm": "block", "T": 1, "routing": "router",
         "backend": "ts_moe_fp8_rowwise", "status": "ok", "ms": 0.3, "graph_ms": 0.1,
         "tbps": 1.0, "tflops": 1.0}
    (v,) = targets.judge_block_fp8([r])
    assert v.met and v.peer_ms == 0.11 and v.step == "graph ts_moe_fp8_rowwise"
    assert not targets.judge_block_fp8([{**r, "graph_ms": 0.12}])[0].met
    assert targets.verdicts({"suite": "moe_block", "cases": [r]})[-1].step.startswith("graph")
