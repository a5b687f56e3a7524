"""vLLM 0.33's Mixtral MoE layer (``vllm.model_executor.models.mixtral.MixtralMoE``) built
with ts_moe's plugin registered, on the CPU (ts_moe's reference path): its experts are
ts_moe's, and on the weights of a Hugging Face ``MixtralSparseMoeBlock`` it gives that
block's output, bf16 and (weights quantized to 128x128 blocks, under vLLM's ``fp8``
config) block FP8."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed: CI's vLLM environment "
                                   "runs these tests (.ci/run)")

from transformers import MixtralConfig  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.quantization import get_quantization_config  # noqa: E402
from vllm.model_executor.models.mixtral import MixtralMoE  # noqa: E402

import ts_moe  # noqa: E402
from ts_moe.fp8.reference import dequantize  # noqa: E402
from ts_moe.integrations import vllm as plugin  # noqa: E402
from ts_moe.integrations import vllm_experts  # noqa: E402
from ts_moe.integrations.vllm_experts import TsMoeExperts, TsMoeFp8Experts  # noqa: E402

from .vllm_helpers import (BLOCKWISE, experts_loop, fp8_rows, rel_err,  # noqa: E402
                           vllm_process)

E, H, I, TOP_K, T = 8, 256, 384, 2, 32  # noqa: E741
PREFIX = "model.layers.0.block_sparse_moe"


@pytest.fixture(autouse=True)
def plugin_on(monkeypatch):
    """The plugin registered in this process (as TS_MOE_VLLM=1 has vLLM do), and ts_moe's
    reference path forced (the CPU has no ts_moe kernels), for each test; the calls of
    ts_moe's experts counted."""
    calls = []
    real = vllm_experts.run_experts
    monkeypatch.setattr(vllm_experts, "run_experts",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    with ts_moe.settings.override(vllm=True, reference=True):
        plugin.register()
        yield calls


def hf_block(seed):
    config = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                           num_experts_per_tok=TOP_K)
    torch.manual_seed(seed)
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.normal_(0, H**-0.5)
        block.experts.gate_up_proj.normal_(0, H**-0.5)
        block.experts.down_proj.normal_(0, I**-0.5)
    return block.to(torch.bfloat16).eval()


def vllm_layer(config, quant_config, weights: dict):
    """vLLM's Mixtral MoE layer with ``weights`` copied into its parameters by name, then
    each method's ``process_weights_after_loading``, as vLLM's loader ends."""
    layer = MixtralMoE(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                       params_dtype=torch.bfloat16, quant_config=quant_config, prefix=PREFIX)
    params = dict(layer.named_parameters())
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    for module in layer.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return layer


def run(layer, config, x):
    with set_forward_context(None, config), torch.inference_mode():
        return layer(x)


def experts_class(layer):
    return type(layer.experts.routed_experts.quant_method.moe_kernel.fused_experts)


def test_vllms_mixtral_layer_on_ts_moe_matches_the_hugging_face_block(plugin_on):
    block = hf_block(seed=0)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    with torch.inference_mode():
        ref = block(x[None])[0]
    with vllm_process() as config:
        layer = vllm_layer(config, None, {
            "gate.weight": block.gate.weight,
            "experts.routed_experts.w13_weight": block.experts.gate_up_proj,
            "experts.routed_experts.w2_weight": block.experts.down_proj})
        assert experts_class(layer) is TsMoeExperts
        out = run(layer, config, x)
    assert plugin_on == [(T, H)]  # one call of ts_moe's experts, on every token
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert rel_err(out, ref) <= 1e-2


def test_vllms_block_fp8_mixtral_layer_on_ts_moe_matches_the_hugging_face_block(plugin_on):
    block = hf_block(seed=1)
    gq, gs = ts_moe.quantize_fp8(block.experts.gate_up_proj.float(), BLOCKWISE)
    dq, ds = ts_moe.quantize_fp8(block.experts.down_proj.float(), BLOCKWISE)
    w13, w2 = (dequantize(gq, gs, BLOCKWISE, torch.float32),
               dequantize(dq, ds, BLOCKWISE, torch.float32))
    with torch.no_grad():  # the Hugging Face block on the weights the FP8 layer holds
        block.experts.gate_up_proj.copy_(w13)
        block.experts.down_proj.copy_(w2)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    with torch.inference_mode():
        ref = block(x[None])[0]
    fp8_config = get_quantization_config("fp8")  # the plugin's, as a checkpoint's config finds it
    quant_config = fp8_config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]})
    with vllm_process() as config:
        layer = vllm_layer(config, quant_config, {
            "gate.weight": block.gate.weight,
            "experts.routed_experts.w13_weight": gq,
            "experts.routed_experts.w13_weight_scale_inv": gs,
            "experts.routed_experts.w2_weight": dq,
            "experts.routed_experts.w2_weight_scale_inv": ds})
        assert experts_class(layer) is TsMoeFp8Experts
        out = run(layer, config, x)
    assert plugin_on == [(T, H)]
    assert rel_err(out, ref) <= 0.1  # the block's (bf16 weights), rows quantized to e4m3
    # the rows as the experts quantize them (per 1x128 channels: the tokens, and the
    # SwiGLU output rounded to bf16), the block's routing: the fp32 loop agrees closely
    with torch.inference_mode():
        _, weights, ids = block.gate(x)
    loop = experts_loop(fp8_rows(x), w13, w2, weights, ids,
                        swiglu_out=lambda a: fp8_rows(a.bfloat16()[None])[0])
    assert rel_err(out, loop) <= 1e-2
