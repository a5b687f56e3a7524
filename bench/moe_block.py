"""The ``moe_block`` suite: the whole MoE block, router GEMM and top-k included.

Where :mod:`bench.moe_layer` times the expert half with the routing given,
this suite times what a decode step calls: ``logits = x @ router.T``, top-k of
their softmax, the experts, the combine.  Every backend gets the same
:class:`BlockInputs` (tokens, the router (E, H) and the expert weights in the
Hugging Face (transformers 5) layout, scaled by fan-in as moe_layer's) and
routes them itself.  A backend returns the block's (T, H) output in
``x.dtype``.

Backends (:func:`block_backends`): ``ts_moe`` (:func:`ts_moe.moe_forward`; an
eager call at decode sizes replays the layer's own CUDA graph,
:mod:`ts_moe.decode_graphs`), ``ts_moe_stages`` (the same with
``decode_graphs=False``: every stage launched eagerly), ``ts_moe_hf`` (a transformers 5 ``MixtralSparseMoeBlock`` on the same weights,
switched to ts_moe by :func:`ts_moe.integrations.transformers.replace_moe_blocks`),
transformers' own ``MixtralSparseMoeBlock`` with each experts implementation
(``hf_eager``, ``hf_grouped_mm``, ``hf_batched_mm``), one module per input
copy, and on request ``ts_moe_unfused``, ``ts_moe_router_kernel`` (``ts_moe``
after :func:`ts_moe.use_router_kernel`: the router's logits by ts_moe's kernel,
not cuBLAS), ``reference``, and the FP8 mode: ``ts_moe_fp8_blockwise`` and
``ts_moe_fp8_rowwise`` (the experts quantized, :func:`ts_moe_fp8_block`; each
checked against its own FP8 reference).  All run under
``torch.no_grad`` (as a decode step does).

Timing (:class:`bench.runner.Suite` ``graph_timing``): each backend's eager
time per call (``ms``: an event pair around every call, so a host-bound call
measures its host time, which is its eager cost) and, on CUDA, the time of a
CUDA-graph replay per call (``graph_ms``; ``graph_status`` says why there is
none, e.g. a block whose experts sync with the host cannot be captured).
The record's ``floor_ms`` is the weight-streaming floor: the touched experts'
and the router's bytes over the measured HBM read roof.

Routing.  The case's routing is the router's (:data:`bench.cases.BLOCK_ROUTING`):
:func:`ts_moe.route` of ``F.linear(x, router)`` in bf16.  The tokens and the
router come from a CPU generator (:func:`tokens_and_router`), so the case
factory computes the expert counts (bytes, flops, touched experts) from the
very inputs the backends get, on any machine.  With randn data, bf16 logits
tie at the top-k boundary often (about 6 % of the tokens of Qwen3's 128
experts, 8 % of DeepSeek-V3's 256): ``torch.topk`` (transformers' router)
and :func:`ts_moe.route` (lower index first) may then pick different,
equally right experts, and a CPU and a GPU GEMM may round a near-tie apart.
So a token whose k-th and (k+1)-th logits are within :data:`MARGIN_ULPS`
bf16 spacings is drawn again (:func:`near_ties`): every backend, the
reference and the case factory then route alike.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .backends import Bind, Factory, Unavailable
from .cases import (BLOCK_ROUTING, MODELS, Case, Model, case_seed, expert_counts, model_named,
                    weight_bytes)
from .moe_layer import LayerInputs, reference_layer
from .timing import measure

DEFAULT_BACKENDS = ("ts_moe", "ts_moe_stages", "ts_moe_hf", "hf_eager", "hf_grouped_mm",
                    "hf_batched_mm")
HF_IMPLEMENTATIONS = {"hf_eager": "eager", "hf_grouped_mm": "grouped_mm",
                      "hf_batched_mm": "batched_mm"}
# a token's k-th and (k+1)-th logits (fp32 of the bf16 inputs) must be at least this
# many bf16 spacings apart: rounding to bf16 moves each by half a spacing, a GPU
# GEMM's reduced-precision split-K reduction by a little more
MARGIN_ULPS = 4
MAX_REDRAWS = 200


@dataclass
class BlockInputs:
    """x (T, H); router (E, H); gate_up (E, 2I, H), gate rows first; down (E, H, I);
    top_k; counts: rows per expert of the router's routing (host-side)."""

    x: torch.Tensor
    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    top_k: int
    counts: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.x.nbytes + self.router.nbytes + self.gate_up.nbytes + self.down.nbytes

    def clone(self) -> "BlockInputs":
        return BlockInputs(self.x.clone(), self.router.clone(), self.gate_up.clone(),
                           self.down.clone(), self.top_k, self.counts)


def bf16_spacing(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at the magnitude of each element (8 significant bits)."""
    mag = t.abs().clamp_min(2.0**-100)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def near_ties(x: torch.Tensor, router: torch.Tensor, top_k: int,
              ulps: float = MARGIN_ULPS) -> torch.Tensor:
    """(T,) bool: tokens whose k-th and (k+1)-th largest logits (fp32 products of the
    bf16 inputs) are less than ``ulps`` bf16 spacings apart."""
    if top_k >= router.shape[0]:  # every expert is chosen: no boundary
        return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    logits = x.float() @ router.float().t()
    top = logits.topk(top_k + 1, dim=1).values
    kth, next_ = top[:, top_k - 1], top[:, top_k]
    return (kth - next_) < ulps * bf16_spacing(torch.maximum(kth.abs(), next_.abs()))


def tokens_and_router(model: Model, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x (T, H), router (E, H)), bf16 on the CPU, from ``seed`` alone: randn tokens
    (a token near a top-k tie drawn again, :func:`near_ties`), a randn router
    scaled by fan-in."""
    g = torch.Generator().manual_seed(seed)
    kw = {"generator": g, "dtype": torch.bfloat16}
    x = torch.randn(T, model.hidden, **kw)
    router = torch.randn(model.experts, model.hidden, **kw).mul_(model.hidden**-0.5)
    for _ in range(MAX_REDRAWS):
        redo = near_ties(x, router, model.top_k).nonzero().flatten()
        if redo.numel() == 0:
            return x, router
        x[redo] = torch.randn(redo.numel(), model.hidden, **kw)
    raise RuntimeError(f"{model.name} T={T}: tokens still near a top-k tie after "
                       f"{MAX_REDRAWS} draws")


def router_routing(x: torch.Tensor, router: torch.Tensor, top_k: int):
    """(weights, ids): :func:`ts_moe.route` of the bf16 logits, as the block computes them."""
    import ts_moe

    return ts_moe.route(F.linear(x, router), top_k)


def block_case(model: Model, T: int, base_seed: int = 0) -> Case:
    """The case with the expert counts of its own router's routing (computed on the CPU)."""
    seed = case_seed(base_seed, model.name, T, BLOCK_ROUTING)
    x, router = tokens_and_router(model, T, seed)
    _, ids = router_routing(x, router, model.top_k)
    return Case(model, "block", T, BLOCK_ROUTING, seed, expert_counts(ids, model.experts), "hf")


def block_cases(models, Ts, base_seed: int = 0) -> list[Case]:
    """The moe_block suite: every model x T, T ascending innermost."""
    return [block_case(model_named(m), t, base_seed) for m in models for t in sorted(Ts)]


def floor_bytes(case: Case) -> int:
    """The weight-streaming floor's bytes: the touched experts' weights and the router."""
    return weight_bytes(case)


def make_block_inputs(case: Case, device: torch.device) -> BlockInputs:
    """The case's tokens and router (:func:`tokens_and_router`, moved to ``device``),
    seeded random expert weights made on ``device`` (scaled by fan-in), and the
    counts of the routing on ``device`` (the case's, unless a GEMM rounded a token
    across the margin: then a warning, and the reference follows the device)."""
    m = case.model
    x, router = (t.to(device) for t in tokens_and_router(m, case.T, case.seed))
    g = torch.Generator(device).manual_seed(case.seed)
    kw = {"generator": g, "device": device, "dtype": torch.bfloat16}
    gate_up = torch.randn(m.experts, 2 * m.inter, m.hidden, **kw).mul_(m.hidden**-0.5)
    down = torch.randn(m.experts, m.hidden, m.inter, **kw).mul_(m.inter**-0.5)
    _, ids = router_routing(x, router, m.top_k)
    counts = expert_counts(ids.cpu(), m.experts)
    if counts != case.counts:
        import warnings

        warnings.warn(f"{case.describe()}: the routing on {device} differs from the case's "
                      f"(computed on the CPU); its bytes and flops are the CPU routing's",
                      stacklevel=2)
    return BlockInputs(x, router, gate_up, down, m.top_k, counts)


def shaped_inputs(hidden: int, inter: int, experts: int, top_k: int, T: int,
                  device: torch.device) -> tuple[Case, BlockInputs]:
    """The block case of these shapes at ``T`` tokens and its inputs, as the suite
    makes them (for the profiling scripts)."""
    case = block_case(Model("custom", experts=experts, hidden=hidden, inter=inter,
                            top_k=top_k), T)
    return case, make_block_inputs(case, device)


def suite_inputs(Ts, device: torch.device):
    """``(model, T, inputs)`` of every moe_block model (Mixtral-8x7B, Qwen3-30B-A3B,
    DeepSeek-V3) at each ``T``: the suite's cases, for the A/B scripts."""
    for model in MODELS.values():
        for T in Ts:
            yield model, T, make_block_inputs(block_case(model, T), device)


def stages_graph_ms(inp: BlockInputs, device: torch.device, calls: int = 10) -> float:
    """ms per call of :func:`ts_moe.moe_forward`'s stages (``decode_graphs=False``)
    replayed from a CUDA graph of ``calls`` calls, under ``torch.no_grad``
    (:func:`bench.timing.measure`): the block's GPU time in the A/B scripts."""
    from ts_moe.moe import moe_forward

    def block():
        return moe_forward(inp.x, inp.router, inp.gate_up, inp.down, inp.top_k,
                           decode_graphs=False)

    with torch.no_grad():
        return measure([block] * calls, device, graph=True, target_ms=50).ms


def reference_block(inp: BlockInputs, out_dtype=torch.float32) -> torch.Tensor:
    """:func:`router_routing` on the inputs, then moe_layer's per-expert fp32 loop."""
    weights, ids = router_routing(inp.x, inp.router, inp.top_k)
    counts = expert_counts(ids.cpu(), inp.router.shape[0])
    return reference_layer(LayerInputs(inp.x, inp.gate_up, inp.down, ids, weights, counts),
                           out_dtype)


def reference(case: Case, device: torch.device) -> Bind:
    """The fp32 reference, output in x.dtype."""
    return lambda inp: lambda: reference_block(inp, inp.x.dtype)


def ts_moe_block(fused: bool, decode_graphs: bool = True, router_kernel: bool = False) -> Factory:
    """:func:`ts_moe.moe_forward`: route (router GEMM, softmax, top-k), permute,
    (fused) gate/up GEMM, down GEMM, combine; each stage an NVTX range (with
    ``decode_graphs``, a decode-sized call replays the graph of these;
    ``router_kernel``: :func:`ts_moe.use_router_kernel` on during the call)."""
    def factory(case: Case, device: torch.device) -> Bind:
        import ts_moe

        def bind(inp: BlockInputs):
            def run():  # the setting put back as it was found (set or not)
                with ts_moe.settings.override(router_kernel=router_kernel), torch.no_grad():
                    return ts_moe.moe_forward(inp.x, inp.router, inp.gate_up, inp.down,
                                              inp.top_k, fused=fused,
                                              decode_graphs=decode_graphs)
            return run
        return bind
    return factory


def hf_block_module(model: Model, implementation: str):
    """transformers' ``MixtralSparseMoeBlock`` of ``model``'s shapes with
    ``config._experts_implementation`` set, in eval mode, its weights on the meta
    device (:func:`set_block_weights` before a call).  transformers 4's block
    (a ModuleList of experts, no experts implementations): :class:`Unavailable`."""
    from transformers import MixtralConfig
    from transformers.models.mixtral import modeling_mixtral

    if not hasattr(modeling_mixtral, "MixtralExperts"):
        import transformers

        raise Unavailable(f"transformers {transformers.__version__}: the block suite needs "
                          f"transformers >= 5 (MixtralExperts)")
    config = MixtralConfig(hidden_size=model.hidden, intermediate_size=model.inter,
                           num_local_experts=model.experts, num_experts_per_tok=model.top_k,
                           router_jitter_noise=0.0)
    config._experts_implementation = implementation
    with torch.device("meta"):
        return modeling_mixtral.MixtralSparseMoeBlock(config).eval()


def set_block_weights(block, inp: BlockInputs):
    """The block's router and experts on the inputs' tensors (no copy)."""
    block.gate.weight = torch.nn.Parameter(inp.router, requires_grad=False)
    block.experts.gate_up_proj = torch.nn.Parameter(inp.gate_up, requires_grad=False)
    block.experts.down_proj = torch.nn.Parameter(inp.down, requires_grad=False)
    return block


def _block_run(block, inp: BlockInputs):
    x3 = inp.x.view(1, *inp.x.shape)  # the block takes (batch, seq, H)

    def run():
        with torch.no_grad():
            return block(x3).view(inp.x.shape)
    return run


def hf_block(implementation: str) -> Factory:
    """transformers' whole block (router gate, top-k, experts with ``implementation``),
    one module per input copy, on that copy's tensors."""
    def factory(case: Case, device: torch.device) -> Bind:
        hf_block_module(case.model, implementation)  # no transformers: ImportError

        def bind(inp: BlockInputs):
            return _block_run(set_block_weights(hf_block_module(case.model, implementation),
                                                inp), inp)
        return bind
    return factory


def ts_moe_hf(case: Case, device: torch.device) -> Bind:
    """transformers' block switched to ts_moe by ``replace_moe_blocks`` (run on a
    wrapper module, as on a model): its own gate (``torch.topk``), then ts_moe's experts."""
    from ts_moe.integrations.transformers import replace_moe_blocks

    hf_block_module(case.model, "eager")

    def bind(inp: BlockInputs):
        block = set_block_weights(hf_block_module(case.model, "eager"), inp)
        wrapper = torch.nn.ModuleDict({"mlp": block})
        if replace_moe_blocks(wrapper) != 1:
            raise RuntimeError("replace_moe_blocks switched no MixtralSparseMoeBlock")
        return _block_run(wrapper["mlp"], inp)
    return bind


# the FP8 mode: the block's expert weights quantized per recipe (bench.fp8's names)
FP8_WEIGHT_RECIPES = {"blockwise": "blockwise_128x128", "rowwise": "rowwise"}


def fp8_block_weights(inp: BlockInputs, recipe: str):
    """(gate_up, its scale, down, its scale): the block's experts quantized by
    :func:`ts_moe.quantize_fp8` with ``recipe``'s weight recipe (the same values for
    every copy of the inputs)."""
    import ts_moe

    weight = FP8_WEIGHT_RECIPES[recipe]
    return (*ts_moe.quantize_fp8(inp.gate_up, weight), *ts_moe.quantize_fp8(inp.down, weight))


def reference_block_fp8(inp: BlockInputs, recipe: str, out_dtype=torch.float32) -> torch.Tensor:
    """The FP8 block's math per expert in fp32 from the same quantized operands: the
    router's routing, the tokens quantized as the layer quantizes them, the SwiGLU
    output rounded to x's dtype and quantized per row, the weights dequantized."""
    import ts_moe
    from ts_moe.fp8.recipes import Recipe
    from ts_moe.fp8.reference import dequantize

    weights, ids = router_routing(inp.x, inp.router, inp.top_k)
    gq, gs, dq, ds = fp8_block_weights(inp, recipe)
    weight = FP8_WEIGHT_RECIPES[recipe]
    act = Recipe(weight).activation
    xs = dequantize(*ts_moe.quantize_fp8(inp.x, act), act)
    inter = gq.shape[1] // 2
    out = torch.zeros(inp.x.shape, dtype=torch.float32, device=inp.x.device)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        h = xs[rows] @ dequantize(gq[e], gs[e], weight).t()
        a = (F.silu(h[:, :inter]) * h[:, inter:]).to(inp.x.dtype)
        y = dequantize(*ts_moe.quantize_fp8(a, act), act) @ dequantize(dq[e], ds[e], weight).t()
        out.index_add_(0, rows, y * weights[rows, slots, None])
    return out.to(out_dtype)


def ts_moe_fp8_block(recipe: str) -> Factory:
    """:func:`ts_moe.moe_forward` on the block's experts quantized with ``recipe``
    (FP8 weights and activations; the router in bf16; a decode call replays its
    graph), checked against :func:`reference_block_fp8`.  The case's bytes and floor
    are the bf16 block's: the FP8 experts stream half the weight bytes.  On a GPU
    without ts_moe's FP8 kernels: unavailable."""
    def factory(case: Case, device: torch.device) -> Bind:
        import ts_moe
        from ts_moe.ops import Op, paths

        if device.type == "cuda":
            paths.use_fp8_kernels(True)  # whatever the settings say
        if device.type == "cuda" and (
                torch.cuda.get_device_capability(device) != (9, 0)
                or Op.SCALED_GROUPED_GEMM not in paths.TABLE[paths.Path.KERNEL_SM90]):
            raise Unavailable("no ts_moe FP8 kernels for this GPU")

        def bind(inp: BlockInputs):
            gq, gs, dq, ds = fp8_block_weights(inp, recipe)

            def run():
                with torch.no_grad():
                    return ts_moe.moe_forward(inp.x, inp.router, gq, dq, inp.top_k,
                                              gate_up_scale=gs, down_scale=ds,
                                              scale_recipe=FP8_WEIGHT_RECIPES[recipe])
            return run
        return bind

    factory.reference = lambda inp: reference_block_fp8(inp, recipe)
    # blockwise activations: H and I in whole 128-channel blocks
    factory.applies = lambda case: recipe != "blockwise" or (
        case.model.hidden % 128 == 0 and case.model.inter % 128 == 0)
    return factory


def block_backends() -> dict[str, Factory]:
    """Backend name -> factory for the moe_block suite."""
    return {
        "reference": reference,
        "ts_moe": ts_moe_block(fused=True),
        "ts_moe_stages": ts_moe_block(fused=True, decode_graphs=False),
        "ts_moe_unfused": ts_moe_block(fused=False),
        "ts_moe_router_kernel": ts_moe_block(fused=True, router_kernel=True),
        "ts_moe_hf": ts_moe_hf,
        **{name: hf_block(impl) for name, impl in HF_IMPLEMENTATIONS.items()},
        **{f"ts_moe_fp8_{recipe}": ts_moe_fp8_block(recipe) for recipe in FP8_WEIGHT_RECIPES},
    }
