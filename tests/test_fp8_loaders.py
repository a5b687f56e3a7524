"""load_fp8_experts and MoE.from_pretrained on tiny FP8 checkpoints (ts_moe.fp8.tiny) of
each naming (Mixtral, Qwen3-MoE, DeepSeek-V3) and scheme (blockwise, channel, tensor)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ts_moe
from ts_moe.fp8 import loaders as fp8_loaders
from ts_moe.fp8.layer import dequantize_experts
from ts_moe.fp8.loaders import fp8_scheme, load_fp8_experts
from ts_moe.fp8.tiny import (NAMINGS, SCHEMES, make_tiny_fp8_checkpoint, quantization_config,
                             tiny_moe_weights)

from .helpers import rel_err
from .test_fp8_layer import reference64

EXPERT_KEYS = {"mixtral": "model.layers.{}.block_sparse_moe.experts.{}.{}",
               "qwen3_moe": "model.layers.{}.mlp.experts.{}.{}",
               "deepseek_v3": "model.layers.{}.mlp.experts.{}.{}"}
NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
         "deepseek_v3": ("gate_proj", "up_proj", "down_proj")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {(n, s): make_tiny_fp8_checkpoint(root / f"{n}-{s}", naming=n, scheme=s, layers=2,
                                             shards=3, seed=4)
            for n in NAMINGS for s in SCHEMES}


def _state(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def _rewrite(src: Path, dst: Path, edit, config_edit=None) -> Path:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    state = _state(src)
    edit(state)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("naming", NAMINGS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_loads_the_files_values_into_the_layer_layouts(checkpoints, naming, scheme):
    path = checkpoints[(naming, scheme)]
    layer = 1
    weights = load_fp8_experts(path, device="cpu")
    assert list(weights) == ([1] if naming == "deepseek_v3" else [0, 1])
    w = weights[layer]
    state = _state(path)
    gate, up, down = NAMES[naming]
    scale_name = "weight_scale_inv" if scheme == "blockwise" else "weight_scale"
    for e in range(4):
        key = EXPERT_KEYS[naming].format(layer, e, "{}")
        for name, got in ((gate, w["gate_up_proj"][e, :256]), (up, w["gate_up_proj"][e, 256:]),
                          (down, w["down_proj"][e])):
            assert torch.equal(got.view(torch.uint8),
                               state[key.format(name) + ".weight"].view(torch.uint8))
        s_gate = state[key.format(gate) + "." + scale_name]
        s_up = state[key.format(up) + "." + scale_name]
        if scheme == "blockwise":
            assert torch.equal(w["gate_up_proj_scale"][e], torch.cat([s_gate, s_up]))
        else:  # per channel, or a tensor's one scale spread over its channels
            assert torch.equal(w["gate_up_proj_scale"][e, :256], s_gate.reshape(-1).expand(256))
            assert torch.equal(w["gate_up_proj_scale"][e, 256:], s_up.reshape(-1).expand(256))
    # and they stand for the bf16 weights the checkpoint quantized, within e4m3's rounding
    bf16 = tiny_moe_weights(layers=2, seed=4, naming=naming)[layer]
    assert torch.equal(w["router"], bf16["router"])
    for name in ("gate_up_proj", "down_proj"):
        deq = dequantize_experts(w[name], w[name + "_scale"], torch.float32)
        assert rel_err(deq, bf16[name]) <= 2**-4  # per element <= 2**-4 relative


@pytest.mark.parametrize("naming", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_from_pretrained_serves_the_checkpoint(checkpoints, naming, scheme):
    path = checkpoints[(naming, scheme)]
    moe = ts_moe.MoE.from_pretrained(path, 1, device="cpu")
    assert moe.top_k == 2 and moe.gate_up_proj.dtype == torch.float8_e4m3fn
    x = torch.randn(10, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        out = moe(x)
    ref = reference64(x, moe.router, moe.gate_up_proj, moe.gate_up_proj_scale, moe.down_proj,
                      moe.down_proj_scale, 2)
    assert rel_err(out, ref) <= 1e-2
    bf16 = tiny_moe_weights(layers=2, seed=4, naming=naming)[1]
    plain = ts_moe.moe_forward(x, bf16["router"], bf16["gate_up_proj"], bf16["down_proj"], 2)
    assert rel_err(out, plain) <= 0.1  # weights and activations in e4m3


def test_deepseek_v3_experts_serve_experts_forward_not_the_module(checkpoints):
    path = checkpoints[("deepseek_v3", "blockwise")]
    with pytest.raises(ValueError, match="DeepSeek-V3 routes by sigmoid"):
        ts_moe.MoE.from_pretrained(path, 1, device="cpu")
    with pytest.raises(KeyError, match="layer 0 is not an MoE layer"):
        load_fp8_experts(path, layers=0, device="cpu")
    w = load_fp8_experts(path, layers=1, device="cpu")[1]
    x = torch.randn(6, 256).bfloat16()
    ids, weights = torch.tensor([[0, 3]] * 6), torch.full((6, 2), 0.5)
    out = ts_moe.experts_forward(x, ids, weights, w["gate_up_proj"], w["down_proj"],
                                 gate_up_scale=w["gate_up_proj_scale"],
                                 down_scale=w["down_proj_scale"])
    assert out.shape == (6, 256) and torch.isfinite(out.float()).all()


def test_layer_subset_and_expert_range(checkpoints, monkeypatch):
    path = checkpoints[("qwen3_moe", "blockwise")]
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    opened, real_open = [], fp8_loaders.safe_open

    def recording_open(file, *args, **kwargs):
        opened.append(Path(file).name)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(fp8_loaders, "safe_open", recording_open)
    full = load_fp8_experts(path, layers=[1], device="cpu")[1]
    needed = {shard for key, shard in index.items() if key.startswith("model.layers.1.")}
    assert sorted(opened) == sorted(needed)  # each needed shard once, none other
    part = load_fp8_experts(path, layers=1, device="cpu", experts=range(1, 3))[1]
    assert torch.equal(part["router"], full["router"])
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(part[name].view(torch.uint8), full[name][1:3].view(torch.uint8))
        assert torch.equal(part[name + "_scale"], full[name + "_scale"][1:3])
    with pytest.raises(ValueError, match="past the checkpoint's 4 experts"):
        load_fp8_experts(path, device="cpu", experts=range(2, 6))


@pytest.mark.parametrize("config, scheme", [
    ({}, None),
    ({"quantization_config": quantization_config("blockwise")}, "blockwise"),
    ({"quantization_config": quantization_config("channel")}, "channel"),
    ({"quantization_config": quantization_config("tensor")}, "tensor"),
])
def test_scheme_from_config(config, scheme):
    assert fp8_scheme(config) == scheme


@pytest.mark.parametrize("q, match", [
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "only e4m3"),
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "type": "int", "num_bits": 4, "strategy": "group"}}}}, "compressed-tensors"),
])
def test_unserved_quantization_is_a_value_error(q, match):
    with pytest.raises(ValueError, match=match):
        fp8_scheme({"quantization_config": q})


def test_bf16_checkpoint_is_not_an_fp8_one(tmp_path):
    path = ts_moe.make_tiny_moe_checkpoint(tmp_path / "bf16", layers=1)
    with pytest.raises(ValueError, match="no quantization_config"):
        load_fp8_experts(path, device="cpu")
    assert fp8_loaders.pretrained_layer(path, 0) is None  # from_pretrained: the bf16 loader
    assert ts_moe.MoE.from_pretrained(path, 0, device="cpu").gate_up_proj.dtype == torch.bfloat16


@pytest.mark.parametrize("edit, error, match", [
    (lambda s: s.pop("model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"), KeyError,
     "experts.2.up_proj.weight_scale_inv"),
    (lambda s: s.update({"model.layers.1.mlp.experts.0.down_proj.weight_scale_inv":
                         torch.ones(2, 3)}), ValueError, "experts.0.down_proj.weight_scale_inv"),
    (lambda s: s.update({"model.layers.1.mlp.experts.3.gate_proj.weight":
                         torch.zeros(256, 256, dtype=torch.bfloat16)}), ValueError,
     "experts.3.gate_proj.weight: expected F8_E4M3"),
    (lambda s: s.update({"model.layers.1.mlp.gate.weight": torch.zeros(4, 256, 2)}),
     ValueError, "mlp.gate.weight: expected a 2-D"),
])
def test_bad_checkpoints_are_named(checkpoints, tmp_path, edit, error, match):
    path = _rewrite(checkpoints[("qwen3_moe", "blockwise")], tmp_path / "bad", edit)
    with pytest.raises(error, match=match):
        load_fp8_experts(path, device="cpu")


def test_blockwise_needs_whole_blocks_of_intermediate(checkpoints, tmp_path):
    def config_edit(config):
        config["moe_intermediate_size"] = 192
    path = _rewrite(checkpoints[("qwen3_moe", "blockwise")], tmp_path / "odd", lambda s: None,
                    config_edit)
    with pytest.raises(ValueError, match="multiple of 128"):
        load_fp8_experts(path, device="cpu")


def test_writer_rejects_bad_arguments(tmp_path):
    for kw, match in ((dict(naming="llama"), "naming"), (dict(scheme="int4"), "scheme"),
                      (dict(hidden=192), "hidden"), (dict(scheme="channel", intermediate=24),
                                                     "intermediate"),
                      (dict(top_k=5), "top_k")):
        with pytest.raises(ValueError, match=match):
            make_tiny_fp8_checkpoint(tmp_path / "x", **kw)
    shutil.rmtree(tmp_path / "x", ignore_errors=True)
