"""Hugging Face transformers' experts modules as ts_moe's experts value
(:mod:`ts_moe.experts`): :func:`module_experts` makes one of a module, whatever it
holds, and :func:`check_experts_module` says what a module has that ts_moe lacks.
The swaps of :mod:`ts_moe.integrations.transformers` call these two and nothing
else of the module's format.

- bf16/fp16/fp32 experts (``MixtralExperts`` and any experts class with
  ``@use_experts_implementation`` and Mixtral-style weights): ``gate_up_proj``
  (E, 2I, H) and ``down_proj`` (E, H, I), used as they are;
- FP8 experts: transformers 5 loads FP8 MoE checkpoints (``FineGrainedFP8Config``:
  DeepSeek-V3, Qwen ``-FP8``) into ``FP8Experts`` modules, whose ``gate_up_proj``
  (E, 2I, H) and ``down_proj`` (E, H, I) are e4m3 with ``*_scale_inv`` fp32
  dequantization multipliers: (E, ceil(N/128), ceil(K/128)) for ``block_size = (128,
  128)`` (the blockwise recipe); per tensor (``block_size`` None) (E, 1, 1), or (E, 2,
  1) for ``gate_up_proj`` (the gate and the up half each their own), served as
  per-channel gate/up scales (the rowwise recipe, the same values) and a per-expert
  down scale (tensorwise).  ts_moe's FP8 ops have no backward: a gradient through the
  experts (to their input, or to the weights and scales, which transformers makes
  parameters that require grad) raises NotImplementedError; call the model under
  ``torch.no_grad()`` or ``torch.inference_mode()``.  Activations are quantized per
  token (per 128 channels for blockwise weights), also for
  ``activation_scheme="static"`` checkpoints, whose calibrated input scales are not
  used.
"""

import functools

import torch
from torch import nn

from ..experts import ExpertWeights, Fp8ExpertWeights, check_layer_sizes
from ..fp8.recipes import E4M3, Recipe

EXPERTS_IMPLEMENTATION = "ts_moe"
BLOCK_SIZE = (128, 128)

# what the checks compare against, from transformers: resolved once, eagerly (by
# register() or the first check), never inside a torch.compile trace, which
# cannot follow transformers' lazy-module imports ("Bad import result")
_HF: dict = {}


def hf() -> dict:
    if not _HF:
        from transformers import activations
        from transformers.integrations import moe as hf_moe

        _HF["silu_types"] = (nn.SiLU, getattr(activations, "SiLUActivation", nn.SiLU))
        _HF["default_apply_gate"] = getattr(hf_moe, "_default_apply_gate", None)
    return _HF


def is_silu(act) -> bool:
    return isinstance(act, hf()["silu_types"])


def is_fp8_experts(experts: nn.Module) -> bool:
    """Whether ``experts`` holds e4m3 ``gate_up_proj`` / ``down_proj`` (an ``FP8Experts``)."""
    gate_up = getattr(experts, "gate_up_proj", None)
    return isinstance(gate_up, torch.Tensor) and gate_up.dtype == E4M3


def check_sizes(name: str, hidden: int, inter: int) -> None:
    """H and I as the ts_moe layer takes them, or a ValueError naming the module."""
    try:
        check_layer_sizes(hidden_size=hidden, intermediate_size=inter)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def check_experts_module(experts: nn.Module, name: str | None = None) -> None:
    """NotImplementedError naming what the experts module has that ts_moe lacks (its
    flags as transformers 5.x sets them: older 5.x releases lack some, whose defaults
    are the Mixtral layout), or a ValueError naming a size the layer does not take."""
    name = name or type(experts).__name__
    flag = functools.partial(getattr, experts)
    common = [("biases", flag("has_bias", False)),
              ("experts without a gate", not flag("has_gate", True)),
              ("transposed weights", flag("is_transposed", False)),
              ("interleaved gate/up weights", not flag("is_concatenated", True)),
              ("a post-expert norm", flag("has_post_expert_norm", False))]
    if is_fp8_experts(experts):
        block = flag("block_size", None)
        scale = flag("gate_up_proj_scale_inv", None)
        own = [(f"block size {block} (served: {BLOCK_SIZE} or per tensor)",
                block is not None and tuple(block) != BLOCK_SIZE),
               ("scales other than float32 (e.g. UE8M0)",
                not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32),
               ("a clamped, soft-capped or alpha-scaled SwiGLU",
                any(flag(a, None) is not None for a in ("limit", "gate_softcap", "up_softcap",
                                                        "swiglu_alpha"))),
               ("an activation other than SiLU",
                type(flag("act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"))]
        what = "FP8 experts with "
    else:
        own = [("a custom gating function",
                getattr(type(experts), "_apply_gate", None) is not hf()["default_apply_gate"]),
               ("an activation other than SiLU", not is_silu(experts.act_fn))]
        what = ""
    unsupported = [w for w, bad in common + own if bad]
    if unsupported:
        raise NotImplementedError(
            f"{name}: experts_implementation='{EXPERTS_IMPLEMENTATION}' does not support "
            f"{what}{', '.join(unsupported)}")
    _, two_inter, hidden = experts.gate_up_proj.shape
    check_sizes(name, hidden, two_inter // 2)


def module_experts(experts: nn.Module) -> ExpertWeights:
    """The experts value of a module (module docstring), its tensors as they are, but
    for per-tensor gate/up scales, which are spread over their channels."""
    if not is_fp8_experts(experts):
        return ExpertWeights(experts.gate_up_proj, experts.down_proj)
    gate_up, down = experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv
    if getattr(experts, "block_size", None) is not None:
        recipes = (Recipe.BLOCKWISE_128X128, Recipe.BLOCKWISE_128X128)
    else:  # (E, 1 or 2, 1) and (E, 1, 1)
        gate_up, down = _per_channel(experts, gate_up), down.reshape(-1)
        recipes = (Recipe.ROWWISE, Recipe.TENSORWISE)
    return Fp8ExpertWeights(experts.gate_up_proj, experts.down_proj, gate_up, down, recipes)


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
