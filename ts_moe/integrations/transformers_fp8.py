"""Hugging Face transformers' FP8 experts on ts_moe.

transformers 5 loads FP8 MoE checkpoints (``FineGrainedFP8Config``: DeepSeek-V3,
Qwen ``-FP8``) into ``FP8Experts`` modules, whose forward it picks from
``FP8ExpertsInterface`` by ``config._experts_implementation``.  :func:`register`
adds ``"ts_moe"`` there (:func:`ts_moe.integrations.transformers.register` calls
it), so ``experts_implementation="ts_moe"`` serves FP8 models as it serves bf16
ones; :func:`fp8_scales` gives ``replace_moe_blocks``' switched blocks the scales.

An ``FP8Experts`` module holds ``gate_up_proj`` (E, 2I, H) and ``down_proj``
(E, H, I) in e4m3 with ``*_scale_inv`` fp32 dequantization multipliers:
(E, ceil(N/128), ceil(K/128)) for ``block_size = (128, 128)``; per tensor
(``block_size`` None) (E, 1, 1), or (E, 2, 1) for ``gate_up_proj`` (the gate and
the up half each their own).  ts_moe's FP8 ops have no backward: a gradient
through the experts (to their input, or to the weights and scales, which
transformers makes parameters that require grad) raises NotImplementedError;
call the model under ``torch.no_grad()`` or ``torch.inference_mode()``.
Activations are quantized per token (per 128 channels for blockwise weights),
also for ``activation_scheme="static"`` checkpoints, whose calibrated input scales
are not used.
"""

import torch
from torch import nn

from ..fp8.layer import is_fp8
from ..moe import experts_forward

EXPERTS_IMPLEMENTATION = "ts_moe"
BLOCK_SIZE = (128, 128)


def is_fp8_experts(experts: nn.Module) -> bool:
    """Whether ``experts`` holds e4m3 ``gate_up_proj`` / ``down_proj`` (an ``FP8Experts``)."""
    return is_fp8(getattr(experts, "gate_up_proj", None))


def check_fp8_experts(experts: nn.Module, name: str | None = None) -> None:
    """NotImplementedError naming what an ``FP8Experts`` module has that ts_moe lacks."""
    flag = getattr
    block = flag(experts, "block_size", None)
    scale = flag(experts, "gate_up_proj_scale_inv", None)
    unsupported = [what for what, bad in (
        ("biases", flag(experts, "has_bias", False)),
        ("experts without a gate", not flag(experts, "has_gate", True)),
        ("transposed weights", flag(experts, "is_transposed", False)),
        ("interleaved gate/up weights", not flag(experts, "is_concatenated", True)),
        ("a post-expert norm", flag(experts, "has_post_expert_norm", False)),
        (f"block size {block} (served: {BLOCK_SIZE} or per tensor)",
         block is not None and tuple(block) != BLOCK_SIZE),
        ("scales other than float32 (e.g. UE8M0)",
         not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32),
        ("a clamped, soft-capped or alpha-scaled SwiGLU",
         any(flag(experts, a, None) is not None for a in ("limit", "gate_softcap",
                                                           "up_softcap", "swiglu_alpha"))),
        ("an activation other than SiLU",
         type(flag(experts, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation")),
    ) if bad]
    if unsupported:
        raise NotImplementedError(
            f"{name or type(experts).__name__}: experts_implementation="
            f"'{EXPERTS_IMPLEMENTATION}' does not support FP8 experts with "
            f"{', '.join(unsupported)}")


def fp8_scales(experts: nn.Module) -> dict:
    """``{"gate_up_scale", "down_scale"}`` of an ``FP8Experts`` module for
    :func:`ts_moe.experts_forward` (blockwise as they are; per tensor: the gate and
    up halves' scales spread over their channels, (E, 2I), and down's (E,)); ``{}``
    for bf16 experts."""
    if not is_fp8_experts(experts):
        return {}
    gate_up, down = experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv
    if getattr(experts, "block_size", None) is None:  # (E, 1 or 2, 1) and (E, 1, 1)
        gate_up = _per_channel(experts, gate_up)
        down = down.reshape(-1)
    return {"gate_up_scale": gate_up, "down_scale": down}


def _per_channel(experts: nn.Module, scale: torch.Tensor) -> torch.Tensor:
    """Per-tensor gate/up scales (E, 1 or 2, 1) spread over the 2I channels, (E, 2I):
    made once and kept on the module while the scales stay the same tensor, unchanged
    (so that a decode graph, which keys on the weights' addresses, finds it again)."""
    rows = experts.gate_up_proj.shape[1]

    def spread(s):
        return s[..., 0].repeat_interleave(rows // max(s.shape[1], 1), dim=1)

    if torch.is_grad_enabled() and scale.requires_grad:
        return spread(scale)  # in the autograd graph: a gradient through it raises
    key = (scale.data_ptr(), scale._version, scale.shape)
    kept = getattr(experts, "_ts_moe_gate_up_scale", None)
    if kept is None or kept[0] != key:
        kept = (key, spread(scale.detach()))
        experts._ts_moe_gate_up_scale = kept
    return kept[1]


def ts_moe_fp8_experts_forward(self: nn.Module, hidden_states: torch.Tensor,
                               top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' FP8 experts-interface entry: ``(T, H), (T, k) ids, (T, k) weights
    -> (T, H)`` on ts_moe's FP8 layer (module docstring).  Expert-parallel sentinel
    ids (>= E) are dropped."""
    check_fp8_experts(self)
    return experts_forward(hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
                           self.down_proj, **fp8_scales(self))


def register() -> bool:
    """Add ``"ts_moe"`` to transformers' ``FP8ExpertsInterface``; False where this
    transformers has none (no FP8 experts to serve).  Idempotent."""
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:
        return False
    FP8ExpertsInterface.register(EXPERTS_IMPLEMENTATION, ts_moe_fp8_experts_forward)
    return True
