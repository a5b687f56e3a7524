"""The MoE layer on FP8 expert weights: what :func:`ts_moe.moe_forward`,
:func:`ts_moe.experts_forward` and :class:`ts_moe.MoE` run when given e4m3 experts
and their scales.

Weights as checkpoints store them, in the layer's layouts: ``gate_up_proj`` (E, 2I, H)
e4m3, gate rows first, ``down_proj`` (E, H, I) e4m3, each with a fp32 scale whose
rank names its recipe:

- (E, ceil(N/128), ceil(K/128)): ``blockwise_128x128`` (DeepSeek-V3, Qwen3 ``-FP8``:
  the stacked ``weight_scale_inv``); the activations are then quantized per token
  per 128 channels, so H and I must be multiples of 128;
- (E, N): ``rowwise``, one scale per output channel (llm-compressor FP8-dynamic);
- (E,): ``tensorwise``, one per expert (AutoFP8 Mixtral), served as per-channel
  scales (the same values) with per-token activations.

The router stays in the hidden dtype.  One call::

    route, slot order                            as the bf16 layer
    x_fp8, sx = quantize_fp8(x, act)             (T, H): the token rows once
    h = scaled_grouped_gemm_swiglu(x_fp8, gate_up, sx, ..., a_index=token)
                                                 (T*k, I) in x's dtype
    h_fp8, sh = quantize_fp8(h, act)             the SwiGLU output, for the down GEMM
    y = scaled_grouped_gemm(h_fp8, down^T, sh, ...)
    out = combine(y, weights, inverse)

``act`` is ``blockwise_1x128`` for blockwise weights, else ``rowwise``: dynamic
activation scales always (a checkpoint's static ``input_scale`` is not used: per
token is at least as accurate).  ``fused=False`` runs the gate/up GEMM to fp32 and
the activation apart (the same math).  No host sync on the GPU paths, so decode
calls replay CUDA graphs (:mod:`ts_moe.decode_graphs`) as the bf16 layer's do.
No backward (FP8 training is not supported).
"""

import torch

from .. import ops
from ..decode_graphs import graphs
from ..reference import swiglu
from ..nvtx import nvtx_range
from .quantize import quantize_fp8
from .recipes import BLOCK, E4M3, Recipe
from .reference import dequantize
from .scaled_ops import scaled_grouped_gemm, scaled_grouped_gemm_swiglu

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WEIGHT_RECIPES = {3: Recipe.BLOCKWISE_128X128, 2: Recipe.ROWWISE, 1: Recipe.TENSORWISE}


def is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == E4M3


def wants_fp8(gate_up_proj, gate_up_scale, down_scale) -> bool:
    """Whether a layer call is an FP8 one: scales given, or e4m3 weights (which then
    need their scales: :func:`check_experts` says so)."""
    return gate_up_scale is not None or down_scale is not None or is_fp8(gate_up_proj)


def weight_recipe(name: str, scale, weight: torch.Tensor) -> str:
    """The recipe of ``weight``'s (E, N, K) ``scale`` (by its rank), checked against its shape."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (the fp32 scales of the e4m3 "
                        f"weights), got {type(scale).__name__}")
    recipe = WEIGHT_RECIPES.get(scale.dim())
    expected = None if recipe is None else recipe.scale_shape(weight.shape)
    if recipe is None or tuple(scale.shape) != expected:
        shapes = {r: r.scale_shape(weight.shape) for r in WEIGHT_RECIPES.values()}
        raise ValueError(f"{name} has shape {tuple(scale.shape)}; for weights of shape "
                         f"{tuple(weight.shape)} it must be one of {shapes}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scale.dtype}")
    if scale.device != weight.device:
        raise ValueError(f"{name} is on {scale.device}, its weights on {weight.device}")
    return recipe


def check_experts(x, gate_up_proj, gate_up_scale, down_proj, down_scale, x_name):
    """Shapes (E, 2I, H) and (E, H, I) in e4m3 for x (T, H), their scales; returns the two
    weight recipes.  A ValueError or TypeError naming the bad argument."""
    if x.dtype not in X_DTYPES:
        raise TypeError(f"{x_name} must be bfloat16, float16 or float32 with FP8 experts, "
                        f"got {x.dtype}")
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != E4M3:
            raise TypeError(f"{name} must be torch.float8_e4m3fn with its scales given, got "
                            f"{t.dtype}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but {x_name} is on {x.device}")
    num_experts, two_inter, hidden = gate_up_proj.shape
    inter = two_inter // 2
    if hidden != x.shape[-1] or two_inter % 2:
        raise ValueError(f"gate_up_proj must be (E, 2I, H) with H = {x.shape[-1]} ({x_name}'s "
                         f"last dim), got {tuple(gate_up_proj.shape)}")
    if tuple(down_proj.shape) != (num_experts, hidden, inter):
        raise ValueError(f"down_proj must be (E, H, I) = {(num_experts, hidden, inter)} to "
                         f"match gate_up_proj {tuple(gate_up_proj.shape)}, got "
                         f"{tuple(down_proj.shape)}")
    for name, size in (("hidden_size", hidden), ("intermediate_size", inter)):
        if size % 16:
            raise ValueError(f"{name} = {size} must be a multiple of 16 (16-byte e4m3 rows)")
    recipes = (weight_recipe("gate_up_scale", gate_up_scale, gate_up_proj),
               weight_recipe("down_scale", down_scale, down_proj))
    if Recipe.BLOCKWISE_128X128 in recipes:
        for name, size in (("hidden_size", hidden), ("intermediate_size", inter)):
            if size % BLOCK:
                raise ValueError(f"{name} = {size} must be a multiple of {BLOCK} with "
                                 f"blockwise scales (activations are quantized per 128 "
                                 f"channels)")
    return recipes


def _as_used(scale: torch.Tensor, recipe: str, weight: torch.Tensor):
    """(scale, recipe) the GEMM takes: a per-expert scale becomes per channel (a view)."""
    if recipe == Recipe.TENSORWISE:
        return scale[:, None].expand(weight.shape[:2]), Recipe.ROWWISE
    return scale, recipe


def experts_in_slot_order(x, slots, weights, gate_up_proj, gate_up_scale, down_proj,
                          down_scale, fused: bool, recipes) -> torch.Tensor:
    """The GEMMs and the combine of the FP8 layer, the slots sorted (module docstring)."""
    gate_up_scale, gu_recipe = _as_used(gate_up_scale, recipes[0], gate_up_proj)
    down_scale, down_recipe = _as_used(down_scale, recipes[1], down_proj)
    with nvtx_range("gate_up"):
        act = gu_recipe.activation
        xq, sx = quantize_fp8(x, act)
        if fused:
            h = scaled_grouped_gemm_swiglu(xq, gate_up_proj, sx, act, gate_up_scale, gu_recipe,
                                           slots.offs, out_dtype=x.dtype,
                                           a_index=slots.token_index)
        else:
            h = swiglu(scaled_grouped_gemm(xq, gate_up_proj.transpose(-2, -1), sx, act,
                                           gate_up_scale, gu_recipe, slots.offs,
                                           out_dtype=torch.float32, a_index=slots.token_index),
                       x.dtype)
    with nvtx_range("down"):
        act = down_recipe.activation
        hq, sh = quantize_fp8(h, act)
        y = scaled_grouped_gemm(hq, down_proj.transpose(-2, -1), sh, act, down_scale,
                                down_recipe, slots.offs, out_dtype=x.dtype)
    with nvtx_range("combine"):
        return ops.combine(y, weights, slots.inverse)


def _num_experts(gate_up_proj) -> int:
    return gate_up_proj.shape[0] if isinstance(gate_up_proj, torch.Tensor) and \
        gate_up_proj.dim() else 0


def experts_forward(x, experts, weights, gate_up_proj, gate_up_scale, down_proj, down_scale, *,
                    fused: bool = True, decode_graphs: bool = True) -> torch.Tensor:
    """:func:`ts_moe.experts_forward` on FP8 experts (module docstring)."""
    if not decode_graphs:
        return _experts_forward(x, experts, weights, gate_up_proj, gate_up_scale, down_proj,
                                down_scale, fused)
    return graphs.call(_experts_forward, _num_experts(gate_up_proj), (x, experts, weights),
                       (gate_up_proj, gate_up_scale, down_proj, down_scale), fused)


def _experts_forward(x, experts, weights, gate_up_proj, gate_up_scale, down_proj, down_scale,
                     fused):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D (T, H) tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    recipes = check_experts(x, gate_up_proj, gate_up_scale, down_proj, down_scale, "x")
    with nvtx_range("permute"):
        slots = ops.sort_slots(experts, gate_up_proj.shape[0])
    return experts_in_slot_order(x, slots, weights, gate_up_proj, gate_up_scale, down_proj,
                                 down_scale, fused, recipes)


def moe_forward(hidden, router_weight, gate_up_proj, gate_up_scale, down_proj, down_scale,
                top_k: int, *, fused: bool = True, return_router_logits: bool = False,
                decode_graphs: bool = True, renormalize: bool = True):
    """:func:`ts_moe.moe_forward` on FP8 experts (module docstring)."""
    if not decode_graphs:
        return _moe_forward(hidden, router_weight, gate_up_proj, gate_up_scale, down_proj,
                            down_scale, top_k, fused, return_router_logits, renormalize)
    return graphs.call(_moe_forward, _num_experts(gate_up_proj), (hidden,),
                       (router_weight, gate_up_proj, gate_up_scale, down_proj, down_scale),
                       top_k, fused, return_router_logits, renormalize)


def _moe_forward(hidden, router_weight, gate_up_proj, gate_up_scale, down_proj, down_scale,
                 top_k, fused, return_router_logits, renormalize=True):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise TypeError("hidden must be a torch.Tensor with a last (hidden) dimension")
    x = hidden.reshape(-1, hidden.shape[-1])
    recipes = check_experts(x, gate_up_proj, gate_up_scale, down_proj, down_scale, "hidden")
    if not isinstance(router_weight, torch.Tensor) or router_weight.dim() != 2 or \
            tuple(router_weight.shape) != (gate_up_proj.shape[0], hidden.shape[-1]):
        raise ValueError(f"router_weight must be (E, H) = "
                         f"{(gate_up_proj.shape[0], hidden.shape[-1])}")
    if router_weight.dtype != hidden.dtype:
        raise TypeError(f"router_weight must have the hidden dtype {hidden.dtype}, got "
                        f"{router_weight.dtype}")
    with nvtx_range("route"):
        logits = ops.router_logits(x, router_weight)
        weights, _, slots = ops.route_slots(logits, top_k, renormalize=renormalize)
    out = experts_in_slot_order(x, slots, weights, gate_up_proj, gate_up_scale, down_proj,
                                down_scale, fused, recipes).view(hidden.shape)
    return (out, logits) if return_router_logits else out


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor,
                       dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An (E, N, K) e4m3 stack times its scale (recipe by the scale's rank), in ``dtype``:
    the bf16 weights an FP8 layer stands for (comparisons, the bf16 fallback)."""
    return dequantize(weight, scale, weight_recipe("scale", scale, weight), dtype)


def moe_from_weights(cls, weights, top_k: int, *, fused: bool = True,
                     renormalize: bool = True):
    """:meth:`ts_moe.MoE.from_weights` with FP8 experts: ``weights`` also holds
    ``gate_up_proj_scale`` and ``down_proj_scale``; the module keeps them as
    parameters of those names (no grad), its forward passes them on."""
    missing = {"router", "gate_up_proj", "down_proj", "gate_up_proj_scale",
               "down_proj_scale"} - set(weights)
    if missing:
        raise KeyError(f"weights lacks {sorted(missing)}")
    router = weights["router"]
    if not isinstance(router, torch.Tensor) or router.dim() != 2:
        raise ValueError("weights['router'] must be a 2-D (E, H) tensor")
    check_experts(router.new_empty(0, router.shape[1]), weights["gate_up_proj"],
                  weights["gate_up_proj_scale"], weights["down_proj"], weights["down_proj_scale"],
                  "weights['router']")
    num_experts, two_inter, hidden = weights["gate_up_proj"].shape
    if router.shape[0] != num_experts:
        raise ValueError(f"weights['router'] has {router.shape[0]} experts but gate_up_proj "
                         f"has {num_experts}")
    moe = cls(hidden, two_inter // 2, num_experts, top_k, fused=fused, renormalize=renormalize,
              device="meta")
    for name in ("router", "gate_up_proj", "down_proj", "gate_up_proj_scale", "down_proj_scale"):
        setattr(moe, name, torch.nn.Parameter(weights[name], requires_grad=False))
    return moe
