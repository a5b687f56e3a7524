"""The MoE block's forward on the ops, below both :mod:`ts_moe.moe` (the public
functions and the module) and :mod:`ts_moe.decode_graphs` (which captures and
replays these functions, handed to it by the layer): the stages, each in an
NVTX range, and the block's argument checks.  Written once over the experts'
value (:mod:`ts_moe.experts`: bf16 stacks, or FP8 stacks with their scales and
recipe), whose two GEMMs it calls::

    logits = x @ router.T                                   (T, E) router_logits
    weights, experts, slots = route_slots(logits, top_k)    (T, k) fp32, int64; slot order
    h = experts.gate_up(x, slots)                           (T*k, I): rows x[token], SwiGLU
    y = experts.down(h, slots)                              (T*k, H)
    out = combine(y, weights, inverse)                      (T, H)
"""

import torch

from . import experts_grad
from .experts import ExpertWeights, check_tensor
from .nvtx import nvtx_range
from .ops import combine, route_slots, router_logits, sort_slots
from .reference import SlotOrder


def experts_forward(x, experts, weights, expert_weights: ExpertWeights, fused):
    check_tensor("x", x, 2)
    expert_weights.check(x, "x")
    for name, t in (("experts", experts), ("weights", weights)):
        if isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    with nvtx_range("permute"):
        slots = sort_slots(experts, expert_weights.num_experts)
    return experts_in_slot_order(x, slots, weights, expert_weights, fused)


def experts_in_slot_order(x: torch.Tensor, slots: SlotOrder, weights: torch.Tensor,
                          experts: ExpertWeights, fused: bool) -> torch.Tensor:
    """The GEMMs and the combine of :func:`experts_forward`, the slots sorted.  Under
    autograd, bf16/fp16/fp32 experts with the fused SwiGLU are one node whose backward
    knows the slot order (:mod:`ts_moe.experts_grad`)."""
    if (fused and experts.scale_recipe is None
            and experts_grad.wants_node(x, weights, *experts.tensors)):
        with nvtx_range("experts"):
            return experts_grad.experts(x, weights, *experts.tensors, slots)
    with nvtx_range("gate_up"):  # the token rows gathered by the GEMM (a_index)
        h = experts.gate_up(x, slots, fused)
    with nvtx_range("down"):
        y = experts.down(h, slots)
    with nvtx_range("combine"):
        return combine(y, weights, slots.inverse)


def moe_forward(hidden, router_weight, experts: ExpertWeights, top_k, fused,
                return_router_logits, renormalize=True):
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have a last (hidden) dimension")
    x = hidden.reshape(-1, hidden.shape[-1])
    experts.check(x, "hidden")
    check_tensor("router_weight", router_weight, 2)
    if router_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"router_weight must be (E, H) with H = {hidden.shape[-1]}, "
            f"got {tuple(router_weight.shape)}")
    if router_weight.dtype != hidden.dtype:
        raise TypeError(
            f"router_weight must have the hidden dtype {hidden.dtype}, got {router_weight.dtype}")
    if experts.num_experts != router_weight.shape[0]:
        raise ValueError(
            f"router_weight has {router_weight.shape[0]} experts but gate_up_proj has "
            f"{experts.num_experts}")
    with nvtx_range("route"):
        logits = router_logits(x, router_weight)
        weights, _, slots = route_slots(logits, top_k, renormalize=renormalize)
    out = experts_in_slot_order(x, slots, weights, experts, fused)
    out = out.view(hidden.shape)
    return (out, logits) if return_router_logits else out
