"""The Mixture-of-Experts layer: :func:`moe_forward` and the :class:`MoE` module.

Mixtral's sparse MoE block on the ``torch.ops.ts_moe`` ops (the stages, in
:mod:`ts_moe.block`)::

    logits = x @ router.T                                   (T, E) router_logits
    weights, experts = route(logits, top_k)                 (T, k) fp32 (fp64: fp64), int64
    token, offs, inverse = sort_slots(experts, E)           (T*k,) slot order
        (the two in one op, route_slots: one launch for a decode batch)
    h = grouped_gemm_swiglu(x, gate_up_proj, offs,          (T*k, I): rows x[token]
                            a_index=token)
    y = grouped_gemm(h, down_proj^T, offs)                  (T*k, H)
    out = combine(y, weights, inverse)                      (T, H)

A call runs the stages eagerly, or, with few tokens, replays a CUDA graph of
them (:mod:`ts_moe.decode_graphs`, handed the stages' function).

Weights use the Hugging Face transformers-5 layouts: ``router`` (E, H),
``gate_up_proj`` (E, 2I, H) with the gate rows first, ``down_proj`` (E, H, I);
bf16/fp16/fp32, or e4m3 with their fp32 scales and recipe (FP8 experts).  Each
entry makes the experts one value (:func:`ts_moe.experts.expert_weights`) and
runs the one forward of :mod:`ts_moe.block` over it.

Nothing syncs with the host and every shape follows from the input's shape, so
the layer compiles with ``torch.compile(fullgraph=True)`` and decode-sized
calls can be captured in CUDA graphs (on the paths of :mod:`ts_moe.ops` that
read ``offs`` on the device).  The layer calls only the ops, whatever the
dtype: :mod:`ts_moe.ops` alone chooses kernel, torch or reference.  H and I
must be multiples of 8 (16-byte rows of the permuted activations).

The layer trains: the ops' backward formulas give ``gate_up_proj``,
``down_proj`` and the input their gradients, and the combine weights carry
the router's (through the softmax of :func:`ts_moe.reference.route`).  No step of the backward
syncs with the host or uses atomics: the gradients of the gathered token rows
and of the combine's gathered expert rows are summed back by a sort-based
``index_put_`` (deterministic).
"""

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from . import block, reference
from .checks import check_flag
from .decode_graphs import graphs
from .experts import ExpertWeights, check_layer_sizes, check_tensor, expert_weights

FP8_KEYS = ("gate_up_proj_scale", "down_proj_scale", "scale_recipe")  # from_weights' FP8 experts


def check_layer_config(hidden_size, intermediate_size, num_experts, top_k) -> None:
    """A layer's sizes: E and top-k positive ints, top-k <= E, H and I as
    :func:`check_layer_sizes` wants them; a ValueError naming the bad one."""
    for name, value in (("num_experts", num_experts), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    check_layer_sizes(hidden_size=hidden_size, intermediate_size=intermediate_size)
    if top_k > num_experts:
        raise ValueError(f"top_k = {top_k} exceeds num_experts = {num_experts}")


def init_linear_(*weights: torch.Tensor) -> None:
    """``nn.Linear``'s default init in place, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with
    fan_in the last dim, for each (stack of) weight matrices."""
    for w in weights:
        bound = w.shape[-1] ** -0.5
        nn.init.uniform_(w, -bound, bound)


def experts_forward(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *,
                    fused: bool = True, decode_graphs: bool = True,
                    gate_up_scale: torch.Tensor | None = None,
                    down_scale: torch.Tensor | None = None, scale_recipe=None) -> torch.Tensor:
    """The expert half of the layer for already-routed tokens: permute, GEMMs, combine.

    x: (T, H); experts, weights: (T, top_k) expert ids and their weights (as
    :func:`ts_moe.route` returns them); gate_up_proj (E, 2I, H);
    down_proj (E, H, I).  Returns (T, H) in ``x.dtype``.  An id outside
    ``[0, E)`` (``-1`` for a dropped slot, or an expert-parallel sentinel)
    counts for no expert: its slot contributes zero (decided on the device).

    ``fused=True``: one ``grouped_gemm_swiglu`` for gate, up and the SwiGLU.
    ``fused=False``: ``grouped_gemm`` to (T*k, 2I) in fp32, ``silu(gate) * up``
    in fp32, one rounding; the same math, for checking the fused kernel.

    An eager call with few tokens replays a CUDA graph of itself
    (:mod:`ts_moe.decode_graphs`): the same result, three launches;
    ``decode_graphs=False`` runs every stage eagerly.

    FP8 experts: e4m3 ``gate_up_proj`` / ``down_proj`` with their fp32
    ``gate_up_scale`` / ``down_scale`` and ``scale_recipe``, the weights'
    recipe (``torch.nn.functional.ScalingType.BlockWise128x128``, ``RowWise`` or
    ``TensorWise``, or its name; a (gate_up, down) pair where they differ):
    :mod:`ts_moe.experts`.
    """
    return run_experts(x, experts, weights,
                       expert_weights(gate_up_proj, down_proj, gate_up_scale, down_scale,
                                      scale_recipe), fused=fused, decode_graphs=decode_graphs)


def run_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                expert_weights: ExpertWeights, *, fused: bool = True,
                decode_graphs: bool = True) -> torch.Tensor:
    """:func:`experts_forward` on the experts' value (what the transformers swaps call)."""
    if not decode_graphs:
        return block.experts_forward(x, experts, weights, expert_weights, fused)
    return graphs.call(block.experts_forward, expert_weights.num_experts, (x, experts, weights),
                       (expert_weights,), fused)


def moe_forward(hidden: torch.Tensor, router_weight: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, top_k: int, *, fused: bool = True,
                return_router_logits: bool = False, decode_graphs: bool = True,
                gate_up_scale: torch.Tensor | None = None,
                down_scale: torch.Tensor | None = None, scale_recipe=None,
                renormalize: bool = True):
    """Mixtral's sparse MoE block as a function.

    hidden: (..., H); router_weight (E, H), ``logits = hidden @ router_weight.T``
    in the hidden dtype; gate_up_proj (E, 2I, H), gate rows first; down_proj
    (E, H, I); top_k experts per token.  Returns (..., H), and with
    ``return_router_logits`` also the logits (T, E) (T = tokens, flattened),
    as Mixtral returns them for its auxiliary loss.  ``fused``: see
    :func:`experts_forward`.  ``renormalize``: the top-k weights divided by
    their sum (Mixtral), or, False, the softmax probabilities as they are
    (Qwen-MoE with ``norm_topk_prob`` false; :func:`ts_moe.route`).

    An eager call with few tokens replays a CUDA graph of itself
    (:mod:`ts_moe.decode_graphs`): the same result, three launches, a few
    microseconds of host time; its NVTX ranges then mark the capture only.
    ``decode_graphs=False`` (or ``TS_MOE_DECODE_GRAPHS=0``) runs and marks
    every stage of every call.

    FP8 experts: e4m3 ``gate_up_proj`` / ``down_proj`` with their fp32
    ``gate_up_scale`` / ``down_scale`` and ``scale_recipe`` (see
    :func:`experts_forward`).
    """
    return run_block(hidden, router_weight,
                     expert_weights(gate_up_proj, down_proj, gate_up_scale, down_scale,
                                    scale_recipe), top_k, fused=fused,
                     return_router_logits=return_router_logits, decode_graphs=decode_graphs,
                     renormalize=renormalize)


def run_block(hidden: torch.Tensor, router_weight: torch.Tensor, experts: ExpertWeights,
              top_k: int, *, fused: bool = True, return_router_logits: bool = False,
              decode_graphs: bool = True, renormalize: bool = True):
    """:func:`moe_forward` on the experts' value."""
    if not decode_graphs:
        return block.moe_forward(hidden, router_weight, experts, top_k, fused,
                                 return_router_logits, renormalize)
    return graphs.call(block.moe_forward, experts.num_experts, (hidden,),
                       (router_weight, experts), top_k, fused, return_router_logits,
                       renormalize)


def moe_forward_reference(hidden: torch.Tensor, router_weight: torch.Tensor,
                          gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                          top_k: int, router_logits: torch.Tensor | None = None,
                          renormalize: bool = True) -> torch.Tensor:
    """:func:`moe_forward` one token at a time, experts and combine in fp32, one rounding.

    The yardstick for the kernels (tests only): the router logits are computed
    as the default path computes them (``F.linear`` in the hidden dtype), so both
    route alike; or given (``router_logits`` (T, E), e.g. those a call of
    :func:`moe_forward` returned), to route on exactly those.
    """
    x = hidden.reshape(-1, hidden.shape[-1])
    logits = F.linear(x, router_weight) if router_logits is None else router_logits
    weights, experts = reference.route(logits, top_k, renormalize)
    inter = gate_up_proj.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for k in range(top_k):
            e = int(experts[t, k])
            h = gate_up_proj[e].float() @ x[t].float()
            h = F.silu(h[:inter]) * h[inter:]
            out[t] += weights[t, k] * (down_proj[e].float() @ h)
    return out.to(hidden.dtype).view(hidden.shape)


class MoE(nn.Module):
    """A Mixtral-style top-k MoE layer on the ts_moe ops.

    Parameters: ``router`` (E, H) (logits = x @ router.T), ``gate_up_proj``
    (E, 2I, H) (gate rows first), ``down_proj`` (E, H, I); FP8 experts
    (:meth:`from_weights`) also ``gate_up_proj_scale`` and ``down_proj_scale``, their
    recipes in ``scale_recipe``.  ``forward(x)`` maps (..., H) to (..., H); see
    :func:`moe_forward` (``fused``, ``decode_graphs``, ``renormalize``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 *, fused: bool = True, decode_graphs: bool = True, renormalize: bool = True,
                 device=None, dtype=None):
        super().__init__()
        check_layer_config(hidden_size, intermediate_size, num_experts, top_k)
        check_flag("renormalize", renormalize)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.fused = num_experts, top_k, fused
        self.decode_graphs, self.renormalize = decode_graphs, renormalize
        self.scale_recipe = None  # FP8 experts' recipes (from_weights)
        factory = {"device": device, "dtype": dtype}
        self.router = nn.Parameter(torch.empty(num_experts, hidden_size, **factory))
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, **factory))
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), per matrix."""
        init_linear_(self.router, self.gate_up_proj, self.down_proj)

    def experts(self) -> ExpertWeights:
        """The experts' value the forward runs on (:mod:`ts_moe.experts`), built once from
        the expert parameters and the recipe and kept while they stay the same objects (a
        parameter assigned anew, or a new recipe, builds it again; ``.to()`` and
        ``load_state_dict`` change the parameters' data, not the objects)."""
        parts = (self.gate_up_proj, self.down_proj, getattr(self, "gate_up_proj_scale", None),
                 getattr(self, "down_proj_scale", None), getattr(self, "scale_recipe", None))
        kept = self.__dict__.get("_experts")
        if kept is None or len(kept[0]) != len(parts) or any(
                a is not b for a, b in zip(kept[0], parts)):
            kept = self.__dict__["_experts"] = (parts, expert_weights(*parts))
        return kept[1]

    def forward(self, x: torch.Tensor, return_router_logits: bool = False):
        """(..., H) -> (..., H); with ``return_router_logits`` also the logits (T, E)."""
        return run_block(x, self.router, self.experts(), self.top_k, fused=self.fused,
                         return_router_logits=return_router_logits,
                         decode_graphs=getattr(self, "decode_graphs", True),  # older pickles
                         renormalize=getattr(self, "renormalize", True))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, fused={self.fused}"
                + ("" if getattr(self, "renormalize", True) else ", renormalize=False"))

    @classmethod
    def from_weights(cls, weights: Mapping[str, torch.Tensor], top_k: int, *,
                     fused: bool = True, renormalize: bool = True) -> "MoE":
        """A MoE on existing tensors (no copy), e.g. a layer of :func:`ts_moe.load_mixtral_experts`.

        weights: ``{"router": (E, H), "gate_up_proj": (E, 2I, H), "down_proj": (E, H, I)}``;
        FP8 experts (e.g. from :func:`ts_moe.load_fp8_experts`) also
        ``"gate_up_proj_scale"``, ``"down_proj_scale"`` and ``"scale_recipe"``
        (:mod:`ts_moe.experts`): the module keeps the scales as parameters of those
        names and the recipe as its ``scale_recipe``.  The parameters do not require
        grad (call ``requires_grad_()`` to train bf16 experts).
        """
        fp8 = any(key in weights for key in FP8_KEYS)
        missing = {"router", "gate_up_proj", "down_proj", *(FP8_KEYS if fp8 else ())} - set(weights)
        if missing:
            raise KeyError(f"weights lacks {sorted(missing)}")
        experts = expert_weights(weights["gate_up_proj"], weights["down_proj"],
                                 weights.get("gate_up_proj_scale"),
                                 weights.get("down_proj_scale"), weights.get("scale_recipe"))
        check_tensor("gate_up_proj", experts.gate_up_proj, 3)
        num_experts, two_inter, hidden = experts.gate_up_proj.shape
        moe = cls(hidden, two_inter // 2, num_experts, top_k, fused=fused,
                  renormalize=renormalize, device="meta")
        for name in ("router", "gate_up_proj", "down_proj"):
            tensor = weights[name]
            expected = getattr(moe, name).shape
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"weights[{name!r}] must be a torch.Tensor, "
                                f"got {type(tensor).__name__}")
            if tensor.shape != expected:
                raise ValueError(f"weights[{name!r}] must have shape {tuple(expected)}, "
                                 f"got {tuple(tensor.shape)}")
        router = weights["router"]
        experts.check(router.new_empty(0, hidden), "weights['router']")
        for name, tensor in {"router": router, **experts.parameters()}.items():
            setattr(moe, name, nn.Parameter(tensor, requires_grad=False))
        moe.scale_recipe = experts.scale_recipe
        moe.experts()  # the value, built at load time
        return moe

    @classmethod
    def from_pretrained(cls, path, layer: int, *, device=None, fused: bool = True) -> "MoE":
        """Layer ``layer`` of the local checkpoint directory ``path``: a Mixtral or a
        Qwen3-MoE one, bf16 (:func:`ts_moe.load_mixtral_experts`) or FP8
        (:func:`ts_moe.load_fp8_experts`).  Top-k and the routing from config.json
        (:func:`ts_moe.pretrained.block_settings`: Qwen-MoE's ``norm_topk_prob``
        honoured, a model type whose block the layer does not reproduce refused).
        ``device``: as :func:`ts_moe.load_mixtral_experts` (None: CUDA when there
        is one, else the CPU)."""
        from . import loaders
        from .pretrained import block_settings

        loaders.resolve_device(device)
        settings = block_settings(path, "MoE.from_pretrained")
        weights = loaders.pretrained_layer(path, layer, device)
        settings.check_router(weights["router"].shape[0])
        return cls.from_weights(weights, settings.top_k, fused=fused,
                                renormalize=settings.renormalize)
