"""GPU (sm_90): the combine's gradient kernel against the float64 gradient of the combine,
and the layer's one-node backward against an fp32 loop, on the sm_90a path."""

import pytest
import torch

import ts_moe
from ts_moe import reference
from ts_moe.experts_grad import inverse_order
from ts_moe.ops.routing import COMBINE_GRAD

from .helpers import rel_err

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _slots(tokens, top_k, experts, seed, drop=0.0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
    ids[torch.rand(tokens, top_k, generator=g) < drop] = -1
    return reference.sort_slots(ids.cuda(), experts)


def _exact(dout, y, weights, inverse):
    """float64 autograd of the combine."""
    y64 = y.double().requires_grad_()
    w64 = weights.double().requires_grad_()
    out = reference.combine(y64, w64, inverse)
    dy, dw = torch.autograd.grad(out, (y64, w64), dout.double())
    return dy, dw


@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 1, 8), (1, 8, 2048), (37, 2, 4096),
                                                 (512, 8, 7168), (3000, 6, 1024)])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_kernel_matches_float64(tokens, top_k, hidden, dtype):
    slots = _slots(tokens, top_k, 64, seed=tokens + hidden)
    rows = tokens * top_k
    dout = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    y = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    weights = torch.rand(tokens, top_k, device="cuda")
    order = inverse_order(slots.inverse)
    for index in (order, order.int()):
        dy, dw = COMBINE_GRAD(dout, y, weights, index)
        want_dy, want_dw = _exact(dout, y, weights, slots.inverse)
        assert dy.dtype == dtype and dw.dtype == torch.float32
        assert rel_err(dy, want_dy) <= 4e-3
        per_row = (dy.double() - want_dy).norm(dim=1) / want_dy.norm(dim=1).clamp_min(1e-30)
        assert per_row.max() <= 4e-3
        assert rel_err(dw[slots.inverse].view(tokens, top_k), want_dw) <= 1e-5
        got_ref = reference.combine_grad(dout, y, weights, index)
        assert rel_err(dy, got_ref[0]) <= 4e-3 and rel_err(dw, got_ref[1]) <= 1e-5


def test_kernel_rows_no_slot_reads_are_zero():
    """order entries outside [0, T k) (negative, past the end): zero rows, zero dw; the
    other rows as the reference; every output written (poisoned first)."""
    tokens, top_k, hidden = 40, 4, 512
    dout = torch.randn(tokens, hidden, device="cuda", dtype=BF16)
    y = torch.randn(tokens * top_k + 7, hidden, device="cuda", dtype=BF16)
    weights = torch.rand(tokens, top_k, device="cuda")
    order = torch.randint(-20, tokens * top_k + 20, (y.shape[0],), device="cuda")
    dy, dw = COMBINE_GRAD(dout, y, weights, order)
    want_dy, want_dw = reference.combine_grad(dout, y, weights, order)
    outside = (order < 0) | (order >= tokens * top_k)
    assert outside.any() and (dy[outside] == 0).all() and (dw[outside] == 0).all()
    assert rel_err(dy, want_dy) <= 4e-3 and rel_err(dw, want_dw) <= 1e-5


def _layer_case(tokens, hidden, inter, experts, top_k, seed, drop=0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = {"device": "cuda", "generator": g}
    x = torch.randn(tokens, hidden, dtype=BF16, **kw)
    gate_up = (torch.randn(experts, 2 * inter, hidden, **kw) * hidden**-0.5).to(BF16)
    down = (torch.randn(experts, hidden, inter, **kw) * inter**-0.5).to(BF16)
    ids = torch.rand(tokens, experts, **kw).argsort(dim=1)[:, :top_k]
    ids[torch.rand(tokens, top_k, **kw) < drop] = -1
    weights = torch.rand(tokens, top_k, **kw)
    dout = torch.randn(tokens, hidden, dtype=BF16, **kw)
    return x, gate_up, down, ids, weights, dout


def _fp32_layer(x, gate_up, down, ids, weights):
    inter = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(gate_up.shape[0]):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        h = x[token].float() @ gate_up[e].float().t()
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ down[e].float().t()
        out = out.index_add(0, token, weights[token, slot, None] * y)
    return out


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,drop", [
    (1, 256, 128, 4, 2, 0.0), (300, 1024, 256, 16, 4, 0.0), (2048, 2048, 768, 128, 8, 0.0),
    (777, 512, 384, 8, 2, 0.2)])
def test_layer_node_gradients_match_fp32(tokens, hidden, inter, experts, top_k, drop):
    x, gate_up, down, ids, weights, dout = _layer_case(tokens, hidden, inter, experts, top_k,
                                                       seed=tokens, drop=drop)
    leaves = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
    out = ts_moe.experts_forward(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    assert type(out.grad_fn).__name__ == "_ExpertsBackward"
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.float().clone().requires_grad_() for t in (x, weights, gate_up, down)]
    ref = _fp32_layer(ref_leaves[0], ref_leaves[2], ref_leaves[3], ids, ref_leaves[1])
    want = torch.autograd.grad(ref, ref_leaves, dout.float())
    assert rel_err(out, ref) <= 1e-2
    for name, got, w in zip(("dx", "d_weights", "d_gate_up", "d_down"), grads, want):
        assert torch.isfinite(got).all(), name
        assert rel_err(got, w) <= 1e-2, name
        if name in ("dx", "d_gate_up", "d_down"):  # per row / per expert
            for g_row, w_row in zip(got.flatten(0, -3) if got.dim() == 3 else got, w):
                if w_row.norm() > 0:
                    assert rel_err(g_row, w_row) <= 2e-2, name
                else:
                    assert (g_row == 0).all(), name


def test_layer_node_is_deterministic_and_never_syncs():
    x, gate_up, down, ids, weights, dout = _layer_case(1024, 1024, 512, 32, 4, seed=5)

    def step():
        leaves = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
        out = ts_moe.experts_forward(leaves[0], ids, leaves[1], leaves[2], leaves[3])
        return torch.autograd.grad(out, leaves, dout)

    first = step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(first, second):
        assert torch.equal(a, b)
