"""The elementwise SwiGLU kernels (csrc_free_kernels/hopper/swiglu_sm90.py) against fp32
references on an sm_90 GPU.

``python -m tests.test_swiglu_elementwise_gpu`` prints the bandwidth of both
kernels at M=32768, I=14336."""

import pytest
import torch

from bench.timing import measure

from .helpers import rel_err, swiglu_grad_ref, swiglu_ref

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}


def sw():
    from . import kernel_calls
    return kernel_calls


def make(m, inter, dtype=torch.bfloat16, scale=1.0, pad=0, seed=0):
    """h (M, 2I) and dy (M, I), views of wider tensors when ``pad`` (extra
    columns a row, a multiple of 16: the views start ``pad // 2`` columns in,
    on a 16-byte boundary), and NaN-poisoned outputs out (M, I) and
    dh (M, 2I), padded alike (their padding must stay NaN)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(cols):
        full = torch.randn(m, cols + pad, device="cuda", generator=g) * scale
        return full.to(dtype)[:, pad // 2: pad // 2 + cols] if pad else full.to(dtype)

    def poisoned(cols):
        full = torch.full((m, cols + pad), float("nan"), device="cuda", dtype=dtype)
        return full[:, pad // 2: pad // 2 + cols] if pad else full

    return rand(2 * inter), rand(inter), poisoned(inter), poisoned(2 * inter)


def check_rows(out, ref, tol):
    """Relative error overall and of each row (rows of zeros compare absolutely)."""
    assert rel_err(out, ref) <= tol, rel_err(out, ref)
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    per_row = (out - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-6)
    worst = per_row.max().item() if len(per_row) else 0.0
    assert worst <= 2 * tol, (worst, per_row.argmax().item())


def run_both(h, dy, out, dh):
    s = sw()
    assert s.swiglu_forward(h, out) is out
    assert s.swiglu_backward(dy, h, dh) is dh


# every (M, I) in bf16; fp16 up to 4096 x 1536 (its largest size adds nothing)
SIZES = [(m, inter) for m in (1, 7, 4096) for inter in (8, 24, 1536, 14336)]
CASES = [(m, inter, dtype) for m, inter in SIZES for dtype in (torch.bfloat16, torch.float16)
         if dtype == torch.bfloat16 or m * inter <= 4096 * 1536]


@pytest.mark.parametrize("m, inter, dtype", CASES)
def test_matches_reference(m, inter, dtype):
    h, dy, out, dh = make(m, inter, dtype)
    run_both(h, dy, out, dh)
    torch.cuda.synchronize()
    check_rows(out, swiglu_ref(h), TOL[dtype])
    check_rows(dh, swiglu_grad_ref(dy, h), TOL[dtype])


@pytest.mark.parametrize("pad", [16, 48, 144])
@pytest.mark.parametrize("m, inter", [(7, 24), (300, 1536), (33, 14336)])
def test_padded_row_strides(m, inter, pad):
    """Views of wider tensors (row strides of 2I + pad and I + pad elements);
    the padding of the outputs is never written."""
    h, dy, out, dh = make(m, inter, pad=pad)
    assert not h.is_contiguous() and not out.is_contiguous()
    run_both(h, dy, out, dh)
    torch.cuda.synchronize()
    check_rows(out, swiglu_ref(h), TOL[h.dtype])
    check_rows(dh, swiglu_grad_ref(dy, h), TOL[h.dtype])
    for t in (out, dh):  # the columns beside the view
        full = torch.as_strided(t, (m, t.stride(0)), (t.stride(0), 1),
                                t.storage_offset() - pad // 2)
        assert full[:, :pad // 2].isnan().all() and full[:, pad // 2 + t.shape[1]:].isnan().all()


def test_misaligned_rows_are_declined_and_the_op_takes_the_reference():
    h, dy, out, dh = make(4, 24, pad=8)  # views 4 columns (8 bytes) in
    declined = sw().backend(sw().Op.SWIGLU_ACTIVATION).choose_config(h, None)
    assert not declined and "16-byte" in declined.reason
    check_rows(torch.ops.ts_moe.swiglu(h), swiglu_ref(h), TOL[h.dtype])


def test_rows_of_a_larger_tensor():
    """h, out and dh as column slices: gate and up of a (M, 4I) tensor's middle."""
    m, inter = 129, 256
    big = torch.randn(m, 4 * inter, device="cuda").to(torch.bfloat16)
    h = big[:, inter:3 * inter]
    dy = torch.randn(m, inter, device="cuda").to(torch.bfloat16)
    out = torch.full((m, 3 * inter), float("nan"), device="cuda", dtype=torch.bfloat16)[:, inter:2 * inter]
    dh = torch.empty(m, 2 * inter, device="cuda", dtype=torch.bfloat16)
    run_both(h, dy, out, dh)
    torch.cuda.synchronize()
    check_rows(out, swiglu_ref(h), 1e-2)
    check_rows(dh, swiglu_grad_ref(dy, h), 1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_values_saturate(dtype):
    """|g| up to 20 (sigmoid 0 or 1 in fp32, e^-g up to 5e8): no NaN or inf,
    and the saturated limits (silu(g) = g for g >> 0, 0 for g << 0)."""
    m, inter = 64, 1536
    h, dy, out, dh = make(m, inter, dtype, scale=8.0)
    h[:, :inter].clamp_(-20, 20)
    h[0, :inter] = 20.0
    h[1, :inter] = -20.0
    if dtype == torch.float16:  # keep the products inside fp16's range
        h[:, inter:].clamp_(-60, 60)
    run_both(h, dy, out, dh)
    torch.cuda.synchronize()
    # against the references rounded to the output dtype: at g = -20 the results
    # are ~1e-6, subnormal in fp16, where one rounding alone costs a few percent
    check_rows(out, swiglu_ref(h).to(dtype), TOL[dtype])
    check_rows(dh, swiglu_grad_ref(dy, h).to(dtype), TOL[dtype])
    u = h[0, inter:].float()
    torch.testing.assert_close(out[0].float(), (20.0 * u).to(dtype).float(), rtol=1e-2, atol=1e-2)
    assert (out[1].float().abs() <= 1e-6 * u.abs().max() * 20 + 1e-6).all()


def test_extreme_gate_no_nan():
    """g = -100 (e^-g overflows fp32 to inf) and g = +100: finite results."""
    m, inter = 4, 64
    h, dy, out, dh = make(m, inter)
    h[:2, :inter] = -100.0
    h[2:, :inter] = 100.0
    run_both(h, dy, out, dh)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(dh).all()
    assert (out[:2] == 0).all() and (dh[:2] == 0).all()
    check_rows(out[2:], swiglu_ref(h[2:]), 1e-2)


def test_empty_rows_launch_nothing():
    s = sw()
    for inter in (8, 1536):
        h, dy, out, dh = make(0, inter)
        assert s.swiglu_forward(h, out) is out and s.swiglu_backward(dy, h, dh) is dh
    torch.cuda.synchronize()


def test_runs_on_current_stream():
    """The kernels queue behind the current stream's work: h and dy are
    written there after a sleep, then read by the kernels."""
    h, dy, out, dh = make(2048, 1536)
    h2, dy2, _, _ = make(2048, 1536, seed=1)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        h.copy_(h2)
        dy.copy_(dy2)
        run_both(h, dy, out, dh)
    side.synchronize()
    check_rows(out, swiglu_ref(h2), 1e-2)
    check_rows(dh, swiglu_grad_ref(dy2, h2), 1e-2)


@pytest.mark.parametrize("m, inter", [(7, 24), (4096, 1536), (1, 14336)])
def test_cuda_graph_capture(m, inter):
    """Captured once, replayed on new inputs written into the same buffers."""
    h, dy, out, dh = make(m, inter)
    run_both(h, dy, out, dh)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_both(h, dy, out, dh)
    h2, dy2, _, _ = make(m, inter, seed=1)
    h.copy_(h2)
    dy.copy_(dy2)
    out.fill_(float("nan"))
    dh.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_rows(out, swiglu_ref(h2), 1e-2)
    check_rows(dh, swiglu_grad_ref(dy2, h2), 1e-2)


def bench(m=32768, inter=14336, reps=20, dtype=torch.bfloat16):
    """Median time and bandwidth of each kernel: GB/s of bytes read plus written."""
    s = sw()
    h = torch.randn(m, 2 * inter, device="cuda").to(dtype)
    dy = torch.randn(m, inter, device="cuda").to(dtype)
    out = torch.empty(m, inter, device="cuda", dtype=dtype)
    dh = torch.empty(m, 2 * inter, device="cuda", dtype=dtype)
    e = h.element_size()
    results = {}
    for name, fn, nbytes in [
            ("forward", lambda: s.swiglu_forward(h, out), 3 * m * inter * e),
            ("backward", lambda: s.swiglu_backward(dy, h, dh), 5 * m * inter * e),
            ("torch copy (h -> dh)", lambda: dh.copy_(h), 4 * m * inter * e)]:
        ms = measure([fn], torch.device("cuda"), min_iters=reps, max_iters=reps).ms
        results[name] = (ms, nbytes / ms / 1e6)
        print(f"{name:22s} M={m} I={inter}: {ms:.3f} ms, {nbytes / ms / 1e6:7.0f} GB/s")
    return results


def test_bandwidth_smoke():
    """A smaller timing run (the full one: ``python -m tests.test_swiglu_elementwise_gpu``)."""
    results = bench(m=8192, inter=14336, reps=5)
    for name in ("forward", "backward"):
        assert results[name][1] > 1000, results


if __name__ == "__main__":
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)):
        raise SystemExit("needs an sm_90 CUDA GPU")
    bench()
