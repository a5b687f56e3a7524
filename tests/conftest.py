"""pytest hooks and fixtures only (helpers: tests/helpers.py)."""

import dataclasses
import json
import pathlib

import pytest
import torch

from .helpers import sm90_available
from .ptxas import PtxStore


def pytest_addoption(parser):
    parser.addoption("--keep-ptx", metavar="DIR",
                     help="keep the PTX and pre-flight facts of every build the session "
                          "compiles in DIR (new or empty), with the toolchain that compiled "
                          "them, for scripts/compare_ptx.py")


def pytest_configure(config):
    keep = config.getoption("--keep-ptx")
    if keep and pathlib.Path(keep).exists() and any(pathlib.Path(keep).iterdir()):
        raise pytest.UsageError(f"--keep-ptx {keep}: the directory is not empty")


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
def ptx_store(tmp_path_factory, pytestconfig):
    """Every kernel build compiled once for the whole session (:class:`PtxStore`), in
    ``--keep-ptx DIR`` if given."""
    keep = pytestconfig.getoption("--keep-ptx")
    if not keep:
        return PtxStore(tmp_path_factory.mktemp("ptx_store"))
    from ts_moe import toolchain

    directory = pathlib.Path(keep).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "toolchain.json").write_text(json.dumps(
        dataclasses.asdict(toolchain.current())))
    return PtxStore(directory)
