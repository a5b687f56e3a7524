"""Gradients on the H200: the ops' backward on the sm_90a path (the forward
kernels for dA, the k-grouped kernel for dW) against an fp32 reference,
deterministic, without a host sync."""

import pytest
import torch
import torch.nn.functional as F

import ts_moe
from ts_moe.reference import grouped_gemm_k_reference, segment_ends

from .helpers import rel_err

pytestmark = pytest.mark.gpu  # skipped without an sm_90 GPU (conftest)
BF16 = torch.bfloat16

ROUTINGS = {  # rows per expert, rows past offs[-1]
    "ragged": ([300, 0, 1, 977, 64, 0, 5, 700], 17),
    "one_expert": ([0, 0, 2048, 0, 0, 0, 0, 0], 0),
    "skewed": ([1500, 200, 100, 50, 20, 10, 5, 1], 64),
}


def _offs(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32).cuda()


def _dense_grouped(a, b, offs):
    """fp32 autograd of the row-grouped product, one expert at a time."""
    out, start = [], 0
    for e, end in enumerate(segment_ends(offs, a.shape[0]).tolist()):
        out.append(a[start:end].float() @ b[e].float())
        start = end
    out.append(torch.zeros(a.shape[0] - start, b.shape[2], device=a.device))
    return torch.cat(out)


def _assert_rows_close(got, want, what, tol=1e-2):
    assert torch.isfinite(got).all(), what
    assert rel_err(got, want) <= tol, what
    norms = want.float().flatten(1).norm(dim=1)
    err = (got.float() - want.float()).flatten(1).norm(dim=1)
    live = norms > 0
    assert (err[live] <= tol * norms[live]).all(), f"{what}: rows {torch.nonzero(err > tol * norms)}"
    assert (got.float().flatten(1)[~live] == 0).all(), f"{what}: nonzero rows with zero reference"


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("layout", ["ekn", "enk"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_grouped_gemm_gradients(routing, layout, out_dtype):
    counts, past = ROUTINGS[routing]
    m, k, n = sum(counts) + past, 512, 384
    a = torch.randn(m, k, device="cuda", dtype=BF16, requires_grad=True)
    if layout == "ekn":
        b = torch.randn(8, k, n, device="cuda", dtype=BF16, requires_grad=True)
    else:
        b = torch.randn(8, n, k, device="cuda", dtype=BF16).transpose(-2, -1).requires_grad_()
    offs = _offs(counts)
    out = ts_moe.grouped_gemm(a, b, offs, out_dtype)
    grad = torch.randn(out.shape, device="cuda", dtype=out.dtype)
    out.backward(grad)
    a32, b32 = (t.detach().float().requires_grad_() for t in (a, b))
    _dense_grouped(a32, b32, offs).backward(grad.to(BF16).float())
    _assert_rows_close(a.grad, a32.grad, "da")
    _assert_rows_close(b.grad, b32.grad, "db")
    assert b.grad.stride() == b.stride()


@pytest.mark.parametrize("routing", ROUTINGS)
def test_swiglu_gradients_with_a_index(routing):
    counts, past = ROUTINGS[routing]
    m, hidden, inter = sum(counts) + past, 256, 192
    x = torch.randn(m // 2 + 1, hidden, device="cuda", dtype=BF16, requires_grad=True)
    gate_up = (0.1 * torch.randn(8, 2 * inter, hidden, device="cuda")).to(BF16).requires_grad_()
    index = torch.randint(0, x.shape[0], (m,), device="cuda", dtype=torch.int32)
    offs = _offs(counts)
    out = ts_moe.grouped_gemm_swiglu(x, gate_up, offs, a_index=index)
    grad = torch.randn(out.shape, device="cuda", dtype=BF16)
    out.backward(grad)
    x32, g32 = (t.detach().float().requires_grad_() for t in (x, gate_up))
    h = _dense_grouped(x32[index.long()], g32.transpose(-2, -1), offs)
    (F.silu(h[:, :inter]) * h[:, inter:]).backward(grad.float())
    _assert_rows_close(x.grad, x32.grad, "dx")
    _assert_rows_close(gate_up.grad, g32.grad, "dgate_up")


@pytest.mark.parametrize("dtype, out_dtype", [(BF16, None), (BF16, torch.float32),
                                              (torch.float16, None), (torch.float32, None)])
@pytest.mark.parametrize("k, n", [(512, 384), (200, 72), (68, 36)])
def test_k_grouped_forward(dtype, out_dtype, k, n):
    """K and N multiples of 8: the kernel (bf16, fp16); others: torch or the reference
    (views of padded rows, since the strides must stay 16-byte aligned)."""
    counts, past = ROUTINGS["ragged"]
    m = sum(counts) + past
    x = torch.randn(m, -(-k // 8) * 8, device="cuda", dtype=dtype)[:, :k]
    dy = torch.randn(m, -(-n // 8) * 8, device="cuda", dtype=dtype)[:, :n]
    offs = _offs(counts)
    got = ts_moe.grouped_gemm(x.t(), dy, offs, out_dtype)
    want = grouped_gemm_k_reference(x.t().float(), dy.float(), offs)
    assert got.shape == (8, k, n) and got.dtype == (out_dtype or dtype)
    for e, c in enumerate(counts):
        if c == 0:
            assert (got[e] == 0).all()
    _assert_rows_close(got.flatten(0, 1), want.flatten(0, 1), "dW")


def test_weight_gradient_is_deterministic():
    counts, past = ROUTINGS["skewed"]
    m = sum(counts) + past
    x = torch.randn(m, 1024, device="cuda", dtype=BF16)
    dy = torch.randn(m, 768, device="cuda", dtype=BF16)
    offs = _offs(counts)
    first = ts_moe.grouped_gemm(x.t(), dy, offs)
    for _ in range(3):
        assert torch.equal(ts_moe.grouped_gemm(x.t(), dy, offs), first)


def test_layer_backward_is_deterministic_and_never_syncs():
    torch.manual_seed(0)
    layer = ts_moe.MoE(1024, 512, num_experts=16, top_k=4, device="cuda", dtype=BF16)
    x = torch.randn(777, 1024, device="cuda", dtype=BF16, requires_grad=True)
    grad = torch.randn_like(x)

    def grads():
        for p in (x, *layer.parameters()):
            p.grad = None
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(x).backward(grad)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return [p.grad.clone() for p in (x, *layer.parameters())]

    layer(x).sum().backward()  # compile and warm everything outside the sync check
    first = grads()
    assert all(torch.isfinite(g).all() for g in first)
    assert all(torch.equal(g, f) for g, f in zip(grads(), first))


def test_compiled_layer_training_step_matches_eager():
    """torch.compile(fullgraph=True) of the layer's loss on the kernel path, and
    its compiled backward, against eager (the elementwise SwiGLU ops traced
    through their fake kernels)."""
    torch._dynamo.reset()
    torch.manual_seed(3)
    layer = ts_moe.MoE(1024, 512, num_experts=8, top_k=2, device="cuda", dtype=BF16)
    x = torch.randn(300, 1024, device="cuda", dtype=BF16)

    def loss(x):
        return layer(x).float().square().mean()

    want = loss(x)
    want.backward()
    eager = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    got = torch.compile(loss, fullgraph=True)(x)
    got.backward()
    torch.testing.assert_close(got, want)
    for p, g in zip(layer.parameters(), eager):
        assert rel_err(p.grad, g) <= 1e-2
