"""Run Hugging Face transformers' Mixtral MoE blocks on ts_moe.

* :func:`replace_moe_blocks` switches every ``MixtralSparseMoeBlock`` of a
  model to ts_moe, in place, for transformers 4.x and 5.x.
* :func:`register` (transformers >= 5) adds ``"ts_moe"`` to transformers'
  experts interfaces, so ``from_pretrained(..., experts_implementation="ts_moe")``
  (or ``model.set_experts_implementation("ts_moe")``) runs the experts of any
  model whose experts class uses ``@use_experts_implementation`` with
  Mixtral-style weights through ts_moe, bf16 and FP8 (``FP8Experts``) alike.

bf16, fp16 or fp32 experts and FP8 ones are one value to both
(:mod:`ts_moe.integrations.transformers_experts` makes it of a module): bf16
experts train (the ts_moe ops and the layer have backward formulas, so the
router, ``gate_up_proj`` and ``down_proj`` get gradients); FP8 ones serve
inference.

Hidden and intermediate sizes must be multiples of 8 (the kernels read 16-byte
rows): :func:`replace_moe_blocks` checks every block before it switches any;
the experts interface, whose switch transformers makes, checks a module at
its first forward.  Either way the ValueError names the module and the size.
"""

import functools

import torch
from torch import nn

from ..experts import ExpertWeights
from ..moe import run_experts
from ..nvtx import nvtx_range
from ..ops import route
from .transformers_experts import (EXPERTS_IMPLEMENTATION, check_experts_module, check_sizes,
                                   hf, is_silu, module_experts)


class _V5Forward:
    """transformers 5: ``gate`` is a ``MixtralTopKRouter`` returning (logits, weights, ids),
    ``experts`` a ``MixtralExperts`` with ``gate_up_proj`` (E, 2I, H) and
    ``down_proj`` (E, H, I); the block returns the hidden states only.  The
    gate module is still called, so transformers' output-recording hooks on it
    still collect the router logits for the auxiliary loss."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.training and self.jitter_noise > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        with nvtx_range("route"):
            _, weights, ids = self.gate(x)
        out = run_experts(x, ids, weights, module_experts(self.experts))
        return out.view(hidden_states.shape)


class _V4Forward:
    """transformers 4: ``gate`` is an ``nn.Linear`` (H -> E); the experts are fused into
    ``gate_up_proj`` / ``down_proj`` parameters; the block returns
    ``(hidden_states, router_logits)`` as the original does."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.training and self.jitter_noise > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        with nvtx_range("route"):
            router_logits = self.gate(x)
            weights, ids = route(router_logits, self.top_k)
        out = run_experts(x, ids, weights, ExpertWeights(self.gate_up_proj, self.down_proj))
        return out.view(hidden_states.shape), router_logits


@functools.cache
def _ts_moe_class(base: type, forward_mixin: type) -> type:
    """``base`` with ts_moe's forward: still an instance of ``base`` for isinstance checks
    (transformers 4 records the router logits on ``MixtralSparseMoeBlock`` outputs)."""
    return type(f"TsMoe{base.__name__}", (forward_mixin, base), {"__module__": __name__})


def _layout(name: str, block: nn.Module) -> type:
    """The forward mixin for ``block`` (transformers 4.x or 5.x), or a ValueError naming it."""
    if "forward" in vars(block):
        raise ValueError(
            f"{name}: the block's forward is overridden on the instance (e.g. by accelerate "
            f"hooks); call replace_moe_blocks before dispatching or offloading the model")
    experts = block.experts
    if hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
        check_experts_module(experts, name)  # bf16 and FP8 alike
        return _V5Forward
    if not isinstance(experts, nn.ModuleList):
        raise ValueError(
            f"{name}: unknown Mixtral experts layout {type(experts).__name__} (expected a "
            f"ModuleList of w1/w2/w3 experts or gate_up_proj/down_proj parameters)")
    if not all(is_silu(e.act_fn) for e in experts):
        raise ValueError(f"{name}: ts_moe runs SwiGLU experts only (hidden_act='silu')")
    shapes = {tuple(e.w1.weight.shape) for e in experts}  # each expert's w1 (I, H)
    if len(shapes) != 1:  # the stack needs them alike
        raise ValueError(f"{name}: the experts' w1 shapes differ: {sorted(shapes)}")
    (inter, hidden), = shapes
    check_sizes(name, hidden, inter)
    return _V4Forward


def _switch_block(block: nn.Module, layout: type) -> None:
    if layout is _V4Forward:
        experts = block.experts
        gate_up = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in experts])
        down = torch.stack([e.w2.weight for e in experts])
        trainable = any(p.requires_grad for p in experts.parameters())
        del block.experts
        block.gate_up_proj = nn.Parameter(gate_up.detach(), requires_grad=trainable)
        block.down_proj = nn.Parameter(down.detach(), requires_grad=trainable)
    block.__class__ = _ts_moe_class(type(block), layout)


def replace_moe_blocks(model: nn.Module) -> int:
    """Switch every Mixtral sparse MoE block of ``model`` to ts_moe, in place; returns how many.

    A block is a module whose class is named ``MixtralSparseMoeBlock``.  Its
    class becomes a subclass with ts_moe's forward (so ``isinstance`` checks
    against the original class still hold); its ``gate`` module stays, and so
    do hooks on it and on the block.

    * transformers 5.x: ``experts.gate_up_proj`` (E, 2I, H) and
      ``experts.down_proj`` (E, H, I) are used as they are, no copy, and the
      state dict keeps its keys.  Routing is the gate's own (top-k of
      the fp32 softmax, renormalised, ties as ``torch.topk`` breaks them); the
      block returns the hidden states.
    * transformers 4.x: the experts' ``w1``/``w3`` (gate/up, (I, H)) are
      stacked into a ``gate_up_proj`` (E, 2I, H) parameter and ``w2`` into
      ``down_proj`` (E, H, I), and the ``experts`` ModuleList is removed.  That
      is a copy (the per-expert weights are separate tensors, no view can fuse
      them) and it changes the block's state-dict keys.  Routing is
      :func:`ts_moe.route` on the gate's logits (exact ties go to the
      lower expert index, where ``torch.topk`` has no rule); the block returns
      ``(hidden_states, router_logits)`` like the original.

    Call it before accelerate dispatch/offload hooks are attached to the blocks.
    """
    blocks = [(m, _layout(name or type(model).__name__, m)) for name, m in model.named_modules()
              if type(m).__name__ == "MixtralSparseMoeBlock"]  # all checked before any switch
    for block, layout in blocks:
        _switch_block(block, layout)
    return len(blocks)


def ts_moe_experts_forward(self: nn.Module, hidden_states: torch.Tensor,
                           top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts-interface entry, for its bf16 and its FP8 experts alike:
    ``(T, H), (T, k) ids, (T, k) weights -> (T, H)``.

    ``self`` is the model's experts module (``gate_up_proj`` (E, 2I, H),
    ``down_proj`` (E, H, I), e4m3 with their scales for ``FP8Experts``).
    Expert-parallel sentinel ids (>= E) are dropped.
    """
    check_experts_module(self)
    experts = module_experts(self)
    x = hidden_states.to(experts.input_dtype(hidden_states.dtype))
    return run_experts(x, top_k_index, top_k_weights, experts).to(hidden_states.dtype)


def register() -> None:
    """Make ``experts_implementation="ts_moe"`` selectable (transformers >= 5).

    Registers :func:`ts_moe_experts_forward` in transformers' global
    ``ExpertsInterface`` mapping, and in ``FP8ExpertsInterface`` where this
    transformers has one (``FP8Experts`` modules: ``FineGrainedFP8Config``
    checkpoints); idempotent.
    """
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:
        raise RuntimeError(
            "ts_moe.integrations.transformers.register needs transformers >= 5 "
            "(transformers.integrations.moe.ExpertsInterface)") from e
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, ts_moe_experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # no FP8 experts to serve
        pass
    else:
        FP8ExpertsInterface.register(EXPERTS_IMPLEMENTATION, ts_moe_experts_forward)
    hf()  # before any compiled forward reaches the checks
