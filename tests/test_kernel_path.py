"""The sm_90 kernel path's plumbing on the CPU: the ops' CUDA kernels
(ts_moe.ops.gemm._cuda, swiglu._cuda, the routing ops) run with the sm_90
backends of csrc_free_kernels' launch modules, their choose_config and run as
they are, only the compiled kernels replaced by stand-ins that check the
layout they are handed and compute the references into the outputs.  What
this pins: which backend and configuration each call takes, that each kernel
is launched once with the views its compiled signature wants, the gather and
weight-prefetch handoff, and the fallbacks.  The kernels themselves: the
``gpu`` tests."""

import pytest
import torch
import torch.nn.functional as F

from ts_moe import reference
from ts_moe.ops import gemm, paths, swiglu
from ts_moe.reference import grouped_gemm_k_reference, grouped_gemm_reference

from .helpers import fake_route_kernel, rel_err

BF16 = torch.bfloat16


def _aligned(t: torch.Tensor) -> bool:
    elems = 16 // t.element_size()
    return (t.stride(-1) == 1 or t.stride(-2) == 1) and all(
        s % elems == 0 for s, n in zip(t.stride(), t.shape) if s != 1)


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The sm_90 path for CPU tensors, compiled kernels replaced; yields the launches."""
    from csrc_free_kernels.hopper import grouped_gemm_dw_sm90_launch, grouped_gemm_sm90_launch, swiglu_sm90_launch
    from csrc_free_kernels.routing import route_sm90_launch
    from csrc_free_kernels.hopper.grouped_gemm_sm90 import GroupedGemmSwigluSm90

    launches = []

    def gemm_launch(a, b, offs, out, config, kernel_cls, prefetch_weights):
        assert a.stride(1) == 1 and _aligned(a) and _aligned(b) and _aligned(out)
        fused = kernel_cls is GroupedGemmSwigluSm90
        launches.append(("swiglu" if fused else "gemm", config.name, prefetch_weights))
        h = grouped_gemm_reference(a, b, offs, torch.float32)
        return out.copy_(reference.swiglu(h, out.dtype) if fused else h)

    def dw_launch(a, dy, offs, out, config):
        assert a.stride(1) == 1 and dy.stride(1) == 1 and _aligned(out)
        launches.append(("gemm_k", config.name))
        return out.copy_(grouped_gemm_k_reference(a.t(), dy, offs, out.dtype))

    def rowsum_kernel(weighted, dtype, index_dtype):
        def launch(src, index, weights, out):
            launches.append(("combine" if weighted else "gather",))
            out.copy_(reference.combine(src, weights, index) if weighted
                      else reference.gather_rows(src, index))
        return launch

    def activation_kernel(dtype, backward):
        def launch(h, out, dy):
            launches.append(("swiglu_backward" if backward else "swiglu_forward",))
            out.copy_(reference.swiglu_backward(dy, h, h.dtype) if backward
                      else reference.swiglu(h.float(), h.dtype))
        return launch

    monkeypatch.setattr(grouped_gemm_sm90_launch, "launch", gemm_launch)
    monkeypatch.setattr(grouped_gemm_dw_sm90_launch, "_launch", dw_launch)
    monkeypatch.setattr(route_sm90_launch, "_rowsum_kernel", rowsum_kernel)
    monkeypatch.setattr(route_sm90_launch, "_route_kernel", fake_route_kernel(launches))
    monkeypatch.setattr(swiglu_sm90_launch, "compiled_kernel", activation_kernel)
    # CPU tensors take an H200's paths: the kernels, then torch's grouped_mm in bf16
    monkeypatch.setattr(paths, "device_capability", lambda t: (9, 0))
    return launches


def _offs(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _problem(m=40, k=64, n=48, e=4):
    g = torch.Generator().manual_seed(m * k + n)
    a = torch.randn(m, k, generator=g).to(BF16)
    b = (torch.randn(e, k, n, generator=g) * k**-0.5).to(BF16)
    return a, b, _offs([9, 0, 20, 8])


def test_hot_path_launches_the_kernel_once_with_its_config(kernels_on_cpu):
    from csrc_free_kernels.hopper.grouped_gemm_sm90_config import choose_config

    a, b, offs = _problem()
    out = gemm._cuda(a, b, offs)
    assert kernels_on_cpu == [("gemm", choose_config(4, 48, 64, 40).name, False)]
    assert rel_err(out, grouped_gemm_reference(a, b, offs, torch.float32)) < 1e-2
    assert out.stride() == (48, 1)
    kernels_on_cpu.clear()
    gemm._cuda(a, b, offs, prefetch_weights=True)
    assert kernels_on_cpu[0][2] is True


def test_other_layouts_are_checked_and_restrided_before_the_one_launch(kernels_on_cpu):
    a, b, offs = _problem()
    m_major = a.t().contiguous().t()
    out = gemm._cuda(m_major, b.transpose(1, 2).contiguous().transpose(1, 2), offs,
                     torch.float32)
    assert [launch[0] for launch in kernels_on_cpu] == ["gemm"]
    assert out.dtype == torch.float32
    assert rel_err(out, grouped_gemm_reference(a, b, offs, torch.float32)) < 1e-2
    with pytest.raises(ValueError, match="K mismatch"):
        gemm._cuda(a[:, :56], b, offs)
    with pytest.raises(ValueError, match="a needs one of its last two dims"):
        gemm._cuda(torch.randn(40, 128).to(BF16)[:, ::2], b, offs)
    assert len(kernels_on_cpu) == 1  # nothing launched for a bad call


def test_a_index_gathers_on_the_row_kernel_then_prefetches(kernels_on_cpu):
    a, b, offs = _problem()
    index = torch.tensor([3, -1, 39, 40, 7] * 8, dtype=torch.int32)[:37]
    out = gemm._cuda(a, b, offs, a_index=index)
    assert [launch[0] for launch in kernels_on_cpu] == ["gather", "gemm"]
    assert kernels_on_cpu[1][2] is True  # the gather is the kernel ahead
    rows = reference.gather_rows(a, index)
    assert rel_err(out, grouped_gemm_reference(rows, b, offs, torch.float32)) < 1e-2


def test_k_grouped_form_on_its_kernel_and_past_it(kernels_on_cpu):
    x, dy, offs = torch.randn(40, 64).to(BF16), torch.randn(40, 32).to(BF16), _offs([9, 0, 20, 8])
    out = gemm._cuda(x.t(), dy, offs)
    assert [launch[0] for launch in kernels_on_cpu] == ["gemm_k"]
    assert rel_err(out, grouped_gemm_k_reference(x.t(), dy, offs, torch.float32)) < 1e-2
    kernels_on_cpu.clear()
    odd = torch.randn(40, 64).to(BF16)[:, :60]  # K = 60: the kernel declines; torch runs it
    got = gemm._cuda(odd.t(), dy, offs)
    assert kernels_on_cpu == []
    assert rel_err(got, grouped_gemm_k_reference(odd.t(), dy, offs, torch.float32)) < 1e-2


@pytest.mark.parametrize("inter, fused", [(64, True), (48, False)])
def test_swiglu_fused_where_the_tiles_fit_else_gemm_and_activation(kernels_on_cpu, inter, fused):
    from csrc_free_kernels.hopper.grouped_gemm_sm90_config import swiglu_config

    a, _, offs = _problem()
    gate_up = (torch.randn(4, 2 * inter, 64) * 0.125).to(BF16)
    index = torch.randint(0, 40, (37,), dtype=torch.int32)
    for a_index in (None, index):
        kernels_on_cpu.clear()
        h = swiglu._cuda(a, gate_up, offs, a_index=a_index)
        rows = a if a_index is None else reference.gather_rows(a, a_index)
        ref = grouped_gemm_reference(rows, gate_up.transpose(1, 2), offs, torch.float32)
        assert rel_err(h, F.silu(ref[:, :inter]) * ref[:, inter:]) < 1e-2
        names = [launch[0] for launch in kernels_on_cpu]
        gathered = ["gather"] if a_index is not None else []
        assert names == gathered + (["swiglu"] if fused else ["gemm"])
        assert bool(swiglu_config(4, 2 * inter, 64, h.shape[0])) is fused
        assert kernels_on_cpu[-1][2] is (a_index is not None)  # prefetch after the gather


def test_n_major_swiglu_weights_take_tiles_the_kernel_builds(kernels_on_cpu):
    """A decode-shaped SwiGLU whose 64-column tiles fill the SMs better: K-major gate/up
    takes them, N-major (a unit stride on 2I) the 128-column decode tiles, whose gate
    and up parts are whole swizzle atoms; either way the launch is a reachable build."""
    from csrc_free_kernels.hopper import grouped_gemm_sm90_launch as launch

    reachable = {(b.spec["config"].name, b.spec["b_n_major"]) for b in launch.builds()
                 if b.spec["swiglu"]}
    a = torch.randn(4, 64).to(BF16)
    offs = _offs([1, 1, 1, 1])
    k_major = (torch.randn(4, 512, 64) * 0.125).to(BF16)
    n_major = k_major.transpose(1, 2).contiguous().transpose(1, 2)
    for gate_up, n_major_weights, tiles in ((k_major, False, "decode16_n64"),
                                            (n_major, True, "decode16")):
        kernels_on_cpu.clear()
        h = swiglu._cuda(a, gate_up, offs)
        assert kernels_on_cpu == [("swiglu", tiles, False)]
        assert (tiles, n_major_weights) in reachable
        ref = grouped_gemm_reference(a, gate_up.transpose(1, 2), offs, torch.float32)
        assert rel_err(h, F.silu(ref[:, :256]) * ref[:, 256:]) < 1e-2
    assert ("decode16_n64", True) not in reachable


def test_routing_ops_and_activation_take_their_kernels(kernels_on_cpu):
    import ts_moe

    logits = torch.randn(6, 8)
    w, ex, slots = ts_moe.route_slots(logits, 2)
    ts_moe.sort_slots(ex, 8)
    y = torch.randn(12, 16).to(BF16)
    out = ts_moe.combine(y, w, slots.inverse)
    h = torch.randn(5, 32).to(BF16)
    act = torch.ops.ts_moe.swiglu(h)
    dh = torch.ops.ts_moe.swiglu_backward(torch.randn(5, 16).to(BF16), h)
    assert [launch[0] for launch in kernels_on_cpu] == [
        "route_slots", "sort_slots", "combine", "swiglu_forward", "swiglu_backward"]
    assert torch.equal(out, reference.combine(y, w, slots.inverse))
    assert torch.equal(act, reference.swiglu(h.float(), BF16)) and dh.shape == (5, 32)
    kernels_on_cpu.clear()
    torch.ops.ts_moe.swiglu(torch.randn(5, 24).to(BF16))  # I = 12: the reference
    assert kernels_on_cpu == []


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_renormalize_on_the_kernel_path(kernels_on_cpu, renormalize):
    """Without renormalising, the sm_90 path keeps its one routing launch (experts and
    slot order) and gives the reference's weights, bit for bit."""
    import ts_moe

    logits = torch.randn(6, 8).to(BF16)
    w, ex, slots = ts_moe.route_slots(logits, 2, renormalize=renormalize)
    want_w, want_ex = reference.route(logits, 2, renormalize)
    assert [launch[0] for launch in kernels_on_cpu] == ["route_slots"]
    assert torch.equal(w, want_w) and torch.equal(ex, want_ex)
    assert torch.equal(slots.inverse, reference.sort_slots(want_ex, 8).inverse)
    sums = w.sum(-1)
    assert torch.allclose(sums, torch.ones(6)) is renormalize


def test_a_refused_build_declines_its_backend_and_the_next_takes_the_call(kernels_on_cpu,
                                                                          monkeypatch):
    """A kernel build the pre-flight refuses raises before its launch: the fused SwiGLU
    kernel's sends the call to the same path's GEMM to fp32 and the activation; every
    GEMM build's, to torch's grouped_mm (bf16); the activation kernel's, to the
    reference.  The results are the next backend's, nothing of the refused one ran."""
    from csrc_free_kernels.common.refusals import PreflightError, Refusal
    from csrc_free_kernels.hopper import grouped_gemm_sm90_launch, swiglu_sm90_launch
    from csrc_free_kernels.hopper.grouped_gemm_sm90 import GroupedGemmSwigluSm90

    def refused(*args):
        raise PreflightError(Refusal("planted", ("setmaxnreg",), "a test's"))

    stand_in = grouped_gemm_sm90_launch.launch

    def fused_refused(a, b, offs, out, config, kernel_cls, prefetch_weights):
        if kernel_cls is GroupedGemmSwigluSm90:
            refused()
        return stand_in(a, b, offs, out, config, kernel_cls, prefetch_weights)

    monkeypatch.setattr(grouped_gemm_sm90_launch, "launch", fused_refused)
    a, b, offs = _problem()
    gate_up = (torch.randn(4, 2 * 64, 64) * 0.125).to(BF16)  # I = 64: the fused kernel's
    h = swiglu._cuda(a, gate_up, offs)
    assert [launch[0] for launch in kernels_on_cpu] == ["gemm"]
    ref = grouped_gemm_reference(a, gate_up.transpose(1, 2), offs, torch.float32)
    assert rel_err(h, F.silu(ref[:, :64]) * ref[:, 64:]) < 1e-2
    monkeypatch.setattr(grouped_gemm_sm90_launch, "launch", refused)
    kernels_on_cpu.clear()
    out = gemm._cuda(a, b, offs)
    assert kernels_on_cpu == []
    from ts_moe.ops import torch_backend

    want = torch_backend.GROUPED_GEMM.run(a, b, offs, torch.empty_like(out), torch_backend.CONFIG)
    assert torch.equal(out, want)
    monkeypatch.setattr(swiglu_sm90_launch, "compiled_kernel", refused)
    act = torch.ops.ts_moe.swiglu(h)
    assert kernels_on_cpu == [] and torch.equal(act, reference.swiglu(h.float(), BF16))
