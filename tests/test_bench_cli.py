"""python -m bench: argument parsing, --list, an end-to-end CPU run of a tiny model, and
where runs and reports write (nowhere in the checkout unless a path there is named)."""

import json
import subprocess

import pytest
import torch

from bench import __main__ as cli
from bench import cases, provenance, report

REPO = provenance.REPO

REQUIRED_CASE_KEYS = {"model", "gemm", "T", "routing", "backend", "ms", "tflops", "tbps",
                      "max_rel_err", "status"}


def _resolve(argv):
    parser = cli.build_parser()
    return cli.resolve(parser.parse_args(argv), parser)


@pytest.fixture
def tiny_model(monkeypatch):
    models = dict(cases.MODELS)
    models["tiny"] = cases.Model("tiny", experts=6, hidden=64, inter=48, top_k=2)
    monkeypatch.setattr(cases, "MODELS", models)


def test_defaults_are_the_full_suite(gpu_machine):
    sel = _resolve([])
    assert sel["suite"].name == "grouped_gemm"
    assert sel["models"] == ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"]
    assert sel["T"] == [16, 128, 1024, 4096, 16384]
    assert sel["routing"] == ["uniform", "skewed"]
    assert sel["gemms"] == ["gate_up", "down"]
    assert sel["backends"] == ["torch_grouped_mm", "cublas_grouped", "cublas_loop", "quack",
                               "ts_moe"]


def test_quick_and_explicit_filters(gpu_machine):
    sel = _resolve(["--quick"])
    assert sel["models"] == ["mixtral-8x7b", "qwen3-30b-a3b"]
    assert sel["T"] == [16, 1024, 16384]
    assert sel["routing"] == ["uniform"]
    sel = _resolve(["--quick", "--T", "128", "--routing", "skewed", "--models", "deep"])
    assert (sel["T"], sel["routing"], sel["models"]) == ([128], ["skewed"], ["deepseek-v3"])
    sel = _resolve(["--models", "QWEN3,mixtral", "--gemms", "down",
                    "--backends", "ts_moe,reference"])
    assert sel["models"] == ["qwen3-30b-a3b", "mixtral-8x7b"]
    assert sel["gemms"] == ["down"] and sel["backends"] == ["ts_moe", "reference"]


def test_layer_suite_defaults(gpu_machine):
    sel = _resolve(["--suite", "moe_layer"])
    assert sel["T"] == [1, 16, 128, 1024, 4096, 16384]
    assert sel["backends"] == ["ts_moe", "ts_moe_unfused", "hf_eager", "hf_grouped_mm",
                               "hf_batched_mm"]


@pytest.mark.parametrize("argv", [
    ["--models", "llama"],
    ["--backends", "ts_moe,magic"],
    ["--T", "16,abc"],
    ["--T", "0"],
    ["--routing", "zipf"],
    ["--gemms", "up_down"],
    ["--suite", "attention"],
    ["--weight-layout", "rowmajor"],
    pytest.param(["--device", "cuda"], marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="CUDA is there")),
])
def test_bad_arguments_exit(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _resolve(argv)
    assert exc.value.code == 2


def test_options_parsed():
    args = cli.build_parser().parse_args(
        ["--graphs", "--graph-max-t", "128", "--no-roofs", "--target-ms", "50",
         "--weight-layout", "kmajor", "--seed", "3", "--device", "cpu", "--no-save"])
    assert args.graphs and args.graph_max_t == 128 and args.no_roofs
    assert args.target_ms == 50 and args.weight_layout == "kmajor" and args.seed == 3
    assert args.device == "cpu" and args.no_save
    rep = cli.build_report_parser().parse_args(["bench/results/x.json", "--no-plots"])
    assert rep.json.name == "x.json" and rep.no_plots


def test_list_prints_cases(gpu_machine, capsys):
    assert cli.main(["--list", "--quick", "--gemms", "down"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("backends: torch_grouped_mm")
    assert len(out) == 1 + 2 * 3
    assert out[1] == "mixtral-8x7b down T=16 uniform M=32 N=4096 K=14336 E=8"


def test_cpu_run_writes_json_markdown_plot(tiny_model, tmp_path, capsys):
    md = tmp_path / "RESULTS.md"
    argv = ["--device", "cpu", "--models", "tiny", "--T", "4,32", "--routing", "skewed",
            "--backends", "reference,torch_grouped_mm,cublas_loop,cublas_grouped",
            "--weight-layout", "kmajor", "--target-ms", "1", "--out-dir", str(tmp_path),
            "--results-md", str(md)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err.count("[") >= 4  # one progress line per case
    assert "torch_grouped_mm" in captured.out

    path = tmp_path / "cpu-grouped_gemm-kmajor.json"  # a K-major run: its own stem
    data = json.loads(path.read_text())
    assert set(data) >= {"device", "date", "torch", "cuda", "roofs", "command", "cases",
                         "provenance"}
    assert data["device"] == "cpu" and data["roofs"] is None
    assert data["command"].startswith("python -m bench --device cpu --models tiny")
    assert len(data["cases"]) == 2 * 2 * 4  # gemms x T x backends
    for rec in data["cases"]:
        assert REQUIRED_CASE_KEYS <= set(rec)
        expect = "unavailable" if rec["backend"] == "cublas_grouped" else "ok"
        assert rec["status"] == expect, rec
        assert rec["weight_layout"] == "kmajor"
    assert (tmp_path / "cpu-grouped_gemm-kmajor.png").exists()
    assert "<!-- bench:cpu-grouped_gemm-kmajor begin -->" in md.read_text()

    # report regenerates the section and the plot from the JSON alone, where named
    (tmp_path / "cpu-grouped_gemm-kmajor.png").unlink()
    assert cli.main(["report", str(path), "--results-md", str(md)]) == 0
    assert not (tmp_path / "cpu-grouped_gemm-kmajor.png").exists()  # no --plot-dir
    assert cli.main(["report", str(path), "--plot-dir", str(tmp_path)]) == 0
    assert (tmp_path / "cpu-grouped_gemm-kmajor.png").exists()
    assert md.read_text().count("begin -->") == 1
    out = capsys.readouterr().out
    assert "| tiny | down | 32 | skewed | reference |" in out
    assert f"- {provenance.describe(data)}" in out


def _git_head() -> str | None:
    proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def test_cpu_smoke_run_records_its_provenance(cpu_machine, tmp_path):
    """Commit, tree state, host, GPU (none), driver (none), the package versions and the
    flavour of the DSL compiler this process loads."""
    from importlib.metadata import version

    from csrc_free_kernels.common.kernel_cache import dsl_flavor

    argv = ["--models", "cpu-qwen3", "--T", "16", "--gemms", "down", "--routing", "uniform",
            "--backends", "reference", "--target-ms", "1", "--no-plots",
            "--out-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    prov = json.loads((tmp_path / "cpu-grouped_gemm.json").read_text())["provenance"]
    assert tuple(prov) == provenance.FIELDS
    assert prov["commit"] == _git_head()
    assert prov["dirty"] in ((True, False) if prov["commit"] else (None,))
    assert prov["host"] and prov["gpu"] is None and prov["driver"] is None
    assert prov["torch"] == torch.__version__ and prov["cuda"] == torch.version.cuda
    assert prov["nvidia-cutlass-dsl"] == version("nvidia-cutlass-dsl")
    assert prov["dsl-flavor"] == dsl_flavor() and prov["dsl-flavor"].startswith("cu")
    described = provenance.describe({"provenance": prov})
    assert f"nvidia-cutlass-dsl {prov['nvidia-cutlass-dsl']} ({dsl_flavor()})" in described
    older = {key: value for key, value in prov.items() if key != "dsl-flavor"}
    assert "(flavour not recorded)" in provenance.describe({"provenance": older})


def _status() -> str:
    return subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                          capture_output=True, text=True).stdout


def test_report_writes_nothing_unless_told(capsys):
    """``bench report`` of a committed run prints its section; the checkout is unchanged."""
    before = _status()
    run = next((REPO / "bench" / "results").glob("*-moe_block.json"))
    device = json.loads(run.read_text())["device"]
    assert cli.main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"## moe_block on {device}")
    assert "provenance unknown" not in out and "- commit " in out
    assert _status() == before


def test_gpu_run_writes_outside_the_checkout(gpu_machine, tmp_path, monkeypatch, capsys):
    """Without --out-dir a GPU run's JSON goes to the cache directory, not bench/results."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cli, "run_suite", lambda *a, **k: [])
    monkeypatch.setattr(cli, "measure_roofs", lambda device: {"hbm_read_tbps": 4.0,
                                                              "bf16_dense_tflops": 700.0})
    monkeypatch.setattr(cli, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(cli.provenance, "collect",
                        lambda device, given_commit=None: {"commit": given_commit})
    before = _status()
    assert cli.main(["--models", "qwen3", "--T", "16", "--no-plots"]) == 0
    written = tmp_path / "ts_moe" / "bench" / "nvidia-h200-grouped_gemm.json"
    assert json.loads(written.read_text())["provenance"] == {"commit": None}
    assert f"wrote {written}" in capsys.readouterr().err
    assert report.default_out_dir() == tmp_path / "ts_moe" / "bench"
    assert _status() == before


def test_wrong_result_sets_exit_status(tiny_model, tmp_path, monkeypatch):
    from bench import backends, runner

    def wrong(case, device):
        return lambda inp: lambda: backends.reference_grouped_gemm(inp, inp.a.dtype) + 1

    suite = runner.SUITES["grouped_gemm"]
    patched = runner.Suite(suite.name, suite.make_inputs, suite.reference,
                           lambda: {**suite.backends(), "wrong": wrong}, suite.default_backends)
    monkeypatch.setitem(runner.SUITES, "grouped_gemm", patched)
    monkeypatch.setattr(cli, "SUITES", runner.SUITES)
    argv = ["--device", "cpu", "--models", "tiny", "--T", "4", "--routing", "uniform",
            "--gemms", "down", "--backends", "reference,wrong", "--target-ms", "1", "--no-save"]
    assert cli.main(argv) == 1


def test_cpu_machine_runs_the_smoke_suite(cpu_machine, capsys):
    """Without CUDA: say so before any work, and run small models in seconds."""
    sel = _resolve(["--quick"])
    assert sel["models"] == list(cases.SMOKE_MODELS) and sel["T"] == list(cases.SMOKE_T)
    assert _resolve([])["models"] == list(cases.SMOKE_MODELS)
    sel = _resolve(["--models", "mixtral", "--T", "16"])  # named: the user's choice wins
    assert sel["models"] == ["mixtral-8x7b"] and sel["T"] == [16]
    assert cli.main(["--quick", "--no-save", "--gemms", "down", "--target-ms", "1"]) == 0
    captured = capsys.readouterr()
    notice = captured.err.splitlines()[0]
    assert notice.startswith("python -m bench: no CUDA device; running 4 cases of cpu-mixtral")
    assert "reference path, not of the kernels" in notice
    assert captured.out.count(" ok") >= 4 * 3  # reference-path backends ran on every case
    cli.main(["--list", "--models", "mixtral", "--T", "16"])
    assert "no CUDA device" not in capsys.readouterr().err  # --list runs nothing


def test_cpu_machine_warns_about_h200_sized_models(cpu_machine, capsys, monkeypatch):
    monkeypatch.setattr(cli, "run_suite", lambda *args, **kwargs: [])
    monkeypatch.setattr(cli.report, "add_ratios", lambda records: None)
    monkeypatch.setattr(cli.report, "render_text", lambda records: "")
    cli.main(["--models", "deepseek", "--T", "16", "--no-save"])
    assert "deepseek-v3 is sized for an H200" in capsys.readouterr().err


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("report", "targets", "overhead"):
        assert f"  {name} " in out


@pytest.mark.parametrize("sub", ["report", "targets", "overhead"])
def test_subcommand_help_runs_nothing(sub, capsys, monkeypatch):
    from bench import overhead

    monkeypatch.setattr(overhead, "measure", lambda *a: pytest.fail("overhead ran"))
    with pytest.raises(SystemExit) as exc:
        cli.main([sub, "--help"])
    assert exc.value.code == 0
    assert f"usage: python -m bench {sub}" in capsys.readouterr().out


def test_targets_of_a_missing_file_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["targets", "no-such-run.json"])
    assert exc.value.code == 2 and "no such file" in capsys.readouterr().err


def test_overhead_without_cuda_says_so(cpu_machine, capsys):
    assert cli.main(["overhead"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["k_sweep.py", "profile_case.py", "make_tiny_mixtral.py",
                                    "profile_nsys.sh", "prefetch_ab.py", "router_ab.py",
                                    "gather_ab.py"])
def test_scripts_run_as_the_readme_writes_them(script):
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / script
    assert os.access(path, os.X_OK), f"{script} is not executable"
    if script.endswith(".py"):
        env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        proc = subprocess.run([str(path), "--help"], capture_output=True, text=True, env=env,
                              cwd=path.parent.parent, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr


def test_cpu_notice_comes_first_and_names_the_smoke_suite(cpu_machine, capsys, monkeypatch):
    """The notice is the first line, before any case runs; nothing is saved by default."""
    monkeypatch.setattr(cli.report, "write_json",
                        lambda *a: pytest.fail("a CPU run saved into bench/results"))
    seen = []
    real_run_suite = cli.run_suite

    def run_suite(*args, **kwargs):
        seen.append(capsys.readouterr().err)  # what was said before the first case
        records = real_run_suite(*args, **kwargs)
        seen.append(records)
        return records

    monkeypatch.setattr(cli, "run_suite", run_suite)
    assert cli.main(["--gemms", "gate_up", "--routing", "uniform", "--target-ms", "1"]) == 0
    before, records = seen
    assert before.count("\n") == 1 and before.startswith("python -m bench: no CUDA device; ")
    assert "running 4 cases of cpu-mixtral, cpu-qwen3 at T=16,128 on the CPU" in before
    assert "the CPU smoke suite instead of the H200-sized cases" in before
    assert "not saved (--out-dir or --results-md to save)" in before
    assert len(records) == 4 * 5  # cases x default backends
    status = {r["backend"]: r["status"] for r in records}
    assert status == {"torch_grouped_mm": "ok", "cublas_grouped": "unavailable",
                      "cublas_loop": "ok", "quack": "unavailable", "ts_moe": "ok"}
    assert all("needs a CUDA device" in r["reason"] for r in records if r["backend"] == "quack")
    assert all(r["ms"] > 0 for r in records if r["status"] == "ok")
    assert "wrote" not in capsys.readouterr().err


def test_cpu_defaults_are_the_smoke_suite_in_both_suites(cpu_machine):
    for argv in ([], ["--suite", "moe_layer"], ["--device", "cpu"]):
        sel = _resolve(argv)
        assert sel["models"] == ["cpu-mixtral", "cpu-qwen3"] and sel["T"] == [16, 128], argv
        assert sel["routing"] == ["uniform", "skewed"]
        assert sel["smoke"] == ["models", "token counts"]
    assert _resolve(["--models", "cpu-q"])["smoke"] == ["token counts"]
    assert _resolve(["--T", "4"])["smoke"] == ["models"]
    assert _resolve(["--models", "cpu-m", "--T", "4"])["smoke"] == []
    cases_ = cli.make_cases(cli.build_parser().parse_args([]), _resolve([]))
    assert max(c.M * c.N * c.K for c in cases_) <= 256 * 1024 * 256  # CPU-sized


def test_cpu_smoke_models_are_small_and_named_everywhere(gpu_machine):
    """The smoke models resolve on a GPU machine too (a CPU-sized run on purpose)."""
    assert _resolve(["--models", "cpu-mixtral,cpu-qwen3"])["models"] == ["cpu-mixtral",
                                                                        "cpu-qwen3"]
    assert _resolve([])["smoke"] == []
    for m in cases.SMOKE_MODELS.values():
        assert m.hidden * m.inter * m.experts <= 8 * 256 * 512
    with pytest.raises(SystemExit):  # "cpu" alone is ambiguous
        _resolve(["--models", "cpu"])


def test_cpu_partial_selection_and_list(cpu_machine, capsys):
    assert cli.main(["--list", "--models", "cpu-q"]) == 0
    captured = capsys.readouterr()
    assert "the CPU smoke suite's token counts" in captured.err
    assert captured.out.splitlines()[1] == "cpu-qwen3 gate_up T=16 uniform M=64 N=128 K=128 E=16"
    assert cli.main(["--list"]) == 0
    assert "the CPU smoke suite's models and token counts" in capsys.readouterr().err


def test_cpu_run_saves_where_named(cpu_machine, tmp_path, capsys):
    argv = ["--models", "cpu-qwen3", "--T", "16", "--gemms", "down", "--routing", "uniform",
            "--backends", "reference", "--target-ms", "1", "--no-plots"]
    assert cli.main([*argv, "--out-dir", str(tmp_path / "out")]) == 0
    assert "not saved" not in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["cpu-grouped_gemm.json"]
    md = tmp_path / "md" / "R.md"
    md.parent.mkdir()
    assert cli.main([*argv, "--results-md", str(md)]) == 0
    assert (tmp_path / "md" / "cpu-grouped_gemm.json").is_file() and md.is_file()


def test_cpu_layer_suite_smoke_run(cpu_machine, capsys, monkeypatch):
    """One moe_layer smoke case with the suite's default backends ends cleanly."""
    seen = []
    real_run_suite = cli.run_suite
    monkeypatch.setattr(cli, "run_suite",
                        lambda *a, **k: seen.extend(real_run_suite(*a, **k)) or seen)
    assert cli.main(["--suite", "moe_layer", "--models", "cpu-qwen3", "--T", "16",
                     "--routing", "uniform", "--target-ms", "1", "--no-save"]) == 0
    assert [r["backend"] for r in seen] == list(cli.SUITES["moe_layer"].default_backends)
    for r in seen:
        ok = r["status"] == "ok" or (r["backend"].startswith("hf_")
                                     and r["status"] == "unavailable")
        assert ok, r
    assert seen[0]["status"] == "ok"  # ts_moe runs its reference path on the CPU


def test_cpu_run_of_h200_models_warns(cpu_machine, capsys, monkeypatch):
    monkeypatch.setattr(cli, "run_suite", lambda *args, **kwargs: [])
    monkeypatch.setattr(cli.report, "render_text", lambda records: "")
    cli.main(["--models", "qwen3-30b,deep", "--no-save"])
    notice = capsys.readouterr().err
    assert "qwen3-30b-a3b, deepseek-v3 are sized for an H200" in notice
    assert "at T=16,128 on the CPU (the CPU smoke suite's token counts)" in notice


def test_a_mistyped_subcommand_is_named(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["reprot", "x.json"])
    assert exc.value.code == 2
    assert "no subcommand 'reprot'; the subcommands are report, targets, overhead" in \
        capsys.readouterr().err


def _run_json(tmp_path, **changes) -> str:
    path = tmp_path / "run.json"
    result = {"suite": "grouped_gemm", "device": "cpu", "roofs": None, "cases": [],
              **changes}
    path.write_text(json.dumps(result))
    return str(path)


@pytest.mark.parametrize("sub", ["report", "targets"])
@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{", "is not a run's JSON"),
    ("[1, 2]", "is not a run's JSON"),
])
def test_subcommands_on_a_bad_file_are_usage_errors(sub, content, message, tmp_path, capsys):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        cli.main([sub, str(path), *(["--no-plots"] if sub == "report" else [])])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("changes, message", [
    ({"suite": "moe_layer"},
     "targets are for grouped_gemm, training, moe_block and fp8 runs, not 'moe_layer'"),
    ({}, "no measured roofs (a CPU run, or one with --no-roofs)"),
    ({"roofs": {"hbm_read_tbps": 4.0}}, "no case has ts_moe and a peer"),
])
def test_targets_says_why_a_run_has_none(changes, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["targets", _run_json(tmp_path, **changes)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("calls", ["0", "5000"])
def test_overhead_calls_are_checked(calls, capsys, monkeypatch):
    from bench import overhead

    monkeypatch.setattr(overhead, "measure", lambda *a: pytest.fail("overhead ran"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["overhead", "--calls", calls])
    assert exc.value.code == 2 and "--calls" in capsys.readouterr().err


def _script(name: str, *args, env_extra=None):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               **(env_extra or {}))
    return subprocess.run([str(root / "scripts" / name), *args], capture_output=True, text=True,
                          env=env, cwd=root, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there")
@pytest.mark.parametrize("script, args", [
    ("k_sweep.py", ["--experts", "256", "--rows", "512", "--n", "7168",
                    "--k", "512,1024,2048,4096"]),
    ("profile_case.py", ["deepseek", "gate_up", "16384", "skewed", "ts_moe",
                         "torch_grouped_mm"]),
    ("prefetch_ab.py", ["--T", "1"]),
    ("router_ab.py", ["--T", "1"]),
    ("gather_ab.py", ["--T", "16"]),
])
def test_scripts_without_cuda_say_so_in_one_line(script, args):
    proc = _script(script, *args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"scripts/{script}: needs a CUDA GPU")
    assert proc.stderr.endswith("torch sees none here\n")


@pytest.mark.parametrize("script, args, message", [
    ("k_sweep.py", ["--experts", "8", "--rows", "64", "--n", "256", "--k", "512"],
     "need two or more different K"),
    ("k_sweep.py", ["--experts", "8", "--rows", "64", "--n", "256", "--k", "512,x"],
     "argument --k"),
    ("profile_case.py", ["mixtral", "gate", "16", "skewed", "ts_moe"], "gemm 'gate'"),
    ("profile_case.py", ["mixtral", "down", "16", "skewed", "magic"], "unknown backends"),
    ("profile_case.py", ["llama", "down", "16", "skewed", "ts_moe"], "model 'llama'"),
])
def test_script_usage_errors_need_no_gpu(script, args, message):
    proc = _script(script, *args)
    assert proc.returncode == 2 and message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_scripts_name_a_python_without_torch(tmp_path):
    """The shebang's python3 may not be the project's: say so, not a traceback."""
    (tmp_path / "torch.py").write_text("raise ImportError(\"No module named 'torch'\")\n")
    proc = _script("k_sweep.py", "--help", env_extra={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "run it with the Python that ts_moe is installed in" in proc.stderr
