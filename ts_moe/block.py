"""The MoE block's forward on the ops, below both :mod:`ts_moe.moe` (the public
functions and the module) and :mod:`ts_moe.decode_graphs` (which captures and
replays these functions, handed to it by the layer): the stages, each in an
NVTX range, and the block's argument checks::

    logits = x @ router.T                                   (T, E) router_logits
    weights, experts, slots = route_slots(logits, top_k)    (T, k) fp32, int64; slot order
    h = grouped_gemm_swiglu(x, gate_up_proj, offs,          (T*k, I): rows x[token]
                            a_index=token)
    y = grouped_gemm(h, down_proj^T, offs)                  (T*k, H)
    out = combine(y, weights, inverse)                      (T, H)
"""

import torch

from .checks import DTYPES
from .nvtx import nvtx_range
from .ops import combine, grouped_gemm, grouped_gemm_swiglu, route_slots, router_logits, \
    sort_slots
from .reference import SlotOrder, swiglu

FLOAT_DTYPES = DTYPES  # float64 runs the references (gradcheck)
SIZE_MULTIPLE = 8  # 16-byte rows of the bf16 activations the layer permutes


def check_layer_sizes(**sizes) -> None:
    """H and I of a layer: positive multiples of 8, named in the error."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
        if value % SIZE_MULTIPLE:
            raise ValueError(
                f"{name} = {value} must be a multiple of {SIZE_MULTIPLE} (the grouped GEMMs "
                f"read 16-byte rows of the layer's activations)")


def check_tensor(name, t, rank):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D, got shape {tuple(t.shape)}")


def check_expert_weights(x, gate_up_proj, down_proj, x_name):
    """Shapes (E, 2I, H) and (E, H, I) for x (T, H); one float dtype and device."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{x_name} must be bfloat16, float16, float32 or float64, got {x.dtype}")
    check_tensor("gate_up_proj", gate_up_proj, 3)
    check_tensor("down_proj", down_proj, 3)
    num_experts, two_inter, hidden = gate_up_proj.shape
    if hidden != x.shape[-1] or two_inter % 2:
        raise ValueError(
            f"gate_up_proj must be (E, 2I, H) with H = {x.shape[-1]} ({x_name}'s last dim), "
            f"got {tuple(gate_up_proj.shape)}")
    check_layer_sizes(hidden_size=hidden, intermediate_size=two_inter // 2)
    if tuple(down_proj.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(
            f"down_proj must be (E, H, I) = {(num_experts, hidden, two_inter // 2)} to match "
            f"gate_up_proj {tuple(gate_up_proj.shape)}, got {tuple(down_proj.shape)}")
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name} must have {x_name}'s dtype {x.dtype}, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but {x_name} is on {x.device}")


def experts_forward(x, experts, weights, gate_up_proj, down_proj, fused):
    check_tensor("x", x, 2)
    check_expert_weights(x, gate_up_proj, down_proj, "x")
    with nvtx_range("permute"):
        slots = sort_slots(experts, gate_up_proj.shape[0])
    return experts_in_slot_order(x, slots, weights, gate_up_proj, down_proj, fused)


def experts_in_slot_order(x: torch.Tensor, slots: SlotOrder, weights: torch.Tensor,
                           gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                           fused: bool) -> torch.Tensor:
    """The GEMMs and the combine of :func:`experts_forward`, the slots sorted."""
    with nvtx_range("gate_up"):  # the token rows gathered by the GEMM (a_index)
        if fused:
            h = grouped_gemm_swiglu(x, gate_up_proj, slots.offs, a_index=slots.token_index)
        else:
            h = swiglu(grouped_gemm(x, gate_up_proj.transpose(-2, -1), slots.offs,
                                    torch.float32, a_index=slots.token_index), x.dtype)
    with nvtx_range("down"):
        # the kernel ahead (gate_up's) wrote h only: the down weights may start
        # streaming under its tail (eager; a compiled graph orders kernels itself)
        y = grouped_gemm(h, down_proj.transpose(-2, -1), slots.offs,
                         prefetch_weights=not torch.compiler.is_compiling())
    with nvtx_range("combine"):
        return combine(y, weights, slots.inverse)


def moe_forward(hidden, router_weight, gate_up_proj, down_proj, top_k, fused,
                 return_router_logits, renormalize=True):
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have a last (hidden) dimension")
    x = hidden.reshape(-1, hidden.shape[-1])
    check_expert_weights(x, gate_up_proj, down_proj, "hidden")
    check_tensor("router_weight", router_weight, 2)
    if router_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"router_weight must be (E, H) with H = {hidden.shape[-1]}, "
            f"got {tuple(router_weight.shape)}")
    if router_weight.dtype != hidden.dtype:
        raise TypeError(
            f"router_weight must have the hidden dtype {hidden.dtype}, got {router_weight.dtype}")
    if gate_up_proj.shape[0] != router_weight.shape[0]:
        raise ValueError(
            f"router_weight has {router_weight.shape[0]} experts but gate_up_proj has "
            f"{gate_up_proj.shape[0]}")
    with nvtx_range("route"):
        logits = router_logits(x, router_weight)
        weights, _, slots = route_slots(logits, top_k, renormalize=renormalize)
    out = experts_in_slot_order(x, slots, weights, gate_up_proj, down_proj, fused)
    out = out.view(hidden.shape)
    return (out, logits) if return_router_logits else out
