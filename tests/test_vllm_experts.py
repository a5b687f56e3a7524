"""ts_moe's experts as vLLM 0.33 modular-MoE experts (ts_moe.integrations.vllm_experts) on
the CPU (ts_moe's reference path, ``ts_moe.settings.reference`` on): through vLLM's own
``FusedMoEKernel`` and prepare/finalize, bf16 and block FP8, all experts on this rank or an
expert-parallel rank's share (``expert_map``), against an fp32 loop over the experts
(vLLM 0.33's wheel ships no reference experts function: its ``torch_experts`` lives in
its test tree); the weights read in place; and the layers the experts decline, each with
its reason through vLLM's own hook."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed: CI's vLLM environment "
                                   "runs these tests (.ci/run)")

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FusedMoEQuantConfig, fp8_w8a8_moe_quant_config)
from vllm.model_executor.layers.fused_moe.expert_map_manager import (  # noqa: E402
    determine_expert_map)
from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (  # noqa: E402
    MoEPrepareAndFinalizeNoDPEPModular)
from vllm.model_executor.layers.quantization.utils.quant_utils import (  # noqa: E402
    kFp8Dynamic128Sym, kFp8Static128BlockSym)

import ts_moe  # noqa: E402
from ts_moe.fp8.reference import dequantize  # noqa: E402
from ts_moe.integrations import vllm_experts  # noqa: E402
from ts_moe.integrations.vllm_experts import TsMoeExperts, TsMoeFp8Experts  # noqa: E402

from .vllm_helpers import (BLOCKWISE, experts_loop, fp8_rows, moe_config,  # noqa: E402
                           rel_err, route)

STANDARD = mk.FusedMoEActivationFormat.Standard
E, H, I, TOP_K, T = 8, 256, 256, 2, 24  # noqa: E741


@pytest.fixture(autouse=True)
def reference_path():
    """The experts serve a CPU layer only while ts_moe's reference path is forced."""
    with ts_moe.settings.override(reference=True):
        yield


def _weights(local_experts, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(local_experts, 2 * I, H, generator=g) * H**-0.5
    w2 = torch.randn(local_experts, H, I, generator=g) * I**-0.5
    x = torch.randn(T, H, generator=g).to(dtype)
    return x, w13, w2


def _kernel(experts_cls, quant_config, local_experts, dtype):
    config = moe_config(experts=E, local_experts=local_experts, hidden=H, inter=I,
                        top_k=TOP_K, dtype=dtype)
    return mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(),
                             experts_cls(moe_config=config, quant_config=quant_config))


def _ep_share(rank):
    """Rank ``rank`` of 2 expert-parallel ranks: its expert count and vLLM's expert_map."""
    local, expert_map, _ = determine_expert_map(ep_size=2, ep_rank=rank, global_num_experts=E)
    return local, expert_map


def _apply(kernel, x, w13, w2, weights, ids, expert_map):
    return kernel.apply(x, w13, w2, weights, ids, activation=MoEActivation.SILU,
                        global_num_experts=E, expert_map=expert_map,
                        apply_router_weight_on_input=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [None, 0, 1], ids=["all-experts", "ep-rank0", "ep-rank1"])
def test_bf16_experts_through_vllms_kernel_match_the_fp32_loop(dtype, rank):
    local, expert_map = (E, None) if rank is None else _ep_share(rank)
    x, w13, w2 = _weights(local, dtype, seed=1)
    w13, w2 = w13.to(dtype), w2.to(dtype)
    weights, ids = route(T, E, TOP_K, seed=2)
    kernel = _kernel(TsMoeExperts, FusedMoEQuantConfig.make(), local, dtype)
    out = _apply(kernel, x, w13, w2, weights, ids, expert_map)
    ref = experts_loop(x, w13, w2, weights, ids, expert_map,
                       swiglu_out=lambda a: a.to(dtype).float())
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, ref) <= 1e-2
    if expert_map is not None:  # a token whose experts are all elsewhere gets zeros here
        elsewhere = (expert_map[ids.long()] < 0).all(dim=1)
        assert elsewhere.any() and not out[elsewhere].any() and out[~elsewhere].all(dim=1).any()


def test_router_weights_already_in_the_tokens_are_not_applied_twice():
    """vLLM's prepare scales the tokens by their one expert's weight (top-1 only)."""
    x, w13, w2 = _weights(E, torch.bfloat16, seed=11)
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    weights, ids = route(T, E, 1, seed=12)
    weights = weights * torch.rand(T, 1)  # not all ones, as Llama-4's sigmoid router gives
    config = moe_config(experts=E, local_experts=E, hidden=H, inter=I, top_k=1,
                        dtype=torch.bfloat16)
    kernel = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(),
                               TsMoeExperts(moe_config=config,
                                            quant_config=FusedMoEQuantConfig.make()))
    out = kernel.apply(x, w13, w2, weights, ids, activation=MoEActivation.SILU,
                       global_num_experts=E, expert_map=None, apply_router_weight_on_input=True)
    scaled = (x * weights.to(x.dtype))
    ref = experts_loop(scaled, w13, w2, torch.ones_like(weights), ids,
                       swiglu_out=lambda a: a.bfloat16().float())
    assert rel_err(out, ref) <= 1e-2


def test_the_two_ranks_shares_add_up_to_the_layer():
    x, w13, w2 = _weights(E, torch.bfloat16, seed=3)
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    weights, ids = route(T, E, TOP_K, seed=4)
    whole = _apply(_kernel(TsMoeExperts, FusedMoEQuantConfig.make(), E, torch.bfloat16),
                   x, w13, w2, weights, ids, None)
    shares = []
    for rank in (0, 1):
        local, expert_map = _ep_share(rank)
        mine = (expert_map >= 0).nonzero().flatten()  # this rank's global experts, in order
        kernel = _kernel(TsMoeExperts, FusedMoEQuantConfig.make(), local, torch.bfloat16)
        shares.append(_apply(kernel, x, w13[mine], w2[mine], weights, ids, expert_map))
    assert rel_err(shares[0].float() + shares[1].float(), whole) <= 1e-2


def _block_fp8(w13, w2):
    gq, gs = ts_moe.quantize_fp8(w13, BLOCKWISE)
    dq, ds = ts_moe.quantize_fp8(w2, BLOCKWISE)
    return gq, gs, dq, ds


@pytest.mark.parametrize("rank", [None, 1], ids=["all-experts", "ep-rank1"])
def test_block_fp8_experts_through_vllms_kernel_match_the_fp32_loop(rank):
    local, expert_map = (E, None) if rank is None else _ep_share(rank)
    x, w13, w2 = _weights(local, torch.bfloat16, seed=5)
    gq, gs, dq, ds = _block_fp8(w13, w2)
    quant = fp8_w8a8_moe_quant_config(w1_scale=gs, w2_scale=ds, block_shape=[128, 128])
    kernel = _kernel(TsMoeFp8Experts, quant, local, torch.bfloat16)
    weights, ids = route(T, E, TOP_K, seed=6)
    out = _apply(kernel, x, gq, dq, weights, ids, expert_map)
    # the loop on the dequantized weights and the rows as the experts quantize them
    # (per 1x128 channels: the tokens, and the SwiGLU output rounded to bf16)
    w13d, w2d = dequantize(gq, gs, BLOCKWISE, torch.float32), dequantize(dq, ds, BLOCKWISE,
                                                                           torch.float32)
    ref = experts_loop(fp8_rows(x), w13d, w2d, weights, ids, expert_map,
                       swiglu_out=lambda a: fp8_rows(a.bfloat16()[None])[0])
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert rel_err(out, ref) <= 1e-2
    exact = experts_loop(x, w13, w2, weights, ids, expert_map)  # unquantized: near, not equal
    assert 1e-3 < rel_err(out, exact) <= 0.1


def test_the_experts_read_vllms_tensors_in_place(monkeypatch):
    seen = []
    real = vllm_experts.run_experts

    def spy(x, ids, weights, experts, **kwargs):
        seen.append((x.data_ptr(), [t.data_ptr() for t in experts.tensors], kwargs))
        return real(x, ids, weights, experts, **kwargs)

    monkeypatch.setattr(vllm_experts, "run_experts", spy)
    x, w13, w2 = _weights(E, torch.bfloat16, seed=7)
    gq, gs, dq, ds = _block_fp8(w13, w2)
    quant = fp8_w8a8_moe_quant_config(w1_scale=gs, w2_scale=ds, block_shape=[128, 128])
    weights, ids = route(T, E, TOP_K, seed=8)
    _apply(_kernel(TsMoeFp8Experts, quant, E, torch.bfloat16), x, gq, dq, weights, ids, None)
    (x_ptr, tensors, kwargs), = seen
    assert x_ptr == x.data_ptr()  # the layer's activations, unquantized by vLLM
    assert tensors == [gq.data_ptr(), gs.data_ptr(), dq.data_ptr(), ds.data_ptr()]
    assert kwargs == {"decode_graphs": False}  # vLLM captures the graphs


def test_an_id_outside_the_expert_map_is_no_expert():
    expert_map = torch.tensor([-1, 0, 1, -1], dtype=torch.int32)
    ids = torch.tensor([[1, 2], [3, 0], [-1, 4], [2, 9]], dtype=torch.int32)
    local = vllm_experts.local_expert_ids(ids, expert_map)
    assert local.dtype == ids.dtype
    assert local.tolist() == [[0, 1], [-1, -1], [-1, -1], [1, -1]]
    assert vllm_experts.local_expert_ids(ids, None) is ids


def _supported(experts_cls, weight_key=None, activation_key=None, **fields):
    config = moe_config(experts=E, local_experts=E, top_k=TOP_K,
                        **{"hidden": H, "inter": I, "dtype": torch.bfloat16, **fields})
    return experts_cls.is_supported_config(experts_cls, config, weight_key, activation_key,
                                           STANDARD)


def test_the_experts_take_the_layers_they_serve():
    assert _supported(TsMoeExperts) == (True, None)
    assert _supported(TsMoeExperts, dtype=torch.float16) == (True, None)
    assert _supported(TsMoeFp8Experts, kFp8Static128BlockSym, kFp8Dynamic128Sym) == (True, None)


@pytest.mark.parametrize("fields, words", [
    ({"dtype": torch.float32}, "activations of torch.float32"),
    ({"activation": MoEActivation.GELU}, "MoEActivation.GELU activation"),
    ({"has_bias": True}, "expert biases"),
    ({"swiglu_limit": 7.0}, "a SwiGLU with swiglu_limit"),
    ({"swiglu_alpha": 1.702, "swiglu_beta": 1.0}, "a SwiGLU with swiglu_alpha, swiglu_beta"),
    ({"inter": 100}, "intermediate_size = 100 must be a multiple of 8"),
    ({"is_lora_enabled": True}, "LoRA"),
])
def test_what_the_experts_decline_is_named(fields, words):
    supported, reason = _supported(TsMoeExperts, **fields)
    assert not supported and words in reason


def test_the_fp8_experts_decline_other_schemes_and_unaligned_blocks():
    supported, reason = _supported(TsMoeFp8Experts)  # unquantized weights
    assert not supported and "quantization scheme" in reason
    supported, reason = _supported(TsMoeFp8Experts, kFp8Static128BlockSym, kFp8Dynamic128Sym,
                                   inter=192)
    assert not supported and "not both multiples of 128" in reason
    supported, reason = _supported(TsMoeExperts, kFp8Static128BlockSym, kFp8Dynamic128Sym)
    assert not supported and "quantization scheme" in reason


def test_the_experts_decline_a_device_without_ts_moes_kernels():
    with ts_moe.settings.override(reference=False):
        supported, reason = _supported(TsMoeExperts)
    assert not supported and "current device cpu" in reason


def test_a_call_vllm_should_not_make_is_refused_by_name():
    x, w13, w2 = _weights(E, torch.bfloat16, seed=9)
    experts = TsMoeExperts(moe_config=moe_config(experts=E, local_experts=E, hidden=H, inter=I,
                                                 top_k=TOP_K, dtype=torch.bfloat16),
                           quant_config=FusedMoEQuantConfig.make())
    weights, ids = route(T, E, TOP_K, seed=10)
    out = torch.empty_like(x)
    call = dict(output=out, hidden_states=x, w1=w13.bfloat16(), w2=w2.bfloat16(),
                topk_weights=weights, topk_ids=ids, activation=MoEActivation.SILU,
                global_num_experts=E, expert_map=None, a1q_scale=None, a2_scale=None,
                workspace13=None, workspace2=None, expert_tokens_meta=None,
                apply_router_weight_on_input=False)
    with pytest.raises(ValueError, match="activation must be MoEActivation.SILU"):
        experts.apply(**{**call, "activation": MoEActivation.GELU})
    with pytest.raises(ValueError, match="a1q_scale must be None"):
        experts.apply(**{**call, "a1q_scale": torch.ones(T, 2)})
    with pytest.raises(TypeError, match="gate_up_proj must have x's dtype"):
        experts.apply(**{**call, "w1": w13})  # fp32 weights for bf16 tokens
