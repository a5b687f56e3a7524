"""The harness on a GPU: every grouped-GEMM backend right on small real shapes,
eager and graphed; the roofs are plausible.  Skipped without CUDA."""

import pytest
import torch

from bench import backends, cases
from bench.roofs import measure_roofs
from bench.runner import SUITES, Settings, run_suite

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# cublas_grouped needs nvmath-python and cuBLAS >= 12.5: allowed to be unavailable
MUST_RUN = {"reference", "torch_grouped_mm", "cublas_loop", "ts_moe"}


def _small_cases(layout):
    qwen = cases.MODELS["qwen3-30b-a3b"]
    return [cases.make_case(qwen, g, T, "skewed", weight_layout=layout)
            for g in cases.GEMMS for T in (16, 1024)]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("layout", cases.WEIGHT_LAYOUTS)
def test_every_backend_right(layout, graphs):
    settings = Settings(torch.device("cuda"), target_ms=5.0, graphs=graphs)
    records = run_suite(SUITES["grouped_gemm"], _small_cases(layout), list(backends.BACKENDS),
                        settings)
    for r in records:
        assert r["status"] in ("ok", "unavailable"), r
        if r["status"] == "ok":
            assert r["max_rel_err"] <= 1e-2 and r["ms"] > 0
            assert r["graphed"] == graphs
            assert r["copies"] >= 2
    assert MUST_RUN <= {r["backend"] for r in records if r["status"] == "ok"}


def test_roofs_plausible():
    roofs = measure_roofs(torch.device("cuda"))
    assert 0.5 < roofs["hbm_read_tbps"] < 20
    assert 50 < roofs["bf16_dense_tflops"] < 5000
