"""ts_moe's experts as vLLM 0.33 modular-MoE experts: :class:`TsMoeExperts` (bf16/fp16
weights) and :class:`TsMoeFp8Experts` (e4m3 weights with 128x128 block scales, the token
rows quantized per 1x128 channels by ts_moe), each a ``FusedMoEExpertsModular`` that
vLLM's ``FusedMoEKernel`` runs behind its prepare/finalize.

The layouts agree, so nothing is copied: vLLM's ``w13_weight`` (E, 2I, H), gate rows then
up rows, is ts_moe's ``gate_up_proj``; ``w2_weight`` (E, H, I) is ``down_proj``;
``w13_weight_scale_inv`` (E, 2I/128, H/128) and ``w2_weight_scale_inv`` (E, H/128, I/128)
are the blockwise recipe's scales (dequantization multipliers, as ts_moe takes them).
A call::

    ids = expert_map[topk_ids]      expert parallel: -1 for another rank's expert, a slot
                                    ts_moe drops (no expert_map: the ids as they are)
    out = ts_moe's experts forward  the slots sorted by expert, the gate/up GEMM with the
                                    SwiGLU, the down GEMM, the weighted combine (fp32 sums)
    output <- out                   finalize's reduce is then a no-op: the sum is done

ts_moe runs eagerly here (no decode graph of its own): vLLM captures the model's CUDA
graphs, and ts_moe's ops never sync with the host on its kernel path, so they capture.

What the experts serve is said by vLLM's own hook, :meth:`~TsMoeExperts.is_supported_config`,
which names what a layer has that they lack: SiLU
gate/up (no clamp, no alpha/beta, no bias, no LoRA), bf16/fp16 activations, H and I
multiples of 8 (of 128 for FP8), every token of the layer on this rank (no all-to-all
dispatch: tensor parallel, or expert parallel over all-gathered tokens with an
``expert_map``), on an sm_90 GPU (ts_moe's kernels; elsewhere only while
``ts_moe.settings.reference`` is on, the plain-torch reference, for testing).
"""

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.model_executor.layers.quantization.utils.quant_utils import (kFp8Dynamic128Sym,
                                                                      kFp8Static128BlockSym)
from vllm.platforms import current_platform

from ..experts import ExpertWeights, Fp8ExpertWeights, check_layer_sizes
from ..fp8.recipes import BLOCK, Recipe
from ..moe import run_experts
from ..settings import settings

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
HOPPER = 90  # the capability family of ts_moe's kernels (sm_90a)
BLOCK_SHAPE = [BLOCK, BLOCK]  # vLLM's block FP8 weights ts_moe serves
BLOCK_RECIPES = (Recipe.BLOCKWISE_128X128, Recipe.BLOCKWISE_128X128)
SWIGLU_PARAMETERS = ("swiglu_limit", "swiglu_alpha", "swiglu_beta")


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """The ids ts_moe routes on: ``topk_ids`` as they are without an ``expert_map``;
    with one (global id -> this rank's id, -1 for another rank's expert), the mapped ids,
    and -1 for an id outside the map (read nowhere: ts_moe drops a slot outside [0, E))."""
    if expert_map is None:
        return topk_ids
    last = expert_map.shape[0] - 1
    inside = (topk_ids >= 0) & (topk_ids <= last)
    return torch.where(inside, expert_map[topk_ids.clamp(0, last)].to(topk_ids.dtype), -1)


def _on_served_device() -> bool:
    """An sm_90 GPU (ts_moe's kernels), or any device while the reference is forced."""
    if settings.reference:
        return True
    return current_platform.is_cuda() and current_platform.is_device_capability_family(HOPPER)


class TsMoeExperts(mk.FusedMoEExpertsModular):
    """bf16/fp16 experts on ts_moe (module docstring)."""

    SIZE_MULTIPLE = None  # H and I: as ts_moe's layer takes them (check_layer_sizes)
    WEIGHT_KIND = "bf16/fp16"

    @staticmethod
    def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
        """vLLM's checks of the layer, then ts_moe's own: ``(True, None)`` or ``(False,
        reason)`` naming what the layer has that ts_moe lacks."""
        supported, reason = mk.FusedMoEExperts.is_supported_config(
            cls, moe_config, weight_key, activation_key, activation_format)
        if not supported:
            return supported, reason
        reason = cls.layer_reason(moe_config)
        return reason is None, reason

    @classmethod
    def layer_reason(cls, moe_config) -> str | None:
        """What of the layer's own configuration ts_moe does not serve, or None."""
        if moe_config.in_dtype not in ACTIVATION_DTYPES:
            return f"activations of {moe_config.in_dtype} (served: bfloat16, float16)"
        if moe_config.has_bias:
            return "expert biases"
        clamped = [name for name in SWIGLU_PARAMETERS
                   if getattr(moe_config, name, None) is not None]
        if clamped:
            return f"a SwiGLU with {', '.join(clamped)}"
        hidden, inter = moe_config.hidden_dim, moe_config.intermediate_size_per_partition
        try:
            check_layer_sizes(hidden_size=hidden, intermediate_size=inter)
        except ValueError as exc:
            return str(exc)
        if cls.SIZE_MULTIPLE and (hidden % cls.SIZE_MULTIPLE or inter % cls.SIZE_MULTIPLE):
            return (f"hidden size {hidden} and intermediate size {inter} per rank that are "
                    f"not both multiples of {cls.SIZE_MULTIPLE}")
        return None

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True  # the layer's activations as they are: ts_moe quantizes FP8 rows itself

    @staticmethod
    def _supports_current_device() -> bool:
        return _on_served_device()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return weight_key is None and activation_key is None

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return not moe_parallel_config.use_all2all_kernels

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        return (0,), (0,), (M, K)  # ts_moe keeps its own intermediates

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

    def expert_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
        """ts_moe's experts value on vLLM's tensors, in place."""
        return ExpertWeights(w1, w2)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        """``output`` (T, H) <- sum over k of ``topk_weights[t, k]`` times expert
        ``topk_ids[t, k]``'s SwiGLU MLP of ``hidden_states[t]`` (of this rank's experts;
        with ``apply_router_weight_on_input`` the weights are already in the tokens)."""
        if activation != MoEActivation.SILU:
            raise ValueError(f"activation must be MoEActivation.SILU for ts_moe's experts, "
                             f"got {activation}")
        if a1q_scale is not None:
            raise ValueError("a1q_scale must be None: ts_moe's experts take the layer's "
                             "activations unquantized (expects_unquantized_inputs)")
        ids = local_expert_ids(topk_ids, expert_map)
        weights = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
        out = run_experts(hidden_states, ids, weights, self.expert_weights(w1, w2),
                          decode_graphs=False)
        output.copy_(out)


class TsMoeFp8Experts(TsMoeExperts):
    """e4m3 experts with 128x128 block scales (vLLM's ``weight_block_size: [128, 128]``
    checkpoints, DeepSeek-V3 and Qwen3 ``-FP8``); ts_moe quantizes the token rows and the
    SwiGLU output per 1x128 channels itself (module docstring)."""

    SIZE_MULTIPLE = BLOCK
    WEIGHT_KIND = "block FP8 (128x128 weights, 1x128 activations)"

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return weight_key == kFp8Static128BlockSym and activation_key == kFp8Dynamic128Sym

    def expert_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
        if self.block_shape != BLOCK_SHAPE:
            raise ValueError(f"block_shape must be {BLOCK_SHAPE} for ts_moe's FP8 experts, "
                             f"got {self.block_shape}")
        return Fp8ExpertWeights(w1, w2, self.w1_scale, self.w2_scale, BLOCK_RECIPES)
