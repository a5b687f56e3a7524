"""CPU: the combine's gradient op (``ts_moe::combine_grad``) and the layer's one-node
backward (:mod:`ts_moe.experts_grad`): the reference against autograd of the combine, the
op's checks, the node's gradients and double backward against the composed ops, and the
sm_90a kernel's PTX (16-byte rows, a warp butterfly, no atomics, no spills)."""

import re

import pytest
import torch

import ts_moe
from ts_moe import reference
from ts_moe.experts_grad import composed, experts, inverse_order
from ts_moe.ops.routing import COMBINE_GRAD

from .helpers import rel_err
from .ptxas import NO_SPILLS, assemble, assert_pdl_entry, ptx_fixture, registers

F64 = torch.float64
BUILDS = ["combine_grad", "combine_grad_i32", "combine_grad_fp16", "combine_grad_fp16_i32"]
ptx = ptx_fixture("sm_90a", BUILDS)


def _slots(tokens, top_k, experts, seed, drop=0.0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
    ids[torch.rand(tokens, top_k, generator=g) < drop] = -1
    return ids, reference.sort_slots(ids, experts)


@pytest.mark.parametrize("tokens,top_k,drop", [(1, 1, 0.0), (9, 2, 0.0), (50, 8, 0.3),
                                               (0, 4, 0.0)])
def test_reference_is_the_combines_gradient(tokens, top_k, drop):
    _, slots = _slots(tokens, top_k, 16, seed=tokens, drop=drop)
    y = torch.randn(tokens * top_k, 24, dtype=F64, requires_grad=True)
    w = torch.rand(tokens, top_k, dtype=F64, requires_grad=True)
    dout = torch.randn(tokens, 24, dtype=F64)
    out = reference.combine(y, w, slots.inverse)
    want_dy, want_dw = torch.autograd.grad(out, (y, w), dout, allow_unused=True)
    dy, dw = COMBINE_GRAD(dout, y.detach(), w.detach(), inverse_order(slots.inverse))
    assert dy.dtype == F64 and dw.dtype == F64
    assert torch.allclose(dy, want_dy) and torch.allclose(dw[slots.inverse].view(w.shape), want_dw)


def test_rows_no_slot_reads_are_zero_and_bf16_rounds_once():
    tokens, top_k = 6, 2
    dout = torch.randn(tokens, 16, dtype=torch.bfloat16)
    y = torch.randn(15, 16, dtype=torch.bfloat16)
    w = torch.rand(tokens, top_k)
    order = torch.tensor([3, -1, 0, 11, 12, 5, 99, 1, 2, 4, 6, 7, 8, 9, 10])
    dy, dw = COMBINE_GRAD(dout, y, w, order)
    outside = (order < 0) | (order >= tokens * top_k)
    assert (dy[outside] == 0).all() and (dw[outside] == 0).all()
    inside = torch.nonzero(~outside).flatten()
    slot = order[inside]
    exact = w.reshape(-1)[slot, None] * dout[slot // top_k].float()
    assert torch.equal(dy[inside], exact.to(torch.bfloat16))
    assert torch.allclose(dw[inside], (dout[slot // top_k].float() * y[inside].float()).sum(1))


def test_op_checks_its_arguments():
    dout, y, w = torch.randn(4, 8), torch.randn(8, 8), torch.rand(4, 2)
    order = torch.arange(8)
    with pytest.raises(TypeError, match="one float dtype"):
        COMBINE_GRAD(dout.bfloat16(), y, w, order)
    with pytest.raises(TypeError, match="order must be int32 or int64"):
        COMBINE_GRAD(dout, y, w, order.float())
    with pytest.raises(ValueError, match=r"dout must be \(T, H\)"):
        COMBINE_GRAD(dout[:3], y, w, order)
    with pytest.raises(ValueError, match="order"):
        COMBINE_GRAD(dout, y, w, order[:7])
    with pytest.raises(ValueError, match="weights is on meta"):
        COMBINE_GRAD(dout, y, w.to("meta"), order)
    torch.library.opcheck(COMBINE_GRAD, (dout, y, w, order))


def _layer_inputs(tokens, hidden, inter, num_experts, top_k, dtype, seed, drop=0.0):
    torch.manual_seed(seed)
    x = torch.randn(tokens, hidden, dtype=dtype)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, dtype=dtype) * hidden**-0.5
    down = torch.randn(num_experts, hidden, inter, dtype=dtype) * inter**-0.5
    ids, slots = _slots(tokens, top_k, num_experts, seed, drop)
    return x, torch.rand(tokens, top_k, dtype=torch.float32), gate_up, down, ids, slots


@pytest.mark.parametrize("drop", [0.0, 0.25])
def test_node_gradients_equal_the_composed_ops(drop):
    """float64: the node's backward against autograd through the ops, each with its own
    gradient (the general adjoints), on the same slots, dropped slots included."""
    x, w, gate_up, down, _, slots = _layer_inputs(13, 16, 8, 5, 3, F64, seed=3, drop=drop)
    w = w.double()
    a = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    b = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    out = experts(*a, slots)
    assert type(out.grad_fn).__name__ == "_ExpertsBackward"
    want_out = composed(*b, slots)
    assert torch.allclose(out, want_out)
    dout = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, a, dout), torch.autograd.grad(want_out, b, dout)):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_node_backward_twice_with_retain_graph(dtype):
    """The first backward frees the forward's intermediates; a second one through the
    retained graph computes them again and gives the same gradients."""
    x, w, gate_up, down, _, slots = _layer_inputs(11, 16, 8, 4, 2, dtype, seed=8)
    leaves = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    out = experts(*leaves, slots)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    assert out.grad_fn.h is None  # dropped once used
    second = torch.autograd.grad(out, leaves, dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_node_double_backward():
    x, w, gate_up, down, _, slots = _layer_inputs(5, 8, 8, 3, 2, F64, seed=4)
    inputs = [t.double().requires_grad_() for t in (x, w, gate_up, down)]
    assert torch.autograd.gradgradcheck(lambda *t: experts(*t, slots), inputs)


def test_layer_takes_the_node_only_where_it_applies():
    x, w, gate_up, down, ids, _ = _layer_inputs(7, 16, 8, 4, 2, torch.bfloat16, seed=6)
    gate_up.requires_grad_()
    out = ts_moe.experts_forward(x, ids, w, gate_up, down)
    assert type(out.grad_fn).__name__ == "_ExpertsBackward"
    out = ts_moe.experts_forward(x, ids, w, gate_up, down, fused=False)
    assert type(out.grad_fn).__name__ != "_ExpertsBackward"
    with torch.no_grad():
        assert ts_moe.experts_forward(x, ids, w, gate_up, down).grad_fn is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_gradients_match_the_composed_ops_in_16_bits(dtype):
    """bf16 / fp32 on the CPU's references: the node and the ops' own gradients agree to
    the rounding of the intermediates (both round h, the activation and y alike)."""
    x, w, gate_up, down, ids, slots = _layer_inputs(40, 32, 16, 6, 2, dtype, seed=7)
    a = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    b = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    out, want = experts(*a, slots), composed(*b, slots)
    dout = torch.randn_like(out)
    assert rel_err(out, want) <= 1e-2
    for got, ref in zip(torch.autograd.grad(out, a, dout), torch.autograd.grad(want, b, dout)):
        assert rel_err(got, ref) <= 1e-2


def test_kernel_ptx(ptx, tmp_path):
    """Per lane: 16-byte loads of dout and y and one 16-byte store of dy a vector (the
    loop unrolled twice), an fp32 FMA per element, a 5-step butterfly for dw, one fp32
    store of it; no atomics, no shared memory, no spills."""
    for name in BUILDS:
        text = ptx[name]
        assert_pdl_entry(text)
        assert len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", text)) == 4, name
        assert len(re.findall(r"st\.global(?:\.\w+)*\.v4\.b32", text)) == 3, name
        assert len(re.findall(r"fma\.rn\.f32", text)) == 16, name
        assert len(re.findall(r"shfl\.sync\.bfly", text)) == 5, name
        assert len(re.findall(r"st\.global(?:\.\w+)*\.b32", text)) - 3 == 1, name
        assert not re.search(r"^\s*(?:@!?%p\d+\s+)?(?:atom|red)\.", text, re.M), name
        assert ".shared" not in text, name
        report = assemble(text, "sm_90a", tmp_path)
        assert NO_SPILLS in report and registers(report) <= 64, name
