"""The ``moe_layer`` suite: the whole expert MLP of a MoE block, routing given.

Every backend gets the same :class:`LayerInputs`: tokens, the expert
weights in the Hugging Face (transformers 5) layout, and a fixed routing
(``topk_ids``/``topk_weights`` drawn from the case, so every backend does
exactly the same work; the router GEMM and top-k are not part of the case).
A backend returns ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``
as a (T, H) tensor in ``x.dtype``, where
``expert_e(x) = down[e] @ (silu(gate_e x) * (up_e x))``.

Backends (:func:`layer_backends`): ``ts_moe`` (fused gate/up + SwiGLU
kernel), ``ts_moe_unfused`` (grouped GEMM, then SwiGLU), transformers'
``MixtralExperts`` with each experts implementation (``hf_eager``,
``hf_grouped_mm``, ``hf_batched_mm``), all on the same weight tensors, and on
request ``torch_layer`` (:func:`torch_layer_forward`: plain torch on
``F.grouped_mm``, the training suite's peer).  A
factory imports its dependencies itself, so a missing package (ImportError) or
an unusable machine (:class:`bench.backends.Unavailable`) is reported as
unavailable, not fatal.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .backends import Bind, Factory, Unavailable
from .cases import Case, Model, route

DEFAULT_BACKENDS = ("ts_moe", "ts_moe_unfused", "hf_eager", "hf_grouped_mm", "hf_batched_mm")


@dataclass
class LayerInputs:
    """x (T, H); gate_up (E, 2I, H), gate rows first; down (E, H, I);
    topk_ids (T, k) int64; topk_weights (T, k) fp32; counts: rows per expert."""

    x: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    counts: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.x.nbytes + self.gate_up.nbytes + self.down.nbytes

    def clone(self) -> "LayerInputs":
        return LayerInputs(self.x.clone(), self.gate_up.clone(), self.down.clone(),
                           self.topk_ids, self.topk_weights, self.counts)


def make_layer_inputs(case: Case, device: torch.device) -> LayerInputs:
    """Seeded random tokens and weights (scaled by fan-in), the case's routing."""
    m = case.model
    g = torch.Generator(device).manual_seed(case.seed)
    kw = {"generator": g, "device": device, "dtype": torch.bfloat16}
    x = torch.randn(case.T, m.hidden, **kw)
    gate_up = torch.randn(m.experts, 2 * m.inter, m.hidden, **kw).mul_(m.hidden**-0.5)
    down = torch.randn(m.experts, m.hidden, m.inter, **kw).mul_(m.inter**-0.5)
    # the same ids the case's counts came from
    topk_ids = route(case.T, m.top_k, m.experts, case.routing, case.seed).to(device)
    logits = torch.randn(case.T, m.top_k, generator=g, device=device)
    return LayerInputs(x, gate_up, down, topk_ids, logits.softmax(dim=-1), case.counts)


def reference_layer(inp: LayerInputs, out_dtype=torch.float32) -> torch.Tensor:
    """Per-expert fp32 loop over the given routing (host-side counts: no sync)."""
    top_k = inp.topk_ids.shape[1]
    inter = inp.gate_up.shape[1] // 2
    out = torch.zeros(inp.x.shape[0], inp.x.shape[1], dtype=torch.float32, device=inp.x.device)
    # pairs (token, slot) sorted by expert: expert e owns order[start:start + counts[e]]
    order = inp.topk_ids.flatten().argsort(stable=True)
    weights = inp.topk_weights.flatten()
    start = 0
    for e, rows in enumerate(inp.counts):
        if rows:
            pairs = order[start:start + rows]
            tokens = pairs // top_k
            h = inp.x[tokens].float() @ inp.gate_up[e].float().t()
            y = (F.silu(h[:, :inter]) * h[:, inter:]) @ inp.down[e].float().t()
            out.index_add_(0, tokens, y * weights[pairs, None])
        start += rows
    return out.to(out_dtype)


def reference(case: Case, device: torch.device) -> Bind:
    """The fp32 loop, output in x.dtype."""
    return lambda inp: lambda: reference_layer(inp, inp.x.dtype)


def ts_moe_layer(fused: bool) -> Factory:
    """ts_moe's expert half: permute, (fused) gate/up GEMM, down GEMM, combine."""
    def factory(case: Case, device: torch.device) -> Bind:
        import ts_moe

        def bind(inp: LayerInputs):
            return lambda: ts_moe.experts_forward(inp.x, inp.topk_ids, inp.topk_weights,
                                                  inp.gate_up, inp.down, fused=fused)
        return bind
    return factory


def grouped_mm_function():
    """``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` on older torch), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def torch_layer_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The expert half of a MoE layer in plain torch on ``F.grouped_mm`` (autograd
    through torch's own formulas): route (a stable sort of the slots by expert,
    offsets by binary search: no host sync), permute, grouped_mm gate_up,
    ``silu(gate) * up``, grouped_mm down, combine (weights in fp32, one rounding).
    Shapes as :class:`LayerInputs`; returns (T, H) in ``x.dtype``."""
    grouped_mm = grouped_mm_function()
    tokens, top_k = topk_ids.shape
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    ids = torch.arange(gate_up.shape[0], device=x.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, ids, right=True, out_int32=True)
    h = grouped_mm(x[order // top_k], gate_up.transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offs)
    inverse = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=x.device))
    y = y[inverse].view(tokens, top_k, -1)
    return (y * topk_weights.float().unsqueeze(-1)).sum(dim=1).to(x.dtype)


def torch_layer(case: Case, device: torch.device) -> Bind:
    """:func:`torch_layer_forward` under no_grad."""
    if grouped_mm_function() is None:
        raise Unavailable(f"torch {torch.__version__} has no grouped_mm")

    def bind(inp: LayerInputs):
        def run():
            with torch.no_grad():
                return torch_layer_forward(inp.x, inp.topk_ids, inp.topk_weights, inp.gate_up,
                                           inp.down)
        return run
    return bind


def hf_experts_module(model: Model, implementation: str):
    """transformers' ``MixtralExperts`` of ``model``'s shapes with
    ``config._experts_implementation`` set, its weights on the meta device (set
    them before a call)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=model.hidden, intermediate_size=model.inter,
                           num_local_experts=model.experts, num_experts_per_tok=model.top_k)
    config._experts_implementation = implementation
    with torch.device("meta"):
        return MixtralExperts(config)


def hf_experts(implementation: str) -> Factory:
    """transformers' ``MixtralExperts`` with ``config._experts_implementation`` set,
    on the same weight tensors (no copy), one module per input copy (so the
    calls rotate through the copies' weights)."""
    def factory(case: Case, device: torch.device) -> Bind:
        hf_experts_module(case.model, implementation)  # no transformers: ImportError

        def bind(inp: LayerInputs):
            experts = hf_experts_module(case.model, implementation)
            experts.gate_up_proj = torch.nn.Parameter(inp.gate_up, requires_grad=False)
            experts.down_proj = torch.nn.Parameter(inp.down, requires_grad=False)

            def run():
                with torch.no_grad():
                    return experts(inp.x, inp.topk_ids, inp.topk_weights.to(inp.x.dtype))
            return run
        return bind
    return factory


def layer_backends() -> dict[str, Factory]:
    """Backend name -> factory for the moe_layer suite."""
    return {
        "reference": reference,
        "ts_moe": ts_moe_layer(fused=True),
        "ts_moe_unfused": ts_moe_layer(fused=False),
        "hf_eager": hf_experts("eager"),
        "hf_grouped_mm": hf_experts("grouped_mm"),
        "hf_batched_mm": hf_experts("batched_mm"),
        "torch_layer": torch_layer,
    }
