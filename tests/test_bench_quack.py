"""The harness's QuACK peer (``bench.backends.quack``): unavailable with the install hint
where the package is missing, and the call it makes where it is (a stand-in module on
the CPU: QuACK itself needs an sm_90 GPU)."""

import sys
import types

import pytest
import torch

from bench import backends, cases


def _case():
    return cases.make_case(cases.model_named("cpu-qwen3"), "gate_up", 16, "uniform")


def test_missing_package_is_unavailable_with_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "quack", None)  # import -> ImportError
    with pytest.raises(backends.Unavailable, match=r"quack-kernels>=0\.6\.5.*ts-moe\[peers\]"):
        backends.quack(_case(), torch.device("cuda"))
    with pytest.raises(backends.Unavailable, match="needs a CUDA device"):
        backends.quack(_case(), torch.device("cpu"))


def test_the_call_is_varlen_m_over_the_experts_rows(monkeypatch):
    calls = []

    def gemm(a, b, out=None, cu_seqlens_m=None, tuned=True):
        calls.append((cu_seqlens_m.tolist(), tuned))
        for e in range(b.shape[0]):
            lo, hi = cu_seqlens_m[e], cu_seqlens_m[e + 1]
            out[lo:hi] = (a[lo:hi].float() @ b[e].float()).to(out.dtype)
        return out

    interface = types.ModuleType("quack.gemm_interface")
    interface.gemm = gemm
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", interface)
    case = _case()
    inp = backends.make_gemm_inputs(case, torch.device("cpu"))
    run = backends.quack(case, torch.device("cuda"))(inp)
    got = run()
    ends = torch.tensor(case.counts).cumsum(0).tolist()
    assert calls == [([0, *ends], False)]
    want = backends.reference_grouped_gemm(inp, inp.a.dtype)
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    k_grouped = backends.GemmInputs(inp.a.t(), inp.a, inp.offs, inp.counts)
    with pytest.raises(backends.Unavailable, match="row-grouped"):
        backends.quack(case, torch.device("cuda"))(k_grouped)
