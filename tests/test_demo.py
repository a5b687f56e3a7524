"""A new user's first steps on a CPU machine: the demo with only the base
dependencies, its arguments, the transformers-free tiny checkpoint, and the
loader's device default and path errors."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ts_moe
from ts_moe import __main__ as demo_main
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
    assert "compiling" not in proc.stdout  # --no-compile
    assert "Failed to initialize NumPy" not in proc.stderr


@pytest.fixture
def cpu_demo(monkeypatch):
    """The demo in this process as on a machine without CUDA, with the sm_90a
    build (a subprocess of ~20 s) replaced by a recorder."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from csrc_free_kernels import ptx_dump

    builds = []

    def fake_dump(arch, names, out_dir, timeout=600):
        builds.append((arch, list(names)))
        return {n: "wgmma.mma_async cp.async.bulk.tensor expect_tx" for n in names}

    monkeypatch.setattr(ptx_dump, "dump", fake_dump)
    return builds


def test_demo_compiles_the_kernels_unless_told_not_to(cpu_demo, capsys):
    assert demo_main.main(["demo", "--tokens", "4"]) == 0
    assert len(cpu_demo) == 1 and cpu_demo[0][0] == "sm_90a"
    assert "swiglu_decode" in cpu_demo[0][1] and "gemm_decode" in cpu_demo[0][1]
    assert "kernel configurations for sm_90a" in capsys.readouterr().out
    assert demo_main.main(["demo", "--tokens", "4", "--no-compile"]) == 0
    assert len(cpu_demo) == 1  # not built again
    assert "compiling" not in capsys.readouterr().out


@pytest.mark.parametrize("wrong,shown", [
    (lambda out: 2 * out, "by 1.00e+00 (relative)"),
    (lambda out: torch.full_like(out, float("nan")), "by nan (relative)"),
])
def test_demo_says_what_failed(cpu_demo, capsys, monkeypatch, wrong, shown):
    real = demo_main.moe_forward
    monkeypatch.setattr(demo_main, "moe_forward", lambda *a: wrong(real(*a)))
    assert demo_main.main(["demo", "--tokens", "4", "--no-compile"]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "fp32 per-token reference" in err
    assert f"tolerance {demo_main.TOLERANCE:.0e}" in err
    assert shown in err
    assert not cpu_demo  # failed before the build


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
    written = {k: v for f in files for k, v in load_file(f).items()}
    assert all(t.dtype == torch.bfloat16 for t in written.values())
    assert len(written) == 3 * (1 + 3 * 4 if names == "v4" else 3)  # nothing but the MoE tensors
    layers = ts_moe.load_mixtral_experts(path, device="cpu")
    assert sorted(layers) == [0, 1, 2]
    for layer, weights in layers.items():
        assert weights["router"].shape == (4, 32)
        assert weights["gate_up_proj"].shape == (4, 96, 32)
        assert weights["down_proj"].shape == (4, 32, 48)
        assert all(t.dtype == torch.bfloat16 for t in weights.values())
        assert 0.01 < weights["gate_up_proj"].float().std() < 0.03  # N(0, 0.02)
        if names == "v4":
            p = f"model.layers.{layer}.block_sparse_moe."
            assert torch.equal(weights["router"], written[p + "gate.weight"])
            for e in range(4):
                w1, w2, w3 = (written[f"{p}experts.{e}.{w}.weight"] for w in ("w1", "w2", "w3"))
                assert torch.equal(weights["gate_up_proj"][e, :48], w1)  # gate rows first
                assert torch.equal(weights["gate_up_proj"][e, 48:], w3)  # then up
                assert torch.equal(weights["down_proj"][e], w2)
        else:
            p = f"model.layers.{layer}.mlp."
            assert torch.equal(weights["router"], written[p + "gate.weight"])
            assert torch.equal(weights["gate_up_proj"], written[p + "experts.gate_up_proj"])
            assert torch.equal(weights["down_proj"], written[p + "experts.down_proj"])
    assert not torch.equal(layers[0]["down_proj"], layers[1]["down_proj"])
    # the same seed gives the same weights in the other naming
    other = ts_moe.make_tiny_moe_checkpoint(tmp_path / "other", layers=3, hidden=32,
                                            intermediate=48, experts=4, top_k=2,
                                            names="v5" if names == "v4" else "v4", seed=5)
    again = ts_moe.load_mixtral_experts(other, layers=[0, 2], device="cpu")
    for layer in (0, 2):
        for name, tensor in again[layer].items():
            assert torch.equal(tensor, layers[layer][name]), (layer, name)
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
    for bad, why in (("meta", "holds no values"), ("xpu", "no xpu device"),
                     ("cuda:-1", "not a torch device")):
        with pytest.raises(ValueError, match=f"device '{bad}'.*{why}"):
            ts_moe.load_mixtral_experts(path, device=bad)
    assert loaders.resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_default_device_is_cuda_when_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert loaders.resolve_device(None) == torch.device("cuda")
    assert loaders.resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match="device 'cuda:1'.*only 1 CUDA GPU"):
        loaders.resolve_device("cuda:1")


def test_device_is_checked_before_any_file_is_read(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(loaders, "safe_open", lambda *a, **k: pytest.fail("a file was read"))
    with pytest.raises(ValueError, match="device"):
        ts_moe.load_mixtral_experts(tmp_path / "nowhere", device="cuda")


def test_loader_names_a_hub_id_as_not_a_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a local directory.*snapshot_download"):
        ts_moe.load_mixtral_experts("mistralai/Mixtral-8x7B-v0.1", device="cpu")
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        ts_moe.MoE.from_pretrained("Mixtral-8x7B", 0, device="cpu")
    path = ts_moe.make_tiny_moe_checkpoint(tmp_path / "ckpt", layers=1, shards=1)
    with pytest.raises(FileNotFoundError, match="not a local directory.*hf download"):
        ts_moe.load_mixtral_experts(path / "model.safetensors", device="cpu")
    assert list(ts_moe.load_mixtral_experts(path, device="cpu")) == [0]
