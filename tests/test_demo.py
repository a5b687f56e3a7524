"""A new user's first steps on a CPU machine: the demo with only the base
dependencies, its arguments, the transformers-free tiny checkpoint, and the
loader's device default and path errors."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ts_moe
from ts_moe import loaders

REPO = Path(__file__).resolve().parents[1]
# run a module as `python -m` would, with transformers unimportable
NO_TRANSFORMERS = ("import runpy, sys; sys.modules['transformers'] = None; "
                   "sys.argv = ['ts_moe'] + sys.argv[1:]; "
                   "runpy.run_module('ts_moe', run_name='__main__')")


def _demo(*args):
    return subprocess.run([sys.executable, "-c", NO_TRANSFORMERS, "demo", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def test_demo_runs_without_transformers():
    proc = _demo("--no-compile", "--tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert "tiny checkpoint: 2 layers loaded, layer 1 -> (7, 64)" in proc.stdout
    err = float(proc.stdout.split("relative error vs fp32 reference ")[1].split()[0])
    assert err < 2e-2
    assert "Failed to initialize NumPy" not in proc.stderr


@pytest.mark.parametrize("tokens", ["0", "-3", "many"])
def test_demo_rejects_bad_token_counts(tokens):
    proc = _demo("--no-compile", "--tokens", tokens)
    assert proc.returncode == 2
    assert "--tokens" in proc.stderr and "positive integer" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("names", ["v4", "v5"])
@pytest.mark.parametrize("shards", [1, 3])
def test_tiny_moe_checkpoint_round_trips(tmp_path, names, shards):
    path = ts_moe.make_tiny_moe_checkpoint(tmp_path / "ckpt", layers=3, hidden=32,
                                           intermediate=48, experts=4, top_k=2, names=names,
                                           shards=shards, seed=5)
    files = list(path.glob("*.safetensors"))
    assert len(files) == 1 if shards == 1 else len(files) >= 3
    assert (path / "model.safetensors.index.json").is_file() == (shards > 1)
    layers = ts_moe.load_mixtral_experts(path, device="cpu")
    assert sorted(layers) == [0, 1, 2]
    for weights in layers.values():
        assert weights["router"].shape == (4, 32) and weights["router"].dtype == torch.bfloat16
        assert weights["gate_up_proj"].shape == (4, 96, 32)
        assert weights["down_proj"].shape == (4, 32, 48)
        assert 0.01 < weights["gate_up_proj"].float().std() < 0.03  # N(0, 0.02)
    # the same seed gives the same values in both namings
    other = ts_moe.make_tiny_moe_checkpoint(tmp_path / "other", layers=3, hidden=32,
                                            intermediate=48, experts=4, top_k=2,
                                            names="v5" if names == "v4" else "v4", seed=5)
    again = ts_moe.load_mixtral_experts(other, layers=[0, 2], device="cpu")
    assert torch.equal(again[0]["router"], layers[0]["router"])  # drawn first in both
    moe = ts_moe.MoE.from_pretrained(path, 1, device="cpu")
    assert moe.top_k == 2 and torch.equal(moe.down_proj, layers[1]["down_proj"])


def test_tiny_moe_checkpoint_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="hidden must be a positive multiple of 8"):
        ts_moe.make_tiny_moe_checkpoint(tmp_path, hidden=60)
    with pytest.raises(ValueError, match="names"):
        ts_moe.make_tiny_moe_checkpoint(tmp_path, names="v6")
    with pytest.raises(ValueError, match="top_k = 3 exceeds experts = 2"):
        ts_moe.make_tiny_moe_checkpoint(tmp_path, experts=2, top_k=3)


def test_loader_device_defaults_to_one_that_exists(tmp_path, monkeypatch):
    path = ts_moe.make_tiny_moe_checkpoint(tmp_path, layers=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loaders.resolve_device(None) == torch.device("cpu")
    weights = ts_moe.load_mixtral_experts(path)[0]
    assert weights["gate_up_proj"].device.type == "cpu"
    assert ts_moe.MoE.from_pretrained(path, 0).router.device.type == "cpu"
    for bad in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="device 'cuda.*no CUDA GPU"):
            ts_moe.load_mixtral_experts(path, device=bad)
        with pytest.raises(ValueError, match="device"):
            ts_moe.MoE.from_pretrained(path, 0, device=bad)
    with pytest.raises(ValueError, match="device 'gpu0' is not a torch device"):
        ts_moe.load_mixtral_experts(path, device="gpu0")


def test_loader_names_a_hub_id_as_not_a_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a local directory.*snapshot_download"):
        ts_moe.load_mixtral_experts("mistralai/Mixtral-8x7B-v0.1", device="cpu")
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        ts_moe.MoE.from_pretrained("Mixtral-8x7B", 0, device="cpu")
