"""MoE.from_pretrained and ExpertParallelMoE.from_pretrained reproduce the sparse MoE
block of the model types they serve, checked against transformers' own blocks (Qwen's
routing with and without norm_topk_prob), bf16 and FP8 alike; every other model type
is refused, naming what its block has that the layer lacks."""

import json
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file

import ts_moe
from ts_moe.distributed import ExpertParallelMoE
from ts_moe.tiny import make_tiny_fp8_checkpoint

from .helpers import rel_err
from .ranks import run_ranks
from .test_fp8_layer import experts_reference64

H, I, E, TOP_K = 64, 32, 8, 2
NORMS = [False, True, None]  # None: the field left out (transformers' default: False)


def _qwen_checkpoint(path, model_type: str, norm, shared=None):
    """A one-layer checkpoint of transformers' own block (float32 weights in the
    transformers-5 names), and the block."""
    transformers = pytest.importorskip("transformers")
    if model_type == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as B
        config_cls, extra = transformers.Qwen3MoeConfig, {}
    else:
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as B
        config_cls, extra = transformers.Qwen2MoeConfig, {"shared_expert_intermediate_size": shared}
    config = config_cls(hidden_size=H, moe_intermediate_size=I, intermediate_size=3 * I,
                        num_experts=E, num_experts_per_tok=TOP_K, norm_topk_prob=bool(norm),
                        **{k: v for k, v in extra.items() if v is not None})
    config._experts_implementation = "eager"
    block = B(config).float().eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    path.mkdir()
    save_file({f"model.layers.0.mlp.{k}": v.contiguous() for k, v in block.state_dict().items()},
              path / "model.safetensors", metadata={"format": "pt"})
    written = config.to_dict()
    if norm is None:
        del written["norm_topk_prob"]
    if shared is None:
        written.pop("shared_expert_intermediate_size", None)
    (path / "config.json").write_text(json.dumps(written))
    return path, block


@pytest.mark.parametrize("norm", NORMS)
def test_qwen3_moe_matches_transformers_block(tmp_path, norm):
    path, block = _qwen_checkpoint(tmp_path / "q", "qwen3_moe", norm)
    moe = ts_moe.MoE.from_pretrained(path, 0, device="cpu")
    assert moe.renormalize is bool(norm) and moe.top_k == TOP_K
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(moe(x), block(x)) <= 1e-5


def test_qwen2_moe_is_served_only_without_a_shared_expert(tmp_path):
    path, block = _qwen_checkpoint(tmp_path / "q0", "qwen2_moe", False, shared=0)
    moe = ts_moe.MoE.from_pretrained(path, 0, device="cpu")
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(moe(x), block(x[None])[0]) <= 1e-5
    for shared, name in ((None, "absent"), (16, "16")):
        path, _ = _qwen_checkpoint(tmp_path / name, "qwen2_moe", True, shared=shared)
        with pytest.raises(ValueError, match=r"config\.json: model_type 'qwen2_moe': its block "
                                             r"has a shared expert behind a sigmoid gate"):
            ts_moe.MoE.from_pretrained(path, 0, device="cpu")


@pytest.mark.parametrize("norm", NORMS)
def test_fp8_qwen3_moe_routing_follows_norm_topk_prob(tmp_path, norm):
    path = make_tiny_fp8_checkpoint(tmp_path / "fp8", naming="qwen3_moe", scheme="channel",
                                    layers=1, hidden=H, intermediate=I, experts=E, top_k=TOP_K,
                                    shards=1, init_std=0.2)
    config = json.loads((path / "config.json").read_text())
    config.pop("norm_topk_prob")
    if norm is not None:
        config["norm_topk_prob"] = norm
    (path / "config.json").write_text(json.dumps(config))
    moe = ts_moe.MoE.from_pretrained(path, 0, device="cpu")
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        out = moe(x)
    # Qwen's routing in float64: softmax over all experts, the top-k by logit (ties to
    # the lower expert, as ts_moe ranks), divided by their sum only with norm_topk_prob
    logits = F.linear(x, moe.router).double()
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :TOP_K]
    weights = torch.softmax(logits, -1).gather(-1, ids)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    want = experts_reference64(x, ids, weights, moe.gate_up_proj, moe.gate_up_proj_scale,
                               moe.down_proj, moe.down_proj_scale, moe.scale_recipe)
    assert rel_err(out, want) <= 1e-2


@pytest.mark.parametrize("model_type, lacks", [
    ("deepseek_v3", "DeepSeek-V3 routes by sigmoid scores"),
    ("glm4_moe", "its block has a sigmoid router with a score-correction bias"),
    ("gpt_oss", "its block has a router bias"),
    ("llama4", "its block has a sigmoid router"),
    ("qwen3_next", "its block has a shared expert"),
    ("olmoe", "its block is not one ts_moe knows"),
])
def test_other_model_types_are_refused_naming_what_they_lack(tmp_path, model_type, lacks):
    path = ts_moe.make_tiny_moe_checkpoint(tmp_path / "m", layers=1, shards=1)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = model_type
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config\.json: model_type '{model_type}': {lacks}"):
        ts_moe.MoE.from_pretrained(path, 0, device="cpu")


@pytest.mark.parametrize("field, value, match", [
    ("model_type", None, "model_type must be a string"),
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("num_experts_per_tok", "2", "num_experts_per_tok must be a positive int"),
    ("num_experts_per_tok", 5, "num_experts_per_tok = 5 exceeds the 4 experts"),
])
def test_bad_block_fields_are_named(tmp_path, field, value, match):
    path = ts_moe.make_tiny_moe_checkpoint(tmp_path / "m", layers=1, shards=1, experts=4)
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config\.json: {match}"):
        ts_moe.MoE.from_pretrained(path, 0, device="cpu")


def test_norm_topk_prob_must_be_a_bool(tmp_path):
    path, _ = _qwen_checkpoint(tmp_path / "q", "qwen3_moe", True)
    config = json.loads((path / "config.json").read_text())
    config["norm_topk_prob"] = "false"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: norm_topk_prob must be true or false"):
        ts_moe.MoE.from_pretrained(path, 0, device="cpu")


def _expert_parallel(rank, world, qwen, refused):
    x = torch.randn(6 * world, H, generator=torch.Generator().manual_seed(4))
    layer = ExpertParallelMoE.from_pretrained(qwen, 0, device="cpu")
    with torch.no_grad():
        out = layer(x[6 * rank:6 * (rank + 1)])
    try:
        ExpertParallelMoE.from_pretrained(refused, 0, device="cpu")
        refusal = "no error"
    except ValueError as exc:
        refusal = str(exc)
    return {"out": out, "renormalize": layer.renormalize, "refusal": refusal}


def _gloo(rank, world, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)


def test_expert_parallel_layer_routes_as_the_model(tmp_path):
    qwen, _ = _qwen_checkpoint(tmp_path / "q", "qwen3_moe", False)
    refused = ts_moe.make_tiny_moe_checkpoint(tmp_path / "d", layers=1, shards=1)
    config = json.loads((refused / "config.json").read_text())
    config["model_type"] = "deepseek_v2"
    (refused / "config.json").write_text(json.dumps(config))
    results = run_ranks(2, _gloo, functools.partial(_expert_parallel, qwen=str(qwen),
                                                    refused=str(refused)))
    moe = ts_moe.MoE.from_pretrained(qwen, 0, device="cpu")
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = moe(x)
    assert [r["renormalize"] for r in results] == [False, False]
    assert rel_err(torch.cat([r["out"] for r in results]), want) <= 1e-6
    for r in results:
        assert "model_type 'deepseek_v2'" in r["refusal"]
