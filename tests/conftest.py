import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ts_moe.reference import swiglu, swiglu_backward


def sm90_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


def pytest_collection_modifyitems(config, items):
    if sm90_available():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gpu_machine(monkeypatch):
    """``torch.cuda.is_available()`` True: what a selection is on a machine with CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def cpu_machine(monkeypatch):
    """``torch.cuda.is_available()`` False."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or inf anywhere fails."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class OpRecorder(TorchDispatchMode):
    """The names of the operators that run under it."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.name()))
        return func(*args, **(kwargs or {}))


def counts_to_offs(counts):
    """Cumulative row ends (int32, on the GPU) of rows per expert."""
    return torch.cumsum(torch.as_tensor(counts), 0).to(torch.int32).cuda()


def random_counts(m, e, skew=0.0):
    """``m`` rows over ``e`` experts at random; ``skew``: Zipf popularities."""
    w = torch.rand(e) + 1e-3
    if skew:
        w = torch.arange(1, e + 1, dtype=torch.float).pow(-skew)[torch.randperm(e)]
    idx = torch.multinomial(w, m, replacement=True) if m else torch.zeros(0, dtype=torch.long)
    return torch.bincount(idx, minlength=e)


def swiglu_ref(h):
    """fp32 ``silu(g) * u`` of bf16/fp16 ``h`` (the project's reference)."""
    return swiglu(h.float(), torch.float32)


def swiglu_grad_ref(dy, h):
    """fp32 d(SwiGLU)/dh (the project's reference)."""
    return swiglu_backward(dy, h, torch.float32)
