"""ts_moe.MoE / moe_forward against transformers' Mixtral block and fp32 references.

The CPU tests run the ops' plain-torch kernels; the ``gpu`` tests run the
CuTeDSL kernels on an sm_90 GPU.
"""

import pytest
import torch
import torch.nn.functional as F

import ts_moe
from ts_moe.moe import moe_forward_reference

from .helpers import rel_err

gpu = pytest.mark.gpu  # skipped without an sm_90 GPU (conftest)


def dense_reference(x, router, gate_up, down, top_k):
    """Every expert on every token in fp32, then the routed ones picked and weighted."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    weights, ids = ts_moe.route(F.linear(x.reshape(-1, x.shape[-1]), router), top_k)
    inter = gate_up.shape[1] // 2
    h = torch.einsum("th,eih->tei", x2, gate_up.float())
    y = torch.einsum("tei,ehi->teh", F.silu(h[..., :inter]) * h[..., inter:], down.float())
    picked = y.gather(1, ids[..., None].expand(-1, -1, y.shape[-1]))
    return (picked * weights[..., None]).sum(1).view(x.shape)


def boundary_untied(logits, top_k):
    """Tokens whose k-th and (k+1)-th routing probabilities differ (where torch.topk, which
    transformers uses, and ts_moe's lowest-index tie rule must pick the same experts)."""
    if top_k == logits.shape[1]:
        return torch.ones(logits.shape[0], dtype=torch.bool)
    p = torch.softmax(logits.float(), -1).sort(-1, descending=True).values
    return p[:, top_k - 1] != p[:, top_k]


def mixtral():
    """transformers' Mixtral module (the tests that compare against it skip without it)."""
    return pytest.importorskip("transformers.models.mixtral.modeling_mixtral")


def hf_block(hidden, inter, experts, top_k, dtype, seed):
    config = mixtral().MixtralConfig(hidden_size=hidden, intermediate_size=inter,
                                     num_local_experts=experts, num_experts_per_tok=top_k,
                                     experts_implementation="eager")
    torch.manual_seed(seed)
    block = mixtral().MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        block.gate.weight.normal_(0, hidden ** -0.5)
        block.experts.gate_up_proj.normal_(0, hidden ** -0.5)
        block.experts.down_proj.normal_(0, inter ** -0.5)
    return block.to(dtype)


def moe_from_block(block, top_k, fused=True):
    return ts_moe.MoE.from_weights({"router": block.gate.weight,
                                    "gate_up_proj": block.experts.gate_up_proj,
                                    "down_proj": block.experts.down_proj}, top_k, fused=fused)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (4, 1), (4, 4)])
def test_moe_matches_transformers_mixtral_block(dtype, tol, experts, top_k):
    block = hf_block(64, 128, experts, top_k, dtype, seed=experts + top_k)
    moe = moe_from_block(block, top_k)
    x = torch.randn(3, 21, 64, dtype=dtype)
    with torch.no_grad():
        want = block(x)
        logits_want = block.gate(x.view(-1, 64))[0]
        got, logits = moe(x, return_router_logits=True)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(logits, logits_want)
    keep = boundary_untied(logits, top_k)
    assert keep.sum() >= 0.9 * keep.numel()
    got, want = got.view(-1, 64)[keep], want.view(-1, 64)[keep]
    assert rel_err(got, want) <= tol


@pytest.mark.parametrize("names", ["v4", "v5"])
def test_moe_from_tiny_checkpoint_matches_transformers(tmp_path, names):
    model_cls = mixtral().MixtralForCausalLM
    path = ts_moe.make_tiny_mixtral(tmp_path / names, layers=2, experts=4, top_k=2,
                                    names=names, seed=3)
    model = model_cls.from_pretrained(path, experts_implementation="eager")
    weights = ts_moe.load_mixtral_experts(path, device="cpu")
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    for layer in (0, 1):
        moe = ts_moe.MoE.from_weights(weights[layer], top_k=2)
        with torch.no_grad():
            want = model.model.layers[layer].mlp(x)
            got, logits = moe(x, return_router_logits=True)
        keep = boundary_untied(logits, 2)
        assert keep.all() or keep.sum() >= 28
        assert rel_err(got.view(-1, 64)[keep], want.view(-1, 64)[keep]) <= 2e-2
    moe = ts_moe.MoE.from_pretrained(path, 1, device="cpu")
    assert moe.top_k == 2 and torch.equal(moe.down_proj, weights[1]["down_proj"])


@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_ops_against_fp32_references(tokens, fused, dtype):
    moe = ts_moe.MoE(64, 128, 8, 2, fused=fused, dtype=dtype).requires_grad_(False)
    x = torch.randn(tokens, 64, dtype=dtype)
    got = moe(x)
    params = (moe.router, moe.gate_up_proj, moe.down_proj, 2)
    loop = moe_forward_reference(x, *params)
    dense = dense_reference(x, *params)
    assert rel_err(loop.float(), dense) <= 8e-3  # the references agree (one bf16 rounding)
    assert rel_err(got, dense) <= 1.5e-2


def test_fused_and_unfused_agree():
    moe = ts_moe.MoE(64, 256, 8, 2, dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(50, 64, dtype=torch.bfloat16)
    fused = moe(x)
    moe.fused = False
    unfused = moe(x)
    # both apply SwiGLU to fp32 GEMM results and round once
    assert rel_err(unfused, fused) <= 5e-3


def test_moe_fp32_runs_the_reference_gemms_exactly():
    moe = ts_moe.MoE(48, 40, 6, 3).requires_grad_(False)  # through the ops, on the CPU reference
    x = torch.randn(5, 9, 48)
    want = dense_reference(x, moe.router, moe.gate_up_proj, moe.down_proj, 3)
    assert rel_err(moe(x), want) < 1e-5


def test_moe_all_experts_empty_but_one_and_ties():
    moe = ts_moe.MoE(64, 128, 8, 1, dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(30, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        moe.router.zero_()
        moe.router[5] = 1.0
        x[:, 0] = 64.0  # logit of expert 5 ~ sum(x) > 0 for every token: all rows to expert 5
    got, logits = moe(x, return_router_logits=True)
    assert (logits.argmax(-1) == 5).all()
    assert rel_err(got, dense_reference(x, moe.router, moe.gate_up_proj, moe.down_proj, 1)) <= 1e-2
    # equal logits: experts 0 and 1 for every token, weight 1/2 each
    moe2 = ts_moe.MoE(64, 128, 8, 2, dtype=torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        moe2.router.zero_()
    inter = 128
    h = torch.einsum("th,eih->tei", x.float(), moe2.gate_up_proj[:2].float())
    y = torch.einsum("tei,ehi->teh", F.silu(h[..., :inter]) * h[..., inter:],
                     moe2.down_proj[:2].float())
    assert rel_err(moe2(x), y.mean(1)) <= 1e-2


def test_moe_shapes_zero_tokens_and_logits():
    moe = ts_moe.MoE(64, 128, 4, 2, dtype=torch.bfloat16).requires_grad_(False)
    assert moe(torch.randn(64, dtype=torch.bfloat16)).shape == (64,)
    out, logits = moe(torch.zeros(2, 0, 64, dtype=torch.bfloat16), return_router_logits=True)
    assert out.shape == (2, 0, 64) and logits.shape == (0, 4)
    x = torch.randn(2, 3, 5, 64, dtype=torch.bfloat16)
    out, logits = moe(x, return_router_logits=True)
    assert out.shape == x.shape and logits.shape == (30, 4)
    assert torch.equal(logits, x.view(-1, 64) @ moe.router.t())


def test_moe_rejects_bad_arguments():
    moe = ts_moe.MoE(64, 128, 4, 2, dtype=torch.bfloat16).requires_grad_(False)
    p = (moe.router, moe.gate_up_proj, moe.down_proj)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gate_up_proj must be"):
        ts_moe.moe_forward(torch.randn(3, 32, dtype=torch.bfloat16), *p, 2)
    with pytest.raises(ValueError, match="router_weight must be"):
        ts_moe.moe_forward(x, p[0][:, :32], *p[1:], 2)
    with pytest.raises(TypeError, match="router_weight"):
        ts_moe.moe_forward(x, p[0].float(), *p[1:], 2)
    with pytest.raises(TypeError, match="gate_up_proj"):
        ts_moe.moe_forward(x, p[0], p[1].half(), p[2], 2)
    with pytest.raises(ValueError, match="down_proj"):
        ts_moe.moe_forward(x, p[0], p[1], p[2][:, :, :64], 2)
    with pytest.raises(ValueError, match="router_weight has 3 experts"):
        ts_moe.moe_forward(x, p[0][:3], p[1], p[2], 2)
    with pytest.raises(ValueError, match="top_k"):
        ts_moe.moe_forward(x, *p, 5)
    with pytest.raises(TypeError, match="hidden must be"):
        ts_moe.moe_forward(x.int(), *p, 2)
    with pytest.raises(ValueError, match="top_k"):
        ts_moe.MoE(64, 128, 4, 8)
    with pytest.raises(ValueError, match="down_proj"):
        ts_moe.MoE.from_weights({"router": p[0], "gate_up_proj": p[1], "down_proj": p[1]}, 2)
    with pytest.raises(KeyError, match="down_proj"):
        ts_moe.MoE.from_weights({"router": p[0], "gate_up_proj": p[1]}, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs, name", [
    ({"hidden_size": 60, "intermediate_size": 128}, "hidden_size = 60"),
    ({"hidden_size": 64, "intermediate_size": 100}, "intermediate_size = 100"),
    ({"hidden_size": 0, "intermediate_size": 128}, "hidden_size must be a positive int"),
])
def test_moe_sizes_checked_at_construction(dtype, kwargs, name):
    """One rule for every dtype, at construction, naming the argument."""
    with pytest.raises(ValueError, match=name):
        ts_moe.MoE(**kwargs, num_experts=4, top_k=2, dtype=dtype)
    h, inter = kwargs["hidden_size"] or 8, kwargs["intermediate_size"]
    if h % 8 or inter % 8:  # the functional layer names the size too
        with pytest.raises(ValueError, match=name.split(" =")[0]):
            ts_moe.moe_forward(torch.randn(3, h, dtype=dtype), torch.randn(4, h, dtype=dtype),
                               torch.randn(4, 2 * inter, h, dtype=dtype),
                               torch.randn(4, h, inter, dtype=dtype), 2)


def test_from_weights_shares_storage():
    moe = ts_moe.MoE(64, 128, 4, 2, dtype=torch.bfloat16)
    w = {name: getattr(moe, name).data for name in ("router", "gate_up_proj", "down_proj")}
    moe2 = ts_moe.MoE.from_weights(w, 2)
    for name, t in w.items():
        assert getattr(moe2, name).data_ptr() == t.data_ptr()
        assert not getattr(moe2, name).requires_grad


@pytest.mark.parametrize("fused", [True, False])
def test_moe_compiles_fullgraph(fused):
    moe = ts_moe.MoE(64, 128, 8, 2, fused=fused, dtype=torch.bfloat16).requires_grad_(False)
    compiled = torch.compile(moe, fullgraph=True)
    for tokens in (5, 19):
        x = torch.randn(tokens, 64, dtype=torch.bfloat16)
        out, logits = compiled(x, return_router_logits=True)
        want, want_logits = moe(x, return_router_logits=True)
        torch.testing.assert_close(logits, want_logits)
        assert rel_err(out, want) <= 5e-3


# --------------------------------------------------------------------- GPU
def _gpu_moe(experts=8, top_k=2, hidden=256, inter=512, seed=0):
    torch.manual_seed(seed)
    return ts_moe.MoE(hidden, inter, experts, top_k, device="cuda",
                      dtype=torch.bfloat16).requires_grad_(False)


@gpu
@pytest.mark.parametrize("tokens", [1, 7, 64, 1000, 4096])
@pytest.mark.parametrize("fused", [True, False])
def test_gpu_kernel_path_against_references(tokens, fused):
    moe = _gpu_moe(seed=tokens)
    moe.fused = fused
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    got = moe(x)
    want = dense_reference(x, moe.router, moe.gate_up_proj, moe.down_proj, 2)
    assert rel_err(got, want) <= 1.5e-2
    if tokens <= 64:
        loop = moe_forward_reference(x, moe.router, moe.gate_up_proj, moe.down_proj, 2)
        assert rel_err(got, loop.float()) <= 1.5e-2
    assert torch.equal(got, moe(x))  # deterministic


@gpu
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_gpu_all_experts_empty_but_one_and_ties(tokens):
    moe = _gpu_moe(top_k=1, seed=1)
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        moe.router.zero_()
        moe.router[6] = 1.0
        x[:, 0] = 256.0
    got, logits = moe(x, return_router_logits=True)
    assert (logits.argmax(-1) == 6).all()
    want = dense_reference(x, moe.router, moe.gate_up_proj, moe.down_proj, 1)
    assert rel_err(got, want) <= 1.5e-2
    # all logits tied: experts 0 and 1 for every token
    moe2 = _gpu_moe(top_k=2, seed=2)
    with torch.no_grad():
        moe2.router.zero_()
    weights, ids = ts_moe.route(F.linear(x, moe2.router), 2)
    assert (ids == torch.tensor([0, 1], device="cuda")).all() and (weights == 0.5).all()
    assert rel_err(moe2(x), dense_reference(x, moe2.router, moe2.gate_up_proj,
                                            moe2.down_proj, 2)) <= 1.5e-2


@gpu
def test_gpu_matches_transformers_mixtral_block():
    block = hf_block(256, 512, 8, 2, torch.bfloat16, seed=0).cuda()
    moe = moe_from_block(block, 2)
    x = torch.randn(4, 100, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = block(x)
        got, logits = moe(x, return_router_logits=True)
    keep = boundary_untied(logits, 2)
    assert keep.sum() >= 0.9 * keep.numel()
    assert rel_err(got.view(-1, 256)[keep], want.view(-1, 256)[keep]) <= 2e-2


@gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_gpu_cuda_graph_decode(tokens):
    moe = _gpu_moe(seed=3)
    static_x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (kernel compilation) outside the capture
        for _ in range(2):
            moe(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(static_x)
    for _ in range(3):
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, moe(static_x))


@gpu
def test_gpu_forward_has_no_host_sync():
    moe = _gpu_moe(seed=4)
    for tokens in (8, 1000):
        x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
        moe(x)  # warm up: kernel compilation may query the device
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            moe(x)
            moe.fused = not moe.fused
            moe(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
