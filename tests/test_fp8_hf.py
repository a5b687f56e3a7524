"""Hugging Face transformers' FP8 experts (FineGrainedFP8Config's FP8Experts) on ts_moe:
experts_implementation="ts_moe" and replace_moe_blocks, on a tiny FP8 Mixtral built here
(transformers' own replace_with_fp8_linear, as from_pretrained calls it, then the
weights quantized by ts_moe; no download)."""

import pytest
import torch

import ts_moe

transformers = pytest.importorskip("transformers", minversion="5")
finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
from transformers import FineGrainedFP8Config, MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers.integrations.moe import ExpertsInterface  # noqa: E402

from ts_moe.fp8.recipes import Recipe  # noqa: E402
from ts_moe.fp8.reference import dequantize  # noqa: E402
from ts_moe.integrations.transformers import register, replace_moe_blocks  # noqa: E402
from ts_moe.integrations.transformers_experts import module_experts  # noqa: E402

from .helpers import OpRecorder, rel_err  # noqa: E402
from .test_fp8_layer import experts_reference64  # noqa: E402

PROMPT = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
FP8_OPS = {"ts_moe::quantize_fp8", "ts_moe::scaled_grouped_gemm_swiglu",
           "ts_moe::scaled_grouped_gemm"}
BLOCKS = {"blockwise": (128, 128), "per_tensor": None}


def tiny_bf16(seed=0):
    config = MixtralConfig(vocab_size=256, hidden_size=256, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=128, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MixtralForCausalLM(config).to(torch.bfloat16).eval()


def tiny_fp8(ref, block=(128, 128)):
    """``ref`` with FP8 experts: transformers' FP8Experts modules, their e4m3 weights and
    ``*_scale_inv`` from ts_moe.quantize_fp8 of ref's (per tensor: gate and up halves
    each their own scale, as transformers allocates them); attention stays bf16."""
    config = FineGrainedFP8Config(weight_block_size=block,
                                  modules_to_not_convert=["q_proj", "k_proj", "v_proj",
                                                          "o_proj", "lm_head"])
    model = MixtralForCausalLM(ref.config)
    finegrained.replace_with_fp8_linear(model, config.modules_to_not_convert, config,
                                        pre_quantized=True)
    state = {k: v for k, v in ref.state_dict().items() if ".experts." not in k}
    for name, module in model.named_modules():
        if not isinstance(module, finegrained.FP8Experts):
            continue
        for w in ("gate_up_proj", "down_proj"):
            bf16 = ref.get_submodule(name).get_parameter(w).float()
            shape = getattr(module, w + "_scale_inv").shape
            if block:
                q, scale = ts_moe.quantize_fp8(bf16, "blockwise_128x128")
            else:  # per tensor: (E, 1, 1), or (E, 2, 1) for the gate and up halves
                parts = [ts_moe.quantize_fp8(p, "tensorwise") for p in bf16.chunk(shape[1], 1)]
                q = torch.cat([p[0] for p in parts], 1)
                scale = torch.stack([p[1] for p in parts], 1)[..., None]
            state[f"{name}.{w}"], state[f"{name}.{w}_scale_inv"] = q, scale.reshape(shape)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert not missing and not unexpected
    return model.eval()


def dequantized(fp8_model, ref):
    """The bf16 model whose experts are the FP8 model's, dequantized."""
    model = tiny_bf16()
    state = ref.state_dict()
    for name, module in fp8_model.named_modules():
        if isinstance(module, finegrained.FP8Experts):
            experts = module_experts(module)
            state[f"{name}.gate_up_proj"] = dequantize(module.gate_up_proj.data,
                                                       experts.gate_up_scale, experts.recipes[0],
                                                       torch.bfloat16)
            state[f"{name}.down_proj"] = dequantize(module.down_proj.data, experts.down_scale,
                                                    experts.recipes[1], torch.bfloat16)
    model.load_state_dict(state)
    return model


@pytest.fixture
def registered():
    register()
    yield
    ExpertsInterface._global_mapping.pop("ts_moe", None)
    finegrained.FP8ExpertsInterface._global_mapping.pop("ts_moe", None)


def test_scale_convention_is_transformers_own():
    """transformers dequantizes weight_scale_inv by multiplying: as ts_moe reads it."""
    experts = tiny_fp8(tiny_bf16()).model.layers[0].mlp.experts
    theirs = finegrained._dequantize_fp8_weight(experts.gate_up_proj.data,
                                                experts.gate_up_proj_scale_inv.data,
                                                experts.block_size, torch.float32)
    ours = dequantize(experts.gate_up_proj.data, experts.gate_up_proj_scale_inv.data,
                      Recipe.BLOCKWISE_128X128, torch.float32)
    assert torch.equal(theirs, ours)


@pytest.mark.parametrize("block", BLOCKS, ids=list(BLOCKS))
def test_experts_implementation_ts_moe_serves_fp8_experts(registered, block):
    ref = tiny_bf16()
    model = tiny_fp8(ref, BLOCKS[block])
    assert "ts_moe" in finegrained.ALL_FP8_EXPERTS_FUNCTIONS
    model.set_experts_implementation("ts_moe")
    experts = model.model.layers[0].mlp.experts
    assert experts.config._experts_implementation == "ts_moe"
    with torch.no_grad(), OpRecorder() as rec:
        got = model(PROMPT).logits
    assert FP8_OPS <= rec.ops
    # the experts against float64 on the same quantized activations
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 256, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(12)])
    weights = torch.softmax(torch.randn(12, 2, generator=g), -1)
    with torch.no_grad():
        out = experts(x, ids, weights)
    value = module_experts(experts)
    want = experts_reference64(x, ids, weights, experts.gate_up_proj.data,
                               value.gate_up_scale, experts.down_proj.data, value.down_scale,
                               value.recipes)
    assert rel_err(out, want) <= 1e-2
    # the model against the bf16 model with the dequantized experts: e4m3 activations
    with torch.no_grad():
        assert rel_err(got, dequantized(model, ref)(PROMPT).logits) <= 0.05


def test_replace_moe_blocks_switches_fp8_blocks(registered):
    ref = tiny_bf16()
    interface = tiny_fp8(ref)
    interface.set_experts_implementation("ts_moe")
    model = tiny_fp8(ref)
    weights = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert replace_moe_blocks(model) == 2
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == weights  # no copies
    with torch.no_grad(), OpRecorder() as rec:
        got = model(PROMPT).logits
    assert FP8_OPS <= rec.ops
    with torch.no_grad():
        assert torch.equal(got, interface(PROMPT).logits)  # the same routing and ops


@pytest.mark.parametrize("attr, value, match", [
    ("limit", 7.0, "clamped"),
    ("block_size", (64, 64), "block size"),
    ("has_bias", True, "biases"),
])
def test_unsupported_fp8_experts_named(registered, attr, value, match):
    model = tiny_fp8(tiny_bf16())
    setattr(model.model.layers[1].mlp.experts, attr, value)
    with pytest.raises(NotImplementedError, match=match):
        replace_moe_blocks(model)  # checked before any block is switched
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"
    model.set_experts_implementation("ts_moe")
    with torch.no_grad(), pytest.raises(NotImplementedError, match=match):
        model(PROMPT)


def test_gradients_through_fp8_experts_raise(registered):
    model = tiny_fp8(tiny_bf16())
    model.set_experts_implementation("ts_moe")
    logits = model(PROMPT).logits  # grad mode: transformers' FP8 parameters require grad
    assert logits.requires_grad
    with pytest.raises(NotImplementedError, match="no backward"):
        logits.float().sum().backward()
