import pytest
import torch


def sm90_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


def pytest_collection_modifyitems(config, items):
    if sm90_available():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or inf anywhere fails."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
