"""scripts/generate_latency.py on tiny shapes (CPU): it runs, and its ts_moe
models do run their experts on ts_moe."""

import importlib.util
import pathlib

import pytest
import torch

from .conftest import OpRecorder

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
    assert all(float(r.split("|")[4]) > 0 for r in rows)
