"""load_fp8_experts and MoE.from_pretrained on tiny FP8 checkpoints (ts_moe.tiny) of
each naming (Mixtral, Qwen3-MoE, DeepSeek-V3) and scheme (blockwise, channel, tensor)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ts_moe
from ts_moe import checkpoint, loaders
from ts_moe.fp8.reference import dequantize
from ts_moe.loaders import fp8_scheme, load_fp8_experts
from ts_moe.tiny import (make_tiny_checkpoint, make_tiny_fp8_checkpoint, quantization_config,
                         tiny_moe_weights)

from .helpers import rel_err
from .test_fp8_layer import reference64

NAMINGS = ("mixtral", "qwen3_moe", "deepseek_v3")
SCHEMES = ("blockwise", "channel", "tensor")
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
        deq = dequantize(w[name], w[name + "_scale"], w["scale_recipe"], torch.float32)
        assert rel_err(deq, bf16[name]) <= 2**-4  # per element <= 2**-4 relative


@pytest.mark.parametrize("naming", NAMINGS)
def test_one_plan_reads_each_format_of_the_one_maker(tmp_path, naming):
    """The one maker writes a naming in bf16 and in FP8, the one plan reads both: the
    same layers and routers, bf16 the weights as written, FP8 within e4m3's rounding of
    them, an expert range of either the same slice."""
    sizes = dict(naming=naming, layers=3, hidden=128, intermediate=128, experts=4, seed=3)
    bf16 = make_tiny_checkpoint(tmp_path / "bf16", format="bf16", **sizes)
    fp8 = make_tiny_checkpoint(tmp_path / "fp8", format="blockwise", **sizes)
    want = tiny_moe_weights(**sizes)
    got16 = ts_moe.load_mixtral_experts(bf16, device="cpu")
    got8 = load_fp8_experts(fp8, device="cpu")
    assert list(got16) == list(got8) == list(want)
    for layer, w in want.items():
        assert got8[layer]["scale_recipe"] is ts_moe.fp8.Recipe.BLOCKWISE_128X128
        for name in ("router", "gate_up_proj", "down_proj"):
            assert torch.equal(got16[layer][name], w[name])
            if name == "router":
                assert torch.equal(got8[layer][name], w[name])
            else:
                deq = dequantize(got8[layer][name], got8[layer][name + "_scale"],
                                 got8[layer]["scale_recipe"], torch.float32)
                assert rel_err(deq, w[name]) <= 2**-4
    last = list(want)[-1]
    part16 = ts_moe.load_mixtral_experts(bf16, layers=last, experts=range(1, 3), device="cpu")
    part8 = load_fp8_experts(fp8, layers=last, experts=range(1, 3), device="cpu")
    assert torch.equal(part16[last]["down_proj"], want[last]["down_proj"][1:3])
    assert torch.equal(part8[last]["down_proj"].view(torch.uint8),
                       got8[last]["down_proj"][1:3].view(torch.uint8))


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
                      moe.down_proj_scale, 2, moe.scale_recipe)
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
                                 down_scale=w["down_proj_scale"], scale_recipe=w["scale_recipe"])
    assert out.shape == (6, 256) and torch.isfinite(out.float()).all()


def test_layer_subset_and_expert_range(checkpoints, monkeypatch):
    path = checkpoints[("qwen3_moe", "blockwise")]
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    opened, real_open = [], checkpoint.ShardFile

    def recording_open(fd, *args, **kwargs):  # the file open at fd, as the kernel names it
        opened.append(Path(checkpoint._opened_path(fd)).name)
        return real_open(fd, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "ShardFile", recording_open)
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
    assert loaders.pretrained_layer(path, 0)["gate_up_proj"].dtype == torch.bfloat16
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


@pytest.mark.parametrize("field", ["num_experts", "num_local_experts", "n_routed_experts"])
@pytest.mark.parametrize("count", [2, 5])
def test_a_config_expert_count_other_than_the_routers_is_named(checkpoints, tmp_path, field,
                                                               count):
    """E is the router's: a config.json count of 2 for a 4-expert checkpoint gave a
    truncated stack beside the whole router (tokens routed to experts 2 and 3 counted
    for none)."""
    path = _rewrite(checkpoints[("qwen3_moe", "channel")], tmp_path / "c", lambda s: None,
                    lambda c: c.update({field: count}))
    with pytest.raises(ValueError, match=rf"config\.json: {field} = {count}, but the router "
                                         rf"model\.layers\.0\.mlp\.gate\.weight has 4 experts"):
        load_fp8_experts(path, device="cpu")
    with pytest.raises(ValueError, match=rf"config\.json: {field} = {count}"):
        ts_moe.MoE.from_pretrained(path, 1, device="cpu")


def _without(state, part):
    for key in [k for k in state if part in k]:
        del state[key]


def test_the_expert_keys_must_be_the_routers_experts(checkpoints, tmp_path):
    src = checkpoints[("qwen3_moe", "channel")]

    def extra_expert(state):  # expert 4 of a 4-expert router
        for key in [k for k in state if ".layers.1.mlp.experts.0." in k]:
            state[key.replace(".experts.0.", ".experts.4.")] = state[key].clone()

    for keep_count in (True, False):
        path = _rewrite(src, tmp_path / f"extra{keep_count}", extra_expert,
                        None if keep_count else lambda c: c.pop("num_experts"))
        with pytest.raises(ValueError, match=r"model\.safetensors: key 'model\.layers\.1\.mlp\."
                                             r"experts\.4\.\w+\.weight\w*' names expert 4, but "
                                             r"the router model\.layers\.1\.mlp\.gate\.weight "
                                             r"has 4 experts"):
            load_fp8_experts(path, device="cpu")
    path = _rewrite(src, tmp_path / "gap", lambda s: _without(s, ".layers.1.mlp.experts.2."),
                    lambda c: c.pop("num_experts"))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.experts\.2\.gate_proj\.weight"):
        load_fp8_experts(path, device="cpu")
    assert list(load_fp8_experts(path, layers=0, device="cpu")) == [0]  # layer 0 is whole


def test_without_a_config_count_the_router_decides(checkpoints, tmp_path):
    path = _rewrite(checkpoints[("mixtral", "tensor")], tmp_path / "n", lambda s: None,
                    lambda c: c.pop("num_local_experts"))
    got = load_fp8_experts(path, device="cpu")
    want = load_fp8_experts(checkpoints[("mixtral", "tensor")], device="cpu")
    for layer, weights in want.items():
        assert got[layer]["scale_recipe"] == weights.pop("scale_recipe")
        for name, t in weights.items():
            assert torch.equal(got[layer][name].view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(quantization_config="fp8"), r"quantization_config must be an object"),
    (lambda c: c["quantization_config"].update(weight_block_size=128),
     r"quantization_config\.weight_block_size must be a list of two ints"),
    (lambda c: c["quantization_config"].update(weight_block_size=["128", "128"]),
     r"quantization_config\.weight_block_size must be a list of two ints"),
    (lambda c: c["quantization_config"].update(weight_block_size=[128.0, 128.0]),
     r"quantization_config\.weight_block_size must be a list of two ints"),
    (lambda c: c["quantization_config"].update(weight_block_size=[128, 64]),
     r"quantization_config\.weight_block_size \[128, 64\]: only \[128, 128\]"),
    (lambda c: c.update(moe_intermediate_size="256"), r"moe_intermediate_size must be a positive"),
    (lambda c: c.update(moe_intermediate_size=256.0), r"moe_intermediate_size must be a positive"),
    (lambda c: c.update(num_experts=0), r"num_experts must be a positive int"),
    (lambda c: c.update(num_experts="4"), r"num_experts must be a positive int"),
    (lambda c: c.update(num_experts=True), r"num_experts must be a positive int"),
    (lambda c: c.update(hidden_size="256"), r"hidden_size must be a positive int"),
    (lambda c: c.update(hidden_size=512), r"hidden_size = 512, but the router"),
])
def test_bad_fp8_config_fields_are_named(checkpoints, tmp_path, edit, field):
    """A ValueError naming config.json and the field, never a StopIteration,
    AttributeError or TypeError from deep inside the loader."""
    path = _rewrite(checkpoints[("qwen3_moe", "blockwise")], tmp_path / "bad", lambda s: None,
                    edit)
    for load in (lambda: load_fp8_experts(path, device="cpu"),
                 lambda: ts_moe.MoE.from_pretrained(path, 1, device="cpu")):
        with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path))}/bad/config\.json: "
                                             rf"{field}"):
            load()


@pytest.mark.parametrize("groups, field", [
    ([], r"quantization_config\.config_groups must be an object"),
    ({"g": "channel"}, r"quantization_config\.config_groups\['g'\] must be an object"),
    ({"g": {"weights": 8}}, r"quantization_config\.config_groups\['g'\]\.weights must be an "
                            r"object"),
])
def test_bad_compressed_tensors_fields_are_named(checkpoints, tmp_path, groups, field):
    def edit(config):
        config["quantization_config"]["config_groups"] = groups
    path = _rewrite(checkpoints[("qwen3_moe", "channel")], tmp_path / "bad", lambda s: None, edit)
    with pytest.raises(ValueError, match=rf"config\.json: {field}"):
        load_fp8_experts(path, device="cpu")
