"""ts_moe.integrations.transformers: replace_moe_blocks and the "ts_moe" experts implementation."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ts_moe

transformers = pytest.importorskip("transformers", minversion="5")
from transformers import MixtralForCausalLM  # noqa: E402
from transformers.integrations.moe import ExpertsInterface  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

from ts_moe.integrations.transformers import (  # noqa: E402
    register, replace_moe_blocks, ts_moe_experts_forward)

from .helpers import OpRecorder, rel_err  # noqa: E402

PROMPT = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))


def tiny(tmp_path, dtype, names="v4", **kw):
    path = ts_moe.make_tiny_mixtral(tmp_path / f"m-{names}", names=names, **kw)
    load = dict(dtype=dtype, experts_implementation="eager")
    return (MixtralForCausalLM.from_pretrained(path, **load).eval(),
            MixtralForCausalLM.from_pretrained(path, **load).eval(), path)


def greedy(model, steps, prompt=PROMPT):
    """Greedy tokens, and per prompt the smallest top-1 - top-2 logit gap over the steps in
    bf16 spacings (units in the last place of bf16 at the top logit)."""
    prompt = prompt.to(model.device)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps,
                         min_new_tokens=steps, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    top2 = torch.stack(out.logits, 1).float().topk(2, dim=-1).values
    spacing = torch.exp2(torch.floor(torch.log2(top2[..., 0].abs())) - 7)
    return out.sequences, ((top2[..., 0] - top2[..., 1]) / spacing).amin(1)


def assert_same_greedy_tokens(model, ref, steps, prompts=128, min_gap=3):
    """The swapped model's greedy tokens equal the original's for ``steps`` steps.

    In bf16 the logits of a small random model are flat: many steps have their
    top two logits within a bf16 spacing, where either model's rounding may
    pick either token.  So the prompts compared are those whose original
    greedy run keeps a gap of ``min_gap`` spacings at every step (the rounding
    differences are well under one); both models run the whole batch alike.
    """
    candidates = torch.randint(0, 256, (prompts, 8), generator=torch.Generator().manual_seed(1))
    want, gap = greedy(ref, steps, candidates)
    got, _ = greedy(model, steps, candidates)
    clear = gap >= min_gap
    assert clear.sum() >= 4, f"only {int(clear.sum())} prompts with clear greedy decisions"
    assert torch.equal(got[clear], want[clear])


@pytest.mark.parametrize("names", ["v4", "v5"])
def test_replace_switches_every_block_in_place_without_copies(tmp_path, names):
    _, model, _ = tiny(tmp_path, torch.bfloat16, names=names, layers=3)
    weights = {n: p.data_ptr() for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    assert replace_moe_blocks(model) == 3
    for layer in model.model.layers:
        assert isinstance(layer.mlp, modeling_mixtral.MixtralSparseMoeBlock)
        assert type(layer.mlp) is not modeling_mixtral.MixtralSparseMoeBlock
        assert isinstance(layer.mlp.gate, modeling_mixtral.MixtralTopKRouter)
    assert list(model.state_dict()) == keys
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == weights
    assert replace_moe_blocks(model) == 0  # already switched


def test_replace_fp32_logits_router_logits_and_greedy_tokens(tmp_path):
    ref, model, _ = tiny(tmp_path, torch.float32, layers=2, seed=1)
    assert replace_moe_blocks(model) == 2
    with torch.no_grad():
        want = ref(PROMPT, output_router_logits=True)
        got = model(PROMPT, output_router_logits=True)
    assert rel_err(got.logits, want.logits) <= 1e-5
    # the gate modules still feed transformers' router-logit recording (aux loss)
    assert len(got.router_logits) == len(want.router_logits) == 2
    for a, b in zip(got.router_logits, want.router_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(greedy(model, 20)[0], greedy(ref, 20)[0])  # fp32: no near ties


@pytest.mark.parametrize("layers,experts,top_k,greedy_steps", [(1, 4, 2, 20), (2, 4, 4, 0)])
def test_replace_bf16_runs_the_ts_moe_ops(tmp_path, layers, experts, top_k, greedy_steps):
    """bf16 through the ops.  One MoE layer, or top_k = E, so that rounding differences
    cannot flip a later layer's routing (which is not an error, but not bf16 noise either)."""
    ref, model, _ = tiny(tmp_path, torch.bfloat16, layers=layers, experts=experts, top_k=top_k)
    replace_moe_blocks(model)
    with torch.no_grad(), OpRecorder() as rec:
        got = model(PROMPT).logits
    want = ref(PROMPT).logits
    assert {"ts_moe::grouped_gemm_swiglu", "ts_moe::grouped_gemm"} <= rec.ops
    assert rel_err(got, want) <= 2e-2
    if greedy_steps:
        assert_same_greedy_tokens(model, ref, greedy_steps)


@pytest.fixture
def registered():
    register()
    yield
    ExpertsInterface._global_mapping.pop("ts_moe", None)


@pytest.mark.parametrize("names", ["v4", "v5"])
def test_experts_implementation_ts_moe(tmp_path, registered, names):
    path = ts_moe.make_tiny_mixtral(tmp_path / names, names=names, layers=1)
    ref = MixtralForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    model = MixtralForCausalLM.from_pretrained(path, experts_implementation="ts_moe").eval()
    assert model.config._experts_implementation == "ts_moe"
    with torch.no_grad(), OpRecorder() as rec:
        got = model(PROMPT).logits
    assert {"ts_moe::grouped_gemm_swiglu", "ts_moe::grouped_gemm"} <= rec.ops
    want = ref(PROMPT).logits
    assert rel_err(got, want) <= 2e-2
    ref.set_experts_implementation("ts_moe")
    with torch.no_grad():
        assert torch.equal(ref(PROMPT).logits, got)


def test_experts_implementation_fp32_and_unsupported_layouts(tmp_path, registered):
    path = ts_moe.make_tiny_mixtral(tmp_path / "m", layers=1)
    ref = MixtralForCausalLM.from_pretrained(path, dtype=torch.float32,
                                             experts_implementation="eager").eval()
    model = MixtralForCausalLM.from_pretrained(path, dtype=torch.float32,
                                               experts_implementation="ts_moe").eval()
    with torch.no_grad():
        assert rel_err(model(PROMPT).logits, ref(PROMPT).logits) <= 1e-5
    experts = model.model.layers[0].mlp.experts
    x, ids, w = torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2) / 2
    experts.has_bias = True
    with pytest.raises(NotImplementedError, match="biases"):
        ts_moe_experts_forward(experts, x, ids, w)
    experts.has_bias = False
    experts.act_fn = nn.GELU()
    with pytest.raises(NotImplementedError, match="SiLU"):
        ts_moe_experts_forward(experts, x, ids, w)


def test_switched_blocks_compile_fullgraph(tmp_path, registered):
    _, model, path = tiny(tmp_path, torch.bfloat16, layers=1)
    replace_moe_blocks(model)
    interface = MixtralForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                   experts_implementation="ts_moe").eval()
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    for block in (model.model.layers[0].mlp, interface.model.layers[0].mlp):
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            assert torch.equal(compiled(x), block(x))


# ---------------------------------------------- the transformers 4.x structure
class StandInExpert(nn.Module):
    """A transformers-4 Mixtral expert: w1 (gate), w3 (up), w2 (down), SiLU."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.act_fn = nn.SiLU()


class MixtralSparseMoeBlock(nn.Module):
    """The transformers-4 block's structure and contract: ``gate`` Linear, ``experts``
    ModuleList, ``forward`` -> ``(hidden_states, router_logits)``, routing weights cast
    to the hidden dtype."""

    def __init__(self, hidden, inter, experts, top_k):
        super().__init__()
        self.top_k, self.jitter_noise = top_k, 0.0
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(StandInExpert(hidden, inter) for _ in range(experts))

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        router_logits = self.gate(x)
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(self.top_k):
                e = self.experts[int(ids[t, k])]
                out[t] += weights[t, k] * e.w2(e.act_fn(e.w1(x[t])) * e.w3(x[t]))
        return out.view(hidden_states.shape), router_logits


class StandInModel(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"block_sparse_moe": MixtralSparseMoeBlock(64, 128, 4, 2)})
            for _ in range(2))
        self.to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_replace_transformers4_structure(dtype, tol):
    torch.manual_seed(0)
    model = StandInModel(dtype).eval()
    block = model.layers[1]["block_sparse_moe"]
    x = torch.randn(2, 9, 64, dtype=dtype)
    with torch.no_grad():
        want, want_logits = block(x)
    w1 = [e.w1.weight.clone() for e in block.experts]
    assert replace_moe_blocks(model) == 2
    assert isinstance(block, MixtralSparseMoeBlock) and not hasattr(block, "experts")
    assert block.gate_up_proj.shape == (4, 256, 64) and block.down_proj.shape == (4, 64, 128)
    assert all(torch.equal(block.gate_up_proj[e, :128], w1[e]) for e in range(4))
    with torch.no_grad(), OpRecorder() as rec:
        got, logits = block(x)
    assert torch.equal(logits, want_logits)
    assert rel_err(got, want) <= tol
    assert "ts_moe::grouped_gemm_swiglu" in rec.ops  # every dtype runs on the ts_moe ops


def test_replace_rejects_what_it_cannot_run():
    model = StandInModel(torch.float32)
    model.layers[1]["block_sparse_moe"].experts[2].act_fn = nn.GELU()
    with pytest.raises(ValueError, match=r"layers\.1\.block_sparse_moe.*silu"):
        replace_moe_blocks(model)
    assert type(model.layers[0]["block_sparse_moe"]) is MixtralSparseMoeBlock  # nothing switched
    model = StandInModel(torch.float32)
    block = model.layers[1]["block_sparse_moe"]
    block.forward = lambda h: block(h)  # an instance-level forward, as accelerate hooks install
    with pytest.raises(ValueError, match="accelerate"):
        replace_moe_blocks(model)


# ---------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_tiny_mixtral_logits_and_20_greedy_tokens(tmp_path):
    ref, model, _ = tiny(tmp_path, torch.bfloat16, layers=1, experts=8, top_k=2, hidden=128,
                         intermediate=256)
    ref, model = ref.cuda(), model.cuda()
    assert replace_moe_blocks(model) == 1
    with torch.no_grad():
        got, want = model(PROMPT.cuda()).logits, ref(PROMPT.cuda()).logits
    assert rel_err(got, want) <= 2e-2
    assert_same_greedy_tokens(model, ref, 20)
