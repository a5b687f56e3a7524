"""scripts/generate_latency.py on tiny shapes (CPU): it runs, and its ts_moe
models do run their experts on ts_moe."""

import importlib.util
import math
import pathlib

import pytest
import torch

from .helpers import OpRecorder

pytest.importorskip("transformers", minversion="5")
SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "generate_latency.py"


def _script():
    spec = importlib.util.spec_from_file_location("generate_latency", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, impl", [("qwen3", "ts_moe"), ("mixtral", "ts_moe"),
                                        ("mixtral", "ts_moe_replace"), ("qwen3", "eager")])
def test_ts_moe_models_run_on_ts_moe(name, impl):
    model = _script().build(name, 1, True, torch.device("cpu"), impl)
    with torch.no_grad(), OpRecorder() as ops:
        model(torch.randint(0, 256, (1, 5)))
    assert ("ts_moe::grouped_gemm_swiglu" in ops.ops) == impl.startswith("ts_moe")


def test_smoke_run_prints_a_row_per_implementation(capsys):
    assert _script().main(["--tiny", "--models", "qwen3", "--layers", "1", "--new-tokens", "3",
                           "--repeats", "1", "--device", "cpu"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| qwen3")]
    assert [r.split("|")[2].strip() for r in rows] == ["eager", "grouped_mm", "batched_mm",
                                                      "ts_moe"]
    # a number per row, not "failed: ..." (its sign is noise at these sizes on a
    # loaded CPU: the difference of two runs of a few ms)
    assert all(math.isfinite(float(r.split("|")[4])) for r in rows)


def test_impls_selects_rows_and_refuses_unknown_names(capsys):
    assert _script().main(["--tiny", "--models", "mixtral", "--layers", "1", "--new-tokens", "3",
                           "--repeats", "1", "--device", "cpu",
                           "--impls", "ts_moe_replace,grouped_mm"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| mixtral")]
    assert [r.split("|")[2].strip() for r in rows] == ["grouped_mm", "ts_moe_replace"]
    with pytest.raises(SystemExit):
        _script().main(["--tiny", "--impls", "ts_moe,vllm", "--device", "cpu"])
    assert "unknown implementations ['vllm']" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # per token needs two lengths with decode steps
        _script().main(["--tiny", "--new-tokens", "2", "--device", "cpu"])
    assert "--new-tokens must be at least 3" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["mixtral", "qwen3"])
def test_ts_moe_experts_compile_fullgraph(name):
    """The compiled mode of the script: ``torch.compile(fullgraph=True)`` traces the
    experts interface's checks (they once imported from transformers inside the
    trace: "Bad import result") and matches eager."""
    model = _script().build(name, 1, True, torch.device("cpu"), "ts_moe")
    tokens = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(tokens).logits
        compiled = torch.compile(model.forward, fullgraph=True)(tokens).logits
    assert torch.allclose(compiled, eager, atol=2e-2, rtol=2e-2)
