"""The grouped_gemm suite's cases under pytest-benchmark (GPU only).

    pytest tests/test_bench_pytest_benchmark.py -k "qwen3 and T1024" --benchmark-only

One test per (case, backend) of the full suite, ids like
``mixtral-8x7b-gate_up-T16-uniform-ts_moe``.  Each call is followed by a
``torch.cuda.synchronize()`` so the wall-clock time pytest-benchmark takes
covers the GPU work; inputs rotate among the same copies as ``python -m bench``.
Every backend is checked against the reference before it is timed.
"""

import itertools

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from bench import backends, cases  # noqa: E402
from bench.runner import SUITES, Settings, check, prepare_inputs  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# keys only: the routing of a case is drawn in the test, not at collection
KEYS = [(m, g, t, r) for m in cases.MODELS for g in cases.GEMMS for r in cases.ROUTINGS
        for t in cases.GEMM_T]


@pytest.fixture(scope="module")
def inputs_cache():
    """The inputs of the most recent case, so its backends share them; one case at a time."""
    cache = {}
    yield cache
    cache.clear()


def _inputs(cache, case):
    if cache.get("case") != case:
        cache.clear()
        torch.cuda.empty_cache()
        settings = Settings(torch.device("cuda"))
        cache["ref"], cache["copies"] = prepare_inputs(SUITES["grouped_gemm"], case, settings)
        cache["case"] = case
    return cache["ref"], cache["copies"]


@pytest.mark.parametrize("backend", backends.DEFAULT_BACKENDS)
@pytest.mark.parametrize("key", KEYS, ids=lambda k: f"{k[0]}-{k[1]}-T{k[2]}-{k[3]}")
def test_grouped_gemm(benchmark, inputs_cache, key, backend):
    model, gemm, T, routing = key
    case = cases.make_case(cases.MODELS[model], gemm, T, routing)
    ref, copies = _inputs(inputs_cache, case)
    try:
        bind = backends.BACKENDS[backend](case, torch.device("cuda"))
    except (ImportError, backends.Unavailable) as exc:
        pytest.skip(f"{backend} unavailable: {exc}")
    runs = [bind(inp) for inp in copies]
    err = check(runs, ref)
    assert err <= 1e-2, f"{backend} is wrong: relative error {err:.3g}"
    rotation = itertools.cycle(runs)

    def call():
        next(rotation)()
        torch.cuda.synchronize()

    benchmark.group = "-".join(map(str, key))
    benchmark.extra_info.update(case.key())
    benchmark.pedantic(call, rounds=20, iterations=1, warmup_rounds=3)
