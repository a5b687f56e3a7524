"""Run Hugging Face transformers' Mixtral MoE blocks on ts_moe.

* :func:`replace_moe_blocks` switches every ``MixtralSparseMoeBlock`` of a
  model to ts_moe, in place, for transformers 4.x and 5.x.
* :func:`register` (transformers >= 5) adds ``"ts_moe"`` to transformers'
  experts interface, so ``from_pretrained(..., experts_implementation="ts_moe")``
  (or ``model.set_experts_implementation("ts_moe")``) runs the experts of any
  model whose experts class uses ``@use_experts_implementation`` with
  Mixtral-style weights through ts_moe.

Both train: the ts_moe ops and the layer have backward formulas, so the
router, ``gate_up_proj`` and ``down_proj`` get gradients.

Hidden and intermediate sizes must be multiples of 8 (the kernels read 16-byte
rows): :func:`replace_moe_blocks` checks every block before it switches any;
the experts interface, whose switch transformers makes, checks a module at
its first forward.  Either way the ValueError names the module and the size.
"""

import functools

import torch
from torch import nn

from ..moe import check_layer_sizes, experts_forward
from ..nvtx import nvtx_range
from ..ops import route
from . import transformers_fp8

EXPERTS_IMPLEMENTATION = "ts_moe"


# what the checks compare against, from transformers: resolved once, eagerly (by
# register() or the first check), never inside a torch.compile trace, which
# cannot follow transformers' lazy-module imports ("Bad import result")
_HF: dict = {}


def _hf() -> dict:
    if not _HF:
        from transformers import activations
        from transformers.integrations import moe as hf_moe

        _HF["silu_types"] = (nn.SiLU, getattr(activations, "SiLUActivation", nn.SiLU))
        _HF["default_apply_gate"] = getattr(hf_moe, "_default_apply_gate", None)
    return _HF


def _is_silu(act) -> bool:
    return isinstance(act, _hf()["silu_types"])


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
        out = experts_forward(x, ids, weights, self.experts.gate_up_proj, self.experts.down_proj,
                              **transformers_fp8.fp8_scales(self.experts))  # FP8 experts
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
        out = experts_forward(x, ids, weights, self.gate_up_proj, self.down_proj)
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
    if isinstance(experts, nn.ModuleList):
        acts, layout = [e.act_fn for e in experts], _V4Forward
    elif hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
        acts, layout = [experts.act_fn], _V5Forward
        if transformers_fp8.is_fp8_experts(experts):
            transformers_fp8.check_fp8_experts(experts, name)
    else:
        raise ValueError(
            f"{name}: unknown Mixtral experts layout {type(experts).__name__} (expected a "
            f"ModuleList of w1/w2/w3 experts or gate_up_proj/down_proj parameters)")
    if not all(_is_silu(act) for act in acts):
        raise ValueError(f"{name}: ts_moe runs SwiGLU experts only (hidden_act='silu')")
    if layout is _V4Forward:  # each expert's w1 (I, H); the stack needs them alike
        shapes = {tuple(e.w1.weight.shape) for e in experts}
        if len(shapes) != 1:
            raise ValueError(f"{name}: the experts' w1 shapes differ: {sorted(shapes)}")
        (inter, hidden), = shapes
    else:
        _, two_inter, hidden = experts.gate_up_proj.shape
        inter = two_inter // 2
    _check_sizes(name, hidden, inter)
    return layout


def _check_sizes(name: str, hidden: int, inter: int) -> None:
    """H and I as the ts_moe layer takes them, or a ValueError naming the module."""
    try:
        check_layer_sizes(hidden_size=hidden, intermediate_size=inter)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


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


def _check_experts_module(self: nn.Module) -> None:
    """NotImplementedError naming what the experts module ``self`` has that ts_moe lacks."""
    # the flags as transformers 5.x sets them (older 5.x releases lack some:
    # their defaults are the Mixtral layout)
    flag = functools.partial(getattr, self)
    unsupported = [what for what, bad in (
        ("biases", flag("has_bias", False)), ("experts without a gate", not flag("has_gate", True)),
        ("transposed weights", flag("is_transposed", False)),
        ("interleaved gate/up weights", not flag("is_concatenated", True)),
        ("a post-expert norm", flag("has_post_expert_norm", False)),
        ("a custom gating function", getattr(type(self), "_apply_gate", None)
         is not _hf()["default_apply_gate"]),
        ("an activation other than SiLU", not _is_silu(self.act_fn))) if bad]
    if unsupported:
        raise NotImplementedError(
            f"experts_implementation='{EXPERTS_IMPLEMENTATION}' does not support "
            f"{', '.join(unsupported)} ({type(self).__name__})")


def ts_moe_experts_forward(self: nn.Module, hidden_states: torch.Tensor,
                           top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts-interface entry: ``(T, H), (T, k) ids, (T, k) weights -> (T, H)``.

    ``self`` is the model's experts module (``gate_up_proj`` (E, 2I, H),
    ``down_proj`` (E, H, I)).  Expert-parallel sentinel ids (>= E) are dropped.
    """
    _check_experts_module(self)
    _, two_inter, hidden = self.gate_up_proj.shape
    _check_sizes(type(self).__name__, hidden, two_inter // 2)
    x = hidden_states.to(self.gate_up_proj.dtype)
    return experts_forward(x, top_k_index, top_k_weights, self.gate_up_proj,
                           self.down_proj).to(hidden_states.dtype)


def register() -> None:
    """Make ``experts_implementation="ts_moe"`` selectable (transformers >= 5).

    Registers :func:`ts_moe_experts_forward` in transformers' global
    ``ExpertsInterface`` mapping; idempotent.
    """
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:
        raise RuntimeError(
            "ts_moe.integrations.transformers.register needs transformers >= 5 "
            "(transformers.integrations.moe.ExpertsInterface)") from e
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, ts_moe_experts_forward)
    transformers_fp8.register()  # FP8Experts modules (FineGrainedFP8Config checkpoints)
    _hf()  # before any compiled forward reaches the checks
