"""pytest hooks and fixtures only (helpers: tests/helpers.py)."""

import pytest
import torch

from .helpers import sm90_available
from .ptxas import PtxStore


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


@pytest.fixture(scope="session")
def ptx_store(tmp_path_factory):
    """Every kernel build compiled once for the whole session (:class:`PtxStore`)."""
    return PtxStore(tmp_path_factory.mktemp("ptx_store"))
