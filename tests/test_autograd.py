"""Gradients of the ops and the layer on the CPU (the reference path).

float64 ``gradcheck`` of every form (row-grouped with both weight layouts and
``a_index``, k-grouped, SwiGLU keeping or recomputing h); bf16 gradients
against float64 autograd of plain torch, per row and overall; ``opcheck``
with ``requires_grad`` inputs; compiled backward against eager; the layer's
gradients (router included) against a plain-torch layer.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck

import ts_moe
from ts_moe.ops import paths
from ts_moe.ops import swiglu as swiglu_ops
from ts_moe.reference import segment_ends, swiglu, swiglu_backward

from .helpers import rel_err

F64, BF16 = torch.float64, torch.bfloat16

# (rows per expert, rows past offs[-1]): empty experts, one expert holding every
# row, ragged, and rows after the last expert (they get zero gradient)
ROUTINGS = {
    "ragged": ([3, 0, 2, 1], 2),
    "one_expert": ([0, 8, 0, 0], 0),
    "all_empty": ([0, 0, 0, 0], 4),
}


def _offs(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _rows(counts, past):
    return sum(counts) + past


def _dense_grouped(a, b, offs):
    """Row-grouped product in plain torch, differentiable (the yardstick)."""
    ends = segment_ends(offs, a.shape[0]).tolist()
    out, start = [], 0
    for e, end in enumerate(ends):
        out.append(a[start:end] @ b[e])
        start = end
    out.append(a[start:] @ torch.zeros_like(b[0]) if b.shape[0] else a[:, :0])
    return torch.cat(out)


def _dense_k_grouped(a, b, offs):
    ends = segment_ends(offs, b.shape[0]).tolist()
    out, start = [], 0
    for end in ends:
        out.append(a[:, start:end] @ b[start:end])
        start = end
    return torch.stack(out)


def _dense_swiglu(a, gate_up, offs):
    h = _dense_grouped(a, gate_up.transpose(-2, -1), offs)
    inter = gate_up.shape[1] // 2
    return F.silu(h[:, :inter]) * h[:, inter:]


# --------------------------------------------------------------- gradcheck
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("layout", ["ekn", "enk"])
def test_gradcheck_row_grouped(routing, layout):
    counts, past = ROUTINGS[routing]
    m, k, n = _rows(counts, past), 6, 4
    a = torch.randn(m, k, dtype=F64, requires_grad=True)
    if layout == "ekn":
        b = torch.randn(4, k, n, dtype=F64, requires_grad=True)
    else:  # the transpose of an (E, N, K) nn.Linear stack
        b = torch.randn(4, n, k, dtype=F64).transpose(-2, -1).requires_grad_()
    offs = _offs(counts)
    assert gradcheck(lambda a, b: ts_moe.grouped_gemm(a, b, offs), (a, b))
    out = ts_moe.grouped_gemm(a, b, offs)
    grad = torch.randn_like(out)
    da, db = torch.autograd.grad(out, (a, b), grad)
    assert db.stride() == b.stride()  # the weight's gradient in the weight's layout
    if past:
        assert da[sum(counts):].abs().max() == 0  # rows past offs[-1]: zero gradient
    for e, c in enumerate(counts):
        if c == 0:
            assert db[e].abs().max() == 0  # an expert without rows: zero gradient


def test_gradcheck_a_index_duplicates_and_out_of_range():
    a = torch.randn(6, 6, dtype=F64, requires_grad=True)
    b = torch.randn(3, 6, 4, dtype=F64, requires_grad=True)
    index = torch.tensor([0, 2, 2, 9, -1, 5, 1, 3, 2], dtype=torch.int32)
    offs = _offs([3, 0, 5])  # the last gathered row is past offs[-1]
    assert gradcheck(lambda a, b: ts_moe.grouped_gemm(a, b, offs, a_index=index), (a, b))
    da, = torch.autograd.grad(ts_moe.grouped_gemm(a, b, offs, a_index=index).sum(), (a,))
    assert da[4].abs().max() == 0  # row 4 is never gathered


@pytest.mark.parametrize("routing", ROUTINGS)
def test_gradcheck_k_grouped(routing):
    counts, past = ROUTINGS[routing]
    m = _rows(counts, past)
    a = torch.randn(6, m, dtype=F64).t().contiguous().t().requires_grad_()  # x.t()
    dy = torch.randn(m, 4, dtype=F64, requires_grad=True)
    offs = _offs(counts)
    assert gradcheck(lambda a, b: ts_moe.grouped_gemm(a, b, offs), (a, dy))
    out = ts_moe.grouped_gemm(a, dy, offs)
    assert out.shape == (4, 6, 4)
    torch.testing.assert_close(out, _dense_k_grouped(a, dy, offs))


@pytest.mark.parametrize("keeps_h", [True, False])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_gradcheck_swiglu(monkeypatch, keeps_h, routing):
    monkeypatch.setattr(swiglu_ops, "SWIGLU_KEEPS_H", keeps_h)
    counts, past = ROUTINGS[routing]
    m = _rows(counts, past)
    a = torch.randn(m, 6, dtype=F64, requires_grad=True)
    gate_up = torch.randn(4, 8, 6, dtype=F64, requires_grad=True)
    offs = _offs(counts)
    assert gradcheck(lambda a, g: ts_moe.grouped_gemm_swiglu(a, g, offs), (a, gate_up))
    index = torch.tensor(list(range(m))[::-1] + [m + 3], dtype=torch.int32)
    offs2 = _offs(counts[:-1] + [counts[-1] + 1])
    assert gradcheck(lambda a, g: ts_moe.grouped_gemm_swiglu(a, g, offs2, a_index=index),
                     (a, gate_up))


def test_gradgradcheck_row_grouped():
    a = torch.randn(6, 4, dtype=F64, requires_grad=True)
    b = torch.randn(3, 4, 2, dtype=F64, requires_grad=True)
    offs = _offs([2, 0, 3])
    assert gradgradcheck(lambda a, b: ts_moe.grouped_gemm(a, b, offs), (a, b))


# ----------------------------------------- double backward through SwiGLU
class _KernelLikeActivation:
    """Stands in for the sm_90 elementwise SwiGLU kernels on the CPU: writes its
    outputs as a kernel does, with no autograd graph of its own, and counts
    its launches."""

    def __init__(self):
        self.launches = []

    def choose_config(self, h, dy):
        return "stand-in"

    def forward(self, h, out, config):
        self.launches.append("forward")
        with torch.no_grad():
            return out.copy_(swiglu(h, h.dtype))

    def backward(self, dy, h, dh, config):
        self.launches.append("backward")
        with torch.no_grad():
            return dh.copy_(swiglu_backward(dy, h, h.dtype))


@pytest.fixture(params=["reference", "kernel_like"])
def activation(request, monkeypatch):
    """The activation backend of CPU tensors: the reference, or the stand-in."""
    if request.param == "reference":
        return None
    stand_in = _KernelLikeActivation()
    real = paths.device_backends
    monkeypatch.setattr(paths, "device_backends", lambda op, t: (
        (stand_in,) if op is paths.Op.SWIGLU_ACTIVATION else real(op, t)))
    return stand_in


@pytest.mark.parametrize("keeps_h", [True, False])
def test_gradgradcheck_swiglu_on_every_backend(monkeypatch, activation, keeps_h):
    """Second derivatives through grouped_gemm_swiglu are exact whether the
    activation's gradient is computed by plain torch or by a kernel (the
    formula of swiglu_backward: ts_moe.reference.swiglu_double_backward)."""
    monkeypatch.setattr(swiglu_ops, "SWIGLU_KEEPS_H", keeps_h)
    a = torch.randn(7, 6, dtype=F64, requires_grad=True)
    gate_up = torch.randn(3, 8, 6, dtype=F64, requires_grad=True)
    offs = _offs([3, 0, 3])
    index = torch.tensor([6, 0, 0, 3, 9, 2, 5], dtype=torch.int32)
    assert gradgradcheck(lambda a, g: ts_moe.grouped_gemm_swiglu(a, g, offs), (a, gate_up))
    assert gradgradcheck(lambda a, g: ts_moe.grouped_gemm_swiglu(a, g, offs, a_index=index),
                         (a, gate_up))
    if activation is not None:
        assert "backward" in activation.launches  # the stand-in computed dh


def test_swiglu_backward_op_has_exact_derivatives(activation):
    """``ts_moe::swiglu_backward`` itself: first derivatives (gradcheck) and second
    (gradgradcheck: the formula is plain torch, so differentiable again)."""
    dy = torch.randn(5, 4, dtype=F64, requires_grad=True)
    h = torch.randn(5, 8, dtype=F64, requires_grad=True)
    assert gradcheck(torch.ops.ts_moe.swiglu_backward, (dy, h))
    assert gradgradcheck(torch.ops.ts_moe.swiglu_backward, (dy, h))
    torch.library.opcheck(torch.ops.ts_moe.swiglu_backward.default,
                          (dy.detach().float().requires_grad_(), h.detach().float()))


def test_swiglu_double_backward_formula_matches_autograd():
    """ts_moe.reference.swiglu_double_backward against torch's autograd of the
    activation's gradient, in float64 and (rounded once) in bf16."""
    from ts_moe.reference import swiglu_double_backward

    dy = torch.randn(6, 16, dtype=F64, requires_grad=True)
    h = torch.randn(6, 32, dtype=F64, requires_grad=True)
    gate, up = h[:, :16], h[:, 16:]
    dh = torch.cat([dy * up * torch.autograd.grad(F.silu(gate).sum(), gate, create_graph=True)[0],
                    dy * F.silu(gate)], dim=1)
    grad = torch.randn(6, 32, dtype=F64)
    want = torch.autograd.grad(dh, (dy, h), grad)
    got = swiglu_double_backward(grad, dy.detach(), h.detach())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    got16 = swiglu_double_backward(grad.to(BF16), dy.detach().to(BF16), h.detach().to(BF16))
    for g, w in zip(got16, want, strict=True):
        assert g.dtype == BF16 and rel_err(g, w) < 1e-2


# ------------------------------------------------------- bf16 against fp64
def _check_close(got, want, what):
    assert rel_err(got, want) <= 1e-2, what
    for r in range(want.shape[0]):  # per row (per expert for dW)
        if want[r].abs().max() > 0:
            assert rel_err(got[r], want[r]) <= 1e-2, f"{what} row {r}"
        else:
            assert got[r].abs().max() == 0, f"{what} row {r}"


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("layout", ["ekn", "enk"])
def test_bf16_gradients_match_fp64(out_dtype, layout):
    counts, past = [40, 0, 1, 23], 5
    m, k, n = _rows(counts, past), 64, 48
    a = torch.randn(m, k, dtype=BF16, requires_grad=True)
    if layout == "ekn":
        b = torch.randn(4, k, n, dtype=BF16, requires_grad=True)
    else:
        b = torch.randn(4, n, k, dtype=BF16).transpose(-2, -1).requires_grad_()
    offs = _offs(counts)
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))  # the same values
    out = ts_moe.grouped_gemm(a, b, offs, out_dtype)
    grad = torch.randn(out.shape, dtype=F64)
    out.backward(grad.to(out.dtype))
    _dense_grouped(a64, b64, offs).backward(grad.to(BF16).to(F64))
    _check_close(a.grad, a64.grad, "da")
    _check_close(b.grad, b64.grad, "db")


def test_bf16_swiglu_gradients_match_fp64():
    counts = [30, 0, 17, 1]
    m = sum(counts) + 3
    x = torch.randn(40, 32, dtype=BF16, requires_grad=True)
    gate_up = (0.2 * torch.randn(4, 48, 32)).to(BF16).requires_grad_()
    index = torch.randint(0, 40, (m,), dtype=torch.int32)
    offs = _offs(counts)
    x64, g64 = (t.detach().double().requires_grad_() for t in (x, gate_up))  # the same values
    out = ts_moe.grouped_gemm_swiglu(x, gate_up, offs, a_index=index)
    grad = torch.randn(out.shape, dtype=F64)
    out.backward(grad.to(BF16))
    _dense_swiglu(x64[index.long()], g64, offs).backward(grad.to(BF16).to(F64))
    _check_close(x.grad, x64.grad, "dx")
    _check_close(gate_up.grad, g64.grad, "dgate_up")


# ------------------------------------------------------- opcheck, compile
def _opcheck_cases():
    torch.manual_seed(0)
    a = torch.randn(12, 16, dtype=BF16, requires_grad=True)
    b = torch.randn(3, 16, 8, dtype=BF16, requires_grad=True)
    offs = _offs([4, 0, 6])
    index = torch.tensor([1, 1, 5, 0, 11, 3, 2, 7, 8, 9], dtype=torch.int32)
    gate_up = torch.randn(3, 16, 16, dtype=BF16, requires_grad=True)
    k_a = torch.randn(16, 24, dtype=BF16, requires_grad=True)
    k_b = torch.randn(24, 8, dtype=BF16, requires_grad=True)
    return [
        (torch.ops.ts_moe.grouped_gemm.default, (a, b, offs), {}),
        (torch.ops.ts_moe.grouped_gemm.default, (a, b, offs, torch.float32), {}),
        (torch.ops.ts_moe.grouped_gemm.default, (a, b, offs), {"a_index": index}),
        (torch.ops.ts_moe.grouped_gemm.default, (k_a, k_b, offs), {}),
        (torch.ops.ts_moe.grouped_gemm_swiglu.default, (a, gate_up, offs), {}),
        (torch.ops.ts_moe.grouped_gemm_swiglu.default, (a, gate_up, offs), {"a_index": index}),
    ]


@pytest.mark.parametrize("case", range(6))
def test_opcheck_with_requires_grad(case):
    op, args, kwargs = _opcheck_cases()[case]
    torch.library.opcheck(op, args, kwargs)


def test_swiglu_activation_ops():
    """``ts_moe::swiglu`` / ``swiglu_backward`` (the pieces of the SwiGLU op's
    formula): the reference math, opcheck, and named errors."""
    h = torch.randn(10, 32, dtype=BF16)
    dy = torch.randn(10, 16, dtype=BF16)
    h64 = h.double().requires_grad_()
    want = F.silu(h64[:, :16]) * h64[:, 16:]
    assert rel_err(torch.ops.ts_moe.swiglu(h), want) <= 4e-3
    want.backward(dy.double())
    assert rel_err(torch.ops.ts_moe.swiglu_backward(dy, h), h64.grad) <= 4e-3
    torch.library.opcheck(torch.ops.ts_moe.swiglu.default, (h,))
    torch.library.opcheck(torch.ops.ts_moe.swiglu.default, (h.clone().requires_grad_(),))
    assert gradcheck(torch.ops.ts_moe.swiglu, (torch.randn(5, 12, dtype=F64, requires_grad=True),))
    torch.library.opcheck(torch.ops.ts_moe.swiglu_backward.default, (dy, h))
    with pytest.raises(ValueError, match="h must be"):
        torch.ops.ts_moe.swiglu(h[:, :31])
    with pytest.raises(ValueError, match="dy must be"):
        torch.ops.ts_moe.swiglu_backward(dy[:, :8], h)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_backward_matches_eager(backend):
    torch._dynamo.reset()
    x = torch.randn(24, 32, dtype=BF16, requires_grad=True)
    gate_up = (0.2 * torch.randn(3, 32, 32, dtype=BF16)).requires_grad_()
    down = (0.2 * torch.randn(3, 32, 16, dtype=BF16)).requires_grad_()
    offs = _offs([10, 0, 11])
    index = torch.randint(0, 24, (22,), dtype=torch.int32)

    def loss(x, gate_up, down):
        h = ts_moe.grouped_gemm_swiglu(x, gate_up, offs, a_index=index)
        y = ts_moe.grouped_gemm(h, down.transpose(-2, -1), offs)
        return y.float().square().sum()

    want = torch.autograd.grad(loss(x, gate_up, down), (x, gate_up, down))
    fn = torch.compile(loss, backend=backend, fullgraph=True)
    got = torch.autograd.grad(fn(x, gate_up, down), (x, gate_up, down))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_no_grad_wanted_means_no_graph():
    a = torch.randn(8, 16, dtype=BF16, requires_grad=True)
    b = torch.randn(2, 16, 8, dtype=BF16, requires_grad=True)
    offs = _offs([3, 4])
    with torch.no_grad():
        assert not ts_moe.grouped_gemm(a, b, offs).requires_grad
    assert ts_moe.grouped_gemm(a, b, offs).grad_fn is not None
    assert ts_moe.grouped_gemm(a, b.detach(), offs).requires_grad


# ------------------------------------------------------------------ layer
def _plain_layer(x, router, gate_up, down, top_k):
    """The Mixtral block in plain differentiable torch, one expert at a time."""
    weights, experts = ts_moe.route(F.linear(x, router), top_k)
    out = torch.zeros_like(x, dtype=torch.promote_types(x.dtype, torch.float32))
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        token, slot = torch.nonzero(experts == e, as_tuple=True)
        h = x[token].to(out.dtype) @ gate_up[e].to(out.dtype).t()
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ down[e].to(out.dtype).t()
        out = out.index_add(0, token, weights[token, slot, None].to(out.dtype) * y)
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [F64, BF16])
@pytest.mark.parametrize("fused", [True, False])
def test_layer_gradients_match_plain_torch(dtype, fused):
    """bf16: against the plain layer on the same bf16 tensors (same routing),
    its experts in fp32; float64: against the plain layer in float64."""
    torch.manual_seed(1)
    layer = ts_moe.MoE(32, 16, num_experts=4, top_k=2, fused=fused, dtype=dtype)
    plain = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}
    x = torch.randn(2, 9, 32, dtype=dtype, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    grad = torch.randn(2, 9, 32, dtype=dtype)
    layer(x).backward(grad)
    out = _plain_layer(x_plain.view(-1, 32), plain["router"], plain["gate_up_proj"],
                       plain["down_proj"], 2)
    out.view(2, 9, 32).backward(grad)
    tol = 1e-6 if dtype == F64 else 1e-2  # fused=False rounds h to fp32
    assert rel_err(x.grad, x_plain.grad) <= tol
    for name, p in layer.named_parameters():
        assert p.grad is not None, name
        assert rel_err(p.grad, plain[name].grad) <= tol, name
        for e in range(p.shape[0]):  # per expert (router: per expert row)
            assert rel_err(p.grad[e], plain[name].grad[e]) <= max(tol, 2e-2), (name, e)


def test_layer_training_step_compiles_fullgraph():
    torch._dynamo.reset()
    torch.manual_seed(2)
    layer = ts_moe.MoE(32, 16, num_experts=4, top_k=2, dtype=BF16)
    twin = ts_moe.MoE(32, 16, num_experts=4, top_k=2, dtype=BF16)
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(20, 32, dtype=BF16)

    def loss(model, x):
        return model(x).float().square().mean()

    # forward and loss as one graph (no break); backward() runs AOTAutograd's
    # compiled backward graph
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got, want = compiled(layer, x), loss(twin, x)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want)
    for (name, p), q in zip(layer.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name
