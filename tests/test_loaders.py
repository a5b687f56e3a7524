"""load_mixtral_experts on tiny Mixtral checkpoints (ts_moe.tiny) in both namings and layouts."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ts_moe
from ts_moe import checkpoint

transformers = pytest.importorskip("transformers")
from transformers import MixtralForCausalLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
V4 = "model.layers.{}.block_sparse_moe."
V5 = "model.layers.{}.mlp."


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same random model (seed 7, 3 layers) in v4/v5 names, sharded and single-file."""
    root = tmp_path_factory.mktemp("tiny")
    return {(names, shards): ts_moe.make_tiny_mixtral(
                root / f"{names}-{shards}", layers=3, experts=4, top_k=2, names=names,
                shards=shards, seed=7)
            for names in ("v4", "v5") for shards in (1, 3)}


def _state(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A single-file copy of checkpoint ``src`` with ``edit(state_dict)`` applied."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    state = _state(src)
    edit(state)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_tiny_checkpoint_layout(checkpoints):
    for names in ("v4", "v5"):
        sharded = checkpoints[(names, 3)]
        index = json.loads((sharded / "model.safetensors.index.json").read_text())
        shards = set(index["weight_map"].values())
        assert len(shards) >= 3 and all((sharded / s).is_file() for s in shards)
        assert index["metadata"]["total_size"] == sum(
            t.numel() * t.element_size() for t in _state(sharded).values())
        single = checkpoints[(names, 1)]
        assert [p.name for p in single.glob("*.safetensors")] == ["model.safetensors"]
        config = json.loads((single / "config.json").read_text())
        assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
        keys = _state(sharded)
        assert all(t.dtype == torch.bfloat16 for t in keys.values())
        expert_key = {"v4": V4.format(2) + "experts.3.w2.weight",
                      "v5": V5.format(2) + "experts.down_proj"}[names]
        assert expert_key in keys


@pytest.mark.parametrize("names", ["v4", "v5"])
@pytest.mark.parametrize("shards", [1, 3])
def test_loads_the_checkpoint_values_in_fused_layouts(checkpoints, names, shards):
    path = checkpoints[(names, shards)]
    weights = ts_moe.load_mixtral_experts(path, device="cpu")
    assert sorted(weights) == [0, 1, 2]
    model = MixtralForCausalLM.from_pretrained(path).eval()
    state = _state(path)
    for layer, w in weights.items():
        assert w["router"].shape == (4, 64)
        assert w["gate_up_proj"].shape == (4, 256, 64) and w["down_proj"].shape == (4, 64, 128)
        assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in w.values())
        mlp = model.model.layers[layer].mlp
        assert torch.equal(w["router"], mlp.gate.weight)
        assert torch.equal(w["gate_up_proj"], mlp.experts.gate_up_proj)
        assert torch.equal(w["down_proj"], mlp.experts.down_proj)
        if names == "v4":  # gate rows (w1) first, then up (w3); w2 is down
            p = V4.format(layer)
            assert torch.equal(w["gate_up_proj"][1, :128], state[p + "experts.1.w1.weight"])
            assert torch.equal(w["gate_up_proj"][1, 128:], state[p + "experts.1.w3.weight"])
            assert torch.equal(w["down_proj"][3], state[p + "experts.3.w2.weight"])


def test_v4_and_v5_names_load_alike(checkpoints):
    a = ts_moe.load_mixtral_experts(checkpoints[("v4", 3)], device="cpu")
    b = ts_moe.load_mixtral_experts(checkpoints[("v5", 1)], device=torch.device("cpu"))
    for layer in a:
        for name in a[layer]:
            assert torch.equal(a[layer][name], b[layer][name])


@pytest.mark.parametrize("names", ["v4", "v5"])
def test_layer_subset_opens_each_needed_shard_once(checkpoints, names, monkeypatch):
    path = checkpoints[(names, 3)]
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    opened = []
    real_open = checkpoint.ShardFile

    def recording_open(fd, *args, **kwargs):  # the file open at fd, as the kernel names it
        opened.append(Path(checkpoint._opened_path(fd)).name)
        return real_open(fd, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "ShardFile", recording_open)
    weights = ts_moe.load_mixtral_experts(path, layers=[2], device="cpu")
    assert list(weights) == [2]
    prefix = (V4 if names == "v4" else V5).format(2)
    needed = {shard for key, shard in index.items() if key.startswith(prefix)}
    assert sorted(opened) == sorted(needed)
    assert list(ts_moe.load_mixtral_experts(path, layers=1, device="cpu")) == [1]


def test_missing_layer_is_a_key_error(checkpoints):
    with pytest.raises(KeyError, match="layer 5"):
        ts_moe.load_mixtral_experts(checkpoints[("v4", 3)], layers=[0, 5], device="cpu")
    with pytest.raises(TypeError, match="layers"):
        ts_moe.load_mixtral_experts(checkpoints[("v4", 3)], layers=["0"], device="cpu")
    with pytest.raises(FileNotFoundError, match="local directory"):
        ts_moe.load_mixtral_experts(checkpoints[("v4", 3)] / "nowhere", device="cpu")


@pytest.mark.parametrize("names,key", [
    ("v4", V4.format(1) + "experts.2.w3.weight"),
    ("v4", V4.format(1) + "gate.weight"),
    ("v5", V5.format(1) + "experts.gate_up_proj"),
])
def test_missing_key_is_a_key_error_naming_it(checkpoints, tmp_path, names, key):
    path = _rewrite(checkpoints[(names, 3)], tmp_path / "ckpt", lambda s: s.pop(key))
    with pytest.raises(KeyError, match=key.replace(".", r"\.")):
        ts_moe.load_mixtral_experts(path, layers=[1], device="cpu")
    assert list(ts_moe.load_mixtral_experts(path, layers=[0], device="cpu")) == [0]


@pytest.mark.parametrize("names,key,change", [
    ("v4", V4.format(0) + "experts.1.w2.weight", lambda t: t[:, :64]),
    ("v4", V4.format(0) + "gate.weight", lambda t: t[:3]),
    ("v5", V5.format(0) + "experts.down_proj", lambda t: t.transpose(1, 2)),
    ("v5", V5.format(0) + "experts.gate_up_proj", lambda t: t[:, :, :32]),
])
def test_wrong_shape_is_a_value_error_naming_the_key(checkpoints, tmp_path, names, key, change):
    def edit(state):
        state[key] = change(state[key]).contiguous()

    path = _rewrite(checkpoints[(names, 3)], tmp_path / "ckpt", edit)
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + ".*shape"):
        ts_moe.load_mixtral_experts(path, device="cpu")


@pytest.mark.parametrize("names,key,dtype", [
    ("v4", V4.format(2) + "experts.0.w1.weight", torch.float32),
    ("v5", V5.format(2) + "experts.down_proj", torch.float16),
    ("v5", V5.format(2) + "experts.gate_up_proj", torch.int8),
])
def test_wrong_dtype_is_a_value_error_naming_the_key(checkpoints, tmp_path, names, key, dtype):
    def edit(state):
        state[key] = state[key].to(dtype)

    path = _rewrite(checkpoints[(names, 3)], tmp_path / "ckpt", edit)
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + ".*dtype"):
        ts_moe.load_mixtral_experts(path, layers=[2], device="cpu")


@pytest.mark.parametrize("names", ["v4", "v5"])
def test_loads_without_config_json(checkpoints, tmp_path, names):
    path = _rewrite(checkpoints[(names, 1)], tmp_path / "ckpt", lambda s: None)
    (path / "config.json").unlink()
    got = ts_moe.load_mixtral_experts(path, layers=[1], device="cpu")
    want = ts_moe.load_mixtral_experts(checkpoints[(names, 1)], layers=[1], device="cpu")
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name])


def test_config_disagreeing_with_the_tensors_is_a_value_error(checkpoints, tmp_path):
    path = _rewrite(checkpoints[("v4", 1)], tmp_path / "ckpt", lambda s: None)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 64
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight.*shape"):
        ts_moe.load_mixtral_experts(path, device="cpu")


def test_script_writes_a_checkpoint_transformers_loads(tmp_path):
    out = tmp_path / "script"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_mixtral.py"), str(out),
                    "--layers", "2", "--hidden", "32", "--intermediate", "48", "--experts", "3",
                    "--top-k", "2", "--names", "v5", "--seed", "1"],
                   check=True, capture_output=True)
    model = MixtralForCausalLM.from_pretrained(out)
    assert model.config.num_local_experts == 3 and model.config.intermediate_size == 48
    weights = ts_moe.load_mixtral_experts(out, device="cpu")
    assert torch.equal(weights[1]["gate_up_proj"], model.model.layers[1].mlp.experts.gate_up_proj)


def test_make_tiny_mixtral_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="names"):
        ts_moe.make_tiny_mixtral(tmp_path, names="v6")
    with pytest.raises(ValueError, match="hidden"):
        ts_moe.make_tiny_mixtral(tmp_path, hidden=60)
    with pytest.raises(ValueError, match="top_k"):
        ts_moe.make_tiny_mixtral(tmp_path, experts=2, top_k=3)
