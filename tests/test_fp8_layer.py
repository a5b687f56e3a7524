"""The MoE layer on FP8 experts (ts_moe.experts.Fp8ExpertWeights, through
ts_moe.moe_forward, experts_forward and MoE) on the CPU: against a float64 per-token
reference on the same quantized activations, against the bf16 layer with the
dequantized weights, and the module, validation (the recipe named, never inferred),
compile and no-backward promises."""

import pytest
import torch
import torch.nn.functional as F

import ts_moe
from ts_moe import decode_graphs
from ts_moe.fp8.recipes import Recipe
from ts_moe.fp8.reference import dequantize

from .helpers import rel_err

RECIPES = ("blockwise_128x128", "rowwise", "tensorwise")


def fp8_layer(recipe, T=24, H=256, I=256, E=4, seed=0, down_recipe=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    router = (torch.randn(E, H, generator=g) * H**-0.5).bfloat16()
    gate_up = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    down = torch.randn(E, H, I, generator=g) * I**-0.5
    gq, gs = ts_moe.quantize_fp8(gate_up, recipe)
    dq, ds = ts_moe.quantize_fp8(down, down_recipe or recipe)
    return x, router, gq, gs, dq, ds


def _recipes(recipes):
    """(gate_up's, down's) weight recipes of a scale_recipe argument."""
    pair = tuple(recipes) if isinstance(recipes, (tuple, list)) else (recipes, recipes)
    return tuple(Recipe.parse(r) for r in pair)


def reference64(x, router, gq, gs, dq, ds, top_k, recipes):
    """The layer in float64 (:func:`experts_reference64`), routed as the bf16 layer routes."""
    weights, experts = ts_moe.route(F.linear(x, router), top_k)
    return experts_reference64(x, experts, weights, gq, gs, dq, ds, recipes)


def experts_reference64(x, experts, weights, gq, gs, dq, ds, recipes):
    """Token by token in float64 from the same quantized activations: x quantized as the
    layer does (ts_moe.quantize_fp8, tested apart), the SwiGLU output rounded to x's dtype
    and quantized per row, the experts' weights dequantized (``recipes``: the weights'
    recipe, or a (gate_up, down) pair)."""
    r_gu, r_d = _recipes(recipes)
    w_gu, w_d = dequantize(gq, gs, r_gu, torch.float64), dequantize(dq, ds, r_d, torch.float64)
    act_gu, act_d = r_gu.activation, r_d.activation
    xq, sx = ts_moe.quantize_fp8(x, act_gu)
    xs = dequantize(xq, sx, act_gu, torch.float64)
    inter = gq.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            h = w_gu[e] @ xs[t]
            a = (F.silu(h[:inter]) * h[inter:]).to(x.dtype)[None]
            aq, sa = ts_moe.quantize_fp8(a, act_d)
            out[t] += weights[t, j].double() * (w_d[e] @ dequantize(aq, sa, act_d,
                                                                    torch.float64)[0])
    return out


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("fused", [True, False])
def test_layer_matches_float64_on_the_same_quantized_activations(recipe, fused):
    x, router, gq, gs, dq, ds = fp8_layer(recipe)
    out = ts_moe.moe_forward(x, router, gq, dq, 2, gate_up_scale=gs, down_scale=ds,
                             scale_recipe=recipe, fused=fused)
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = reference64(x, router, gq, gs, dq, ds, 2, recipe)
    assert rel_err(out, ref) <= 1e-2
    rows = (out.double() - ref).norm(dim=1) / ref.norm(dim=1)
    assert rows.max() <= 1e-2


@pytest.mark.parametrize("recipe", RECIPES)
def test_layer_close_to_the_bf16_layer_with_dequantized_weights(recipe):
    """The activations' e4m3 rounding (relative <= 2**-4 per element, about 3.6 % rms,
    twice) is the whole difference: within 8 %."""
    x, router, gq, gs, dq, ds = fp8_layer(recipe)
    out = ts_moe.moe_forward(x, router, gq, dq, 2, gate_up_scale=gs, down_scale=ds,
                             scale_recipe=recipe)
    bf16 = ts_moe.moe_forward(x, router, dequantize(gq, gs, recipe, torch.bfloat16),
                              dequantize(dq, ds, recipe, torch.bfloat16), 2)
    assert rel_err(out, bf16) <= 0.08


def test_mixed_recipes_and_experts_forward():
    """gate_up blockwise with down per channel; experts_forward on given routing gives
    moe_forward's experts; fused and unfused agree."""
    x, router, gq, gs, dq, ds = fp8_layer("blockwise_128x128", down_recipe="rowwise")
    recipes = (F.ScalingType.BlockWise128x128, F.ScalingType.RowWise)
    out = ts_moe.moe_forward(x, router, gq, dq, 2, gate_up_scale=gs, down_scale=ds,
                             scale_recipe=recipes)
    assert rel_err(out, reference64(x, router, gq, gs, dq, ds, 2, recipes)) <= 1e-2
    weights, experts = ts_moe.route(F.linear(x, router), 2)
    for fused in (True, False):
        got = ts_moe.experts_forward(x, experts, weights, gq, dq, gate_up_scale=gs,
                                     down_scale=ds, scale_recipe=recipes, fused=fused)
        assert torch.equal(got, out)


@pytest.mark.parametrize("recipe", RECIPES)
def test_module_from_weights(recipe):
    x, router, gq, gs, dq, ds = fp8_layer(recipe)
    weights = {"router": router, "gate_up_proj": gq, "down_proj": dq,
               "gate_up_proj_scale": gs, "down_proj_scale": ds, "scale_recipe": recipe}
    moe = ts_moe.MoE.from_weights(weights, 2)
    assert moe.gate_up_proj.dtype == torch.float8_e4m3fn
    assert moe.gate_up_proj.data_ptr() == gq.data_ptr() and moe.down_proj_scale is not None
    assert moe.scale_recipe == (Recipe(recipe),) * 2
    assert not any(p.requires_grad for p in moe.parameters())
    assert {"gate_up_proj_scale", "down_proj_scale"} <= set(moe.state_dict())
    want = ts_moe.moe_forward(x, router, gq, dq, 2, gate_up_scale=gs, down_scale=ds,
                              scale_recipe=recipe)
    assert torch.equal(moe(x), want)
    out, logits = moe(x.view(2, 12, 256), return_router_logits=True)
    assert torch.equal(out.view(24, 256), want) and logits.shape == (24, 4)


def _bad(recipe="blockwise_128x128"):
    x, router, gq, gs, dq, ds = fp8_layer(recipe)
    return dict(hidden=x, router_weight=router, gate_up_proj=gq, down_proj=dq, top_k=2,
                gate_up_scale=gs, down_scale=ds, scale_recipe=recipe)


@pytest.mark.parametrize("change,exc,match", [
    (dict(gate_up_scale=None), TypeError, "gate_up_scale must be a torch.Tensor"),
    (dict(down_scale=torch.ones(4, 3)), ValueError, "down_scale has shape"),
    (dict(down_scale=torch.ones(4, 2, 2, dtype=torch.float64)), TypeError, "down_scale must be "
                                                                          "float32"),
    (dict(gate_up_proj=torch.zeros(4, 512, 256)), TypeError, "gate_up_proj must be torch.float8"),
    (dict(down_proj=torch.zeros(4, 256, 128, dtype=torch.float8_e4m3fn)), ValueError,
     "down_proj must be"),
    (dict(hidden=torch.zeros(3, 256, dtype=torch.float64)), TypeError, "hidden must be"),
    (dict(router_weight=torch.zeros(4, 256)), TypeError, "router_weight must have"),
    (dict(scale_recipe=None), TypeError, "scale_recipe must name the FP8 weights' recipe"),
    (dict(scale_recipe="blockwise_1x128"), ValueError, "scale_recipe blockwise_1x128 is an "
                                                      "activation recipe"),
    (dict(scale_recipe=("rowwise",)), ValueError, "scale_recipe must be one recipe or a"),
    (dict(scale_recipe=F.ScalingType.BlockWise1x32), ValueError,
     "scale_recipe mx_1x32 is not a weight recipe of the layer"),
    (dict(scale_recipe=F.ScalingType.BlockWise1x16), ValueError, "scale_recipe 'BlockWise1x16'"),
    (dict(scale_recipe=7), TypeError, "scale_recipe must be a str"),
    (dict(scale_recipe="rowwise"), ValueError, "gate_up_scale has shape"),  # not by rank
])
def test_bad_layer_arguments_named(change, exc, match):
    with pytest.raises(exc, match=match):
        ts_moe.moe_forward(**{**_bad(), **change})


def test_blockwise_needs_sizes_in_whole_blocks():
    x, router, gq, gs, dq, ds = fp8_layer("blockwise_128x128", I=64)
    with pytest.raises(ValueError, match="intermediate_size = 64 must be a multiple of 128"):
        ts_moe.moe_forward(x, router, gq, dq, 2, gate_up_scale=gs, down_scale=ds,
                           scale_recipe="blockwise_128x128")
    x, router, gq, gs, dq, ds = fp8_layer("rowwise", I=64)  # per channel: any multiple of 16
    ts_moe.moe_forward(x, router, gq, dq, 2, gate_up_scale=gs, down_scale=ds,
                       scale_recipe="rowwise")


def test_compiles_fullgraph_and_runs_eagerly_on_the_cpu():
    x, router, gq, gs, dq, ds = fp8_layer("blockwise_128x128")

    def block(x):
        return ts_moe.moe_forward(x, router, gq, dq, 2, gate_up_scale=gs, down_scale=ds,
                                  scale_recipe=F.ScalingType.BlockWise128x128)

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    before = decode_graphs.graphs.captures
    assert torch.equal(compiled(x), block(x))
    assert decode_graphs.graphs.captures == before  # no CUDA: nothing captured


def test_no_gradient_through_fp8_experts():
    x, router, gq, gs, dq, ds = fp8_layer("rowwise")
    x = x.clone().requires_grad_()
    out = ts_moe.moe_forward(x, router, gq, dq, 2, gate_up_scale=gs, down_scale=ds,
                             scale_recipe="rowwise")
    assert out.requires_grad  # inference without no_grad works
    with pytest.raises(NotImplementedError, match="no backward"):
        out.float().sum().backward()
