"""The op surface's promises on the CPU and under torch.compile: the same result
or the same error on every path, no silently missing gradient, the path each
GPU generation gets, and the sizes F.grouped_mm accepts."""

import pytest
import torch
import torch.nn.functional as F

import ts_moe
from ts_moe.ops import Path, choose_path
from ts_moe.reference import segment_ends

from .helpers import rel_err

BF16 = torch.bfloat16


def _loop(a, b, offs):
    """fp64 per expert: the yardstick."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    start = 0
    for e, end in enumerate(segment_ends(offs, a.shape[0]).tolist()):
        out[start:end] = a[start:end].double() @ b[e].double()
        start = end
    return out


def _offs(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _compiled(fn=None):
    return torch.compile(fn or (lambda a, b, o: ts_moe.grouped_gemm(a, b, o)),
                         backend="aot_eager", fullgraph=True, dynamic=True)


def _outcome(fn, *args):
    """("ok", result) or ("error", type name, argument named first) of ``fn(*args)``.

    Under torch.compile the op's own error reaches the user wrapped by dynamo
    (as any op's does), with symbolic sizes in its text: the original is
    found through the exception chain, and compared by type and argument."""
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - compared, not swallowed
        while type(exc).__module__.startswith("torch._dynamo"):
            exc = exc.__cause__ or exc.__context__
        return ("error", type(exc).__name__, str(exc).split()[0].rstrip(":"))


def _same_everywhere(a, b, offs):
    """Eager CPU and torch.compile agree on the result or on the error."""
    torch._dynamo.reset()
    eager = _outcome(ts_moe.grouped_gemm, a, b, offs)
    compiled = _outcome(_compiled(), a, b, offs)
    assert eager[0] == compiled[0], (eager, compiled)
    if eager[0] == "ok":
        assert eager[1].shape == compiled[1].shape
        assert torch.equal(eager[1], compiled[1])
    else:
        assert eager[1:] == compiled[1:]
    return eager


# ---------------------------------------------------------------- item 8
def test_k_zero_gives_zeros_everywhere():
    a, b, offs = torch.randn(50, 0).to(BF16), torch.randn(3, 0, 24).to(BF16), _offs([10, 20, 15])
    kind, out = _same_everywhere(a, b, offs)
    assert kind == "ok" and out.shape == (50, 24) and (out == 0).all()
    # F.grouped_mm gives zeros too (given 16-byte strides, which it checks even for K = 0)
    ref = F.grouped_mm(torch.randn(50, 8).to(BF16)[:, :0], torch.randn(3, 8, 24).to(BF16)[:, :0],
                       offs=offs)
    assert torch.equal(out[:45], ref[:45])


@pytest.mark.parametrize("m, n", [(0, 24), (50, 0), (0, 0)])
def test_empty_outputs_everywhere(m, n):
    a, b = torch.randn(m, 16).to(BF16), torch.randn(3, 16, n).to(BF16)
    kind, out = _same_everywhere(a, b, _offs([min(m, 5), 0, 0]))
    assert kind == "ok" and out.shape == (m, n)


@pytest.mark.parametrize("make_a", [
    lambda: torch.randn(64, 37).to(BF16).t(),        # M-major, 74-byte leading stride
    lambda: torch.randn(37, 128).to(BF16)[:, ::2],   # no unit stride
], ids=["m_major_unaligned", "strided"])
def test_unreadable_a_rejected_everywhere(make_a):
    a = make_a()
    b = torch.randn(3, a.shape[1], 16).to(BF16)
    kind, *error = _same_everywhere(a, b, _offs([10, 10, 17]))
    assert kind == "error" and error == ["ValueError", "a"]


@pytest.mark.parametrize("case", ["a_one_row_transposed", "a_broadcast_row", "b_broadcast_expert",
                                  "b_one_column_kmajor"])
def test_size_one_and_zero_strides_work_everywhere(case):
    k, n, e = 40, 24, 3
    a = torch.randn(37, k).to(BF16)
    b = torch.randn(e, k, n).to(BF16)
    offs = _offs([10, 10, 17])
    if case == "a_one_row_transposed":
        a, offs = torch.randn(k, 1).to(BF16).t(), _offs([0, 1, 0])  # (1, K), strides (1, 1)
    elif case == "a_broadcast_row":
        a = a[:1].expand(37, k)                                      # stride 0 on M
    elif case == "b_broadcast_expert":
        b = b[0][None].expand(e, k, n)                               # stride 0 on E
    else:
        b = torch.randn(e, 1, k).to(BF16).transpose(1, 2)            # (E, K, 1), K-major
    kind, out = _same_everywhere(a, b, offs)
    assert kind == "ok"
    assert rel_err(out, _loop(a, b, offs)) < 1e-2


# ---------------------------------------------------------------- item 10
def _aligned_buffers(m=64, k=259, n=7, e=4, dtype=BF16, kmajor=False, device="cpu"):
    """PyTorch's own test shapes: K and N odd, rows inside 16-byte aligned buffers
    (made on ``device``: moving a strided view to another device would compact it)."""
    g = torch.Generator().manual_seed(m + k + n)
    a = torch.randn(m, 264, generator=g).to(dtype).to(device)[:, :k]
    if kmajor:
        b = torch.randn(e, n, 264, generator=g).to(dtype).to(device)[:, :, :k].transpose(-2, -1)
    else:
        b = torch.randn(e, k, 16, generator=g).to(dtype).to(device)[:, :, :n]
    return a, b, _offs([13, 0, 30, 15]).to(device)


@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_unaligned_k_and_n_like_grouped_mm(kmajor, dtype):
    a, b, offs = _aligned_buffers(dtype=dtype, kmajor=kmajor)
    kind, out = _same_everywhere(a, b, offs)
    assert kind == "ok" and out.shape == (64, 7) and out.dtype == dtype
    assert out.stride() == (16 // dtype.itemsize * (-(-7 * dtype.itemsize // 16)), 1)
    assert rel_err(out, _loop(a, b, offs)) < (1e-2 if dtype != torch.float32 else 1e-5)
    assert (out[58:] == 0).all()
    ref = F.grouped_mm(a, b, offs=offs)
    assert rel_err(out[:58], ref[:58].double()) < 1e-2


def test_unaligned_sizes_pass_opcheck():
    # test_aot_dispatch_dynamic remakes the inputs contiguous, which turns the
    # aligned 264-element rows into unaligned 259-element ones: left out here
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    a, b, offs = _aligned_buffers()
    torch.library.opcheck(torch.ops.ts_moe.grouped_gemm.default, (a, b, offs), test_utils=tests)
    gate_up = torch.randn(4, 14, 264).to(BF16)[:, :, :259]  # I = 7
    torch.library.opcheck(torch.ops.ts_moe.grouped_gemm_swiglu.default, (a, gate_up, offs),
                          test_utils=tests)
    h = ts_moe.grouped_gemm_swiglu(a, gate_up, offs)
    ref = _loop(a, gate_up.transpose(1, 2), offs)
    assert h.shape == (64, 7)
    assert rel_err(h, F.silu(ref[:, :7]) * ref[:, 7:]) < 1e-2


def test_float32_inputs_served():
    a, b, offs = torch.randn(40, 32), torch.randn(3, 32, 16), _offs([10, 20, 5])
    out = ts_moe.grouped_gemm(a, b, offs)
    assert out.dtype == torch.float32 and rel_err(out, _loop(a, b, offs)) < 1e-5
    with pytest.raises(TypeError, match="out_dtype"):
        ts_moe.grouped_gemm(a, b, offs, out_dtype=BF16)


# ---------------------------------------------------------------- item 7
def test_more_rows_than_int32_rejected_everywhere():
    """2**31 rows (a stride-0 view: no memory) fail on the CPU and in the fake kernel alike."""
    a = torch.randn(1, 8).to(BF16).expand(2**31, 8)
    b = torch.randn(1, 8, 8).to(BF16)
    offs = torch.tensor([2**31 - 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"a has 2147483648 rows"):
        ts_moe.grouped_gemm(a, b, offs)
    meta = [t.to("meta") for t in (a, b, offs)]
    with pytest.raises(ValueError, match=r"a has 2147483648 rows"):
        ts_moe.grouped_gemm(*meta)


# ---------------------------------------------------------------- item 6
def _grad_inputs():
    a = torch.randn(20, 16).to(BF16).requires_grad_()
    b = torch.randn(3, 16, 8).to(BF16).requires_grad_()
    return a, b, _offs([5, 5, 10])


def test_no_grad_and_detached_inputs_need_no_backward():
    a, b, offs = _grad_inputs()
    with torch.no_grad():
        assert not ts_moe.grouped_gemm(a, b, offs).requires_grad
    with torch.inference_mode():
        ts_moe.grouped_gemm(a, b, offs)
    assert not ts_moe.grouped_gemm(a.detach(), b.detach(), offs).requires_grad


# ---------------------------------------------------------------- item 9
@pytest.mark.parametrize("capability, dtype, out_dtype, experts, path", [
    (None, BF16, None, 8, Path.REFERENCE),                         # CPU
    ((9, 0), BF16, None, 8, Path.KERNEL_SM90),                     # H100 / H200
    ((9, 0), torch.float16, torch.float32, 8, Path.KERNEL_SM90),
    ((9, 0), BF16, None, 1024, Path.TORCH_GROUPED_MM),             # past the kernel's 512
    ((9, 0), torch.float32, None, 8, Path.TORCH_GROUPED_MM),
    ((10, 0), BF16, None, 8, Path.TORCH_GROUPED_MM),               # B200: torch's CUTLASS
    ((10, 3), BF16, BF16, 8, Path.TORCH_GROUPED_MM),               # B300
    ((10, 0), BF16, torch.float32, 8, Path.REFERENCE),             # torch would loop + sync
    ((10, 0), torch.float16, None, 8, Path.REFERENCE),
    ((8, 0), BF16, None, 8, Path.REFERENCE),                       # A100
    ((12, 0), BF16, None, 8, Path.REFERENCE),                      # RTX 50xx
    ((8, 9), torch.float32, None, 8, Path.TORCH_GROUPED_MM),
])
def test_path_per_compute_capability(capability, dtype, out_dtype, experts, path):
    assert choose_path(capability, dtype, out_dtype, experts) is path


def test_path_without_kernels_or_torch_grouped_mm():
    assert choose_path((9, 0), BF16, None, 8, kernels_available=False) is Path.TORCH_GROUPED_MM
    assert choose_path((9, 0), torch.float16, None, 8,
                       kernels_available=False) is Path.REFERENCE
    assert choose_path((10, 0), BF16, None, 8, has_torch_grouped_mm=False) is Path.REFERENCE


def test_torch_grouped_mm_path_semantics():
    """The torch path (run here on the CPU build of torch._grouped_mm) zeroes the
    tail and reads bad offs as the kernels do."""
    from ts_moe.ops.torch_backend import grouped_mm

    a, b = torch.randn(30, 16).to(BF16), torch.randn(3, 16, 8).to(BF16)
    for offs in (_offs([4, 10, 6]), torch.tensor([9, 4, 50], dtype=torch.int32)):
        out = grouped_mm(a, b, offs)
        assert rel_err(out, _loop(a, b, offs)) < 1e-2
        end = int(segment_ends(offs, 30)[-1])
        assert (out[end:] == 0).all()


# ------------------------------------------------------- a_index (gather-A)
def _gathered_loop(a, b, offs, a_index):
    """fp64: rows a[a_index], zero where an index is out of range."""
    idx = a_index.long()
    valid = (idx >= 0) & (idx < a.shape[0])
    rows = torch.zeros(idx.shape[0], a.shape[1], dtype=a.dtype)
    rows[valid] = a[idx[valid]]
    return _loop(rows, b, offs)


@pytest.mark.parametrize("case", ["ragged", "duplicates_and_bad", "more_rows", "unaligned_k",
                                  "fp32", "empty"])
def test_a_index_gathers_rows(case):
    g = torch.Generator().manual_seed(3)
    m, k, n, e = 40, 64, 24, 4
    dtype = torch.float32 if case == "fp32" else BF16
    a = torch.randn(m, 72 if case == "unaligned_k" else k, generator=g).to(dtype)
    if case == "unaligned_k":  # a's own strides are free: it is gathered
        a, k = a[:, :67], 67
    b = (torch.randn(e, k, n, generator=g) * k**-0.5).to(dtype)
    rows = {"more_rows": 90, "empty": 0}.get(case, 33)
    a_index = torch.randint(0, m, (rows,), generator=g, dtype=torch.int32)
    if case == "duplicates_and_bad":
        a_index[:6] = torch.tensor([-1, m, 2**31 - 1, -(2**31), 5, 5], dtype=torch.int32)
    offs = _offs([rows // 3, 0, rows // 3, rows - 2 * (rows // 3) - min(rows, 2)])
    out = ts_moe.grouped_gemm(a, b, offs, a_index=a_index)
    assert out.shape == (rows, n)
    ref = _gathered_loop(a, b, offs, a_index)
    if rows:
        assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert (out[int(offs[-1]):] == 0).all()
    if case == "duplicates_and_bad":
        assert (out[:4] == 0).all() and torch.equal(out[4], out[5])
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, o, i: ts_moe.grouped_gemm(a, b, o, a_index=i),
                             backend="aot_eager", fullgraph=True, dynamic=True)
    assert torch.equal(compiled(a, b, offs, a_index), out)


def test_a_index_swiglu_and_opcheck():
    a, b, offs = torch.randn(30, 64).to(BF16), None, _offs([10, 0, 15])
    gate_up = (torch.randn(3, 32, 64) * 0.125).to(BF16)
    a_index = torch.randint(-2, 32, (25,), dtype=torch.int32)
    h = ts_moe.grouped_gemm_swiglu(a, gate_up, offs, a_index=a_index)
    ref = _gathered_loop(a, gate_up.transpose(1, 2), offs, a_index)
    assert h.shape == (25, 16)
    assert rel_err(h, F.silu(ref[:, :16]) * ref[:, 16:]) < 1e-2
    b = (torch.randn(3, 64, 16) * 0.125).to(BF16)
    torch.library.opcheck(torch.ops.ts_moe.grouped_gemm.default, (a, b, offs),
                          {"a_index": a_index})
    torch.library.opcheck(torch.ops.ts_moe.grouped_gemm_swiglu.default, (a, gate_up, offs),
                          {"a_index": a_index})


@pytest.mark.parametrize("bad, exc, msg", [
    (lambda i: i.long(), TypeError, "a_index must be int32"),
    (lambda i: i[None], ValueError, "a_index must be 1-D"),
    (lambda i: i.to("meta"), ValueError, "a_index must be on a's device"),
    (lambda i: "rows", TypeError, "a_index must be a torch.Tensor"),
])
def test_a_index_validated(bad, exc, msg):
    a, b, offs = torch.randn(30, 64).to(BF16), torch.randn(3, 64, 16).to(BF16), _offs([10, 0, 5])
    a_index = torch.arange(15, dtype=torch.int32)
    with pytest.raises(exc, match=msg):
        ts_moe.grouped_gemm(a, b, offs, a_index=bad(a_index))
    meta = [t.to("meta") for t in (a, b, offs)]
    if not isinstance(bad(a_index), str) and bad(a_index).device.type != "meta":
        with pytest.raises(exc, match=msg):  # the fake kernel names it alike
            ts_moe.grouped_gemm(*meta, a_index=bad(a_index).to("meta"))


def test_sort_slots_is_permutes_order():
    experts = torch.tensor([[2, 0], [1, 2], [0, 3], [2, 1]])
    slots = ts_moe.sort_slots(experts, 4)
    x = torch.randn(4, 8)
    dispatch = ts_moe.permute(x, experts, 4)
    assert slots.token_index.dtype == torch.int32
    assert torch.equal(x[slots.token_index.long()], dispatch.x_sorted)
    assert torch.equal(slots.offs, dispatch.offs) and torch.equal(slots.inverse, dispatch.inverse)
    assert slots.token_index.tolist() == [0, 2, 1, 3, 0, 1, 3, 2]


# ------------------------------------------------- sm_100 kernel: opt-in only
def test_sm100_kernel_only_on_opt_in():
    for cap in ((10, 0),):
        assert choose_path(cap, BF16, None, 8) is Path.TORCH_GROUPED_MM
        assert choose_path(cap, BF16, None, 8, opted_in=True) is Path.KERNEL_SM100
        assert choose_path(cap, torch.float16, torch.float32, 8,
                           opted_in=True) is Path.KERNEL_SM100
    assert choose_path((10, 0), torch.float32, None, 8, opted_in=True) is \
        Path.TORCH_GROUPED_MM
    assert choose_path((10, 3), BF16, None, 8, opted_in=True) is Path.TORCH_GROUPED_MM
    assert choose_path((10, 0), BF16, None, 1024, opted_in=True) is Path.TORCH_GROUPED_MM


class _Recording:
    """Stands in for an arch's kernel backend on the CPU: the real backend's
    ``choose_config`` (pure Python), and a ``run`` that records its call and
    writes 7s."""

    def __init__(self, real):
        self.real, self.gathers, self.calls = real, real.gathers, []

    def choose_config(self, *args):
        return self.real.choose_config(*args)

    def run(self, a, b, offs, out, config, *, a_index=None, prefetch_weights=False):
        self.calls.append(dict(a=a, b=b, offs=offs, out=out, config=config, a_index=a_index,
                               prefetch_weights=prefetch_weights))
        return out.fill_(7)


def test_use_sm100_kernel_switches_the_path():
    from ts_moe.ops import Op, paths

    first = lambda op: paths.paths_for(op, (10, 0), BF16)[0]  # noqa: E731
    try:
        assert first(Op.GROUPED_GEMM) is Path.TORCH_GROUPED_MM
        ts_moe.use_sm100_kernel()
        assert first(Op.GROUPED_GEMM) is Path.KERNEL_SM100
        assert first(Op.GROUPED_GEMM_SWIGLU) is Path.KERNEL_SM100
        kernel = paths.TABLE[Path.KERNEL_SM100]
        assert kernel[Op.GROUPED_GEMM].gathers
        assert Op.GROUPED_GEMM_K not in kernel  # no k-grouped sm_100 kernel
        assert first(Op.GROUPED_GEMM_K) is Path.TORCH_GROUPED_MM
        ts_moe.use_sm100_kernel(False)
        assert first(Op.GROUPED_GEMM) is Path.TORCH_GROUPED_MM
    finally:
        ts_moe.use_sm100_kernel(False)


@pytest.fixture
def sm100_stand_ins(monkeypatch):
    """The sm_100 path's backends recording on the CPU, the kernel opted in; a declined
    call takes what a B200 without the kernels takes (torch's grouped_mm in bf16, else
    the reference).  Yields the capability the ops' runs take."""
    from ts_moe.ops import Op, paths

    table = paths.TABLE[Path.KERNEL_SM100]
    gemm = _Recording(table[Op.GROUPED_GEMM])
    swiglu = _Recording(table[Op.GROUPED_GEMM_SWIGLU])
    monkeypatch.setitem(table, Op.GROUPED_GEMM, gemm)
    monkeypatch.setitem(table, Op.GROUPED_GEMM_SWIGLU, swiglu)
    with ts_moe.settings.override(sm100_kernel=True):
        yield (10, 0), gemm, swiglu


def test_sm100_path_passes_the_gather_to_the_kernel(sm100_stand_ins):
    from ts_moe.ops import gemm, swiglu

    capability, gemm_kernel, swiglu_kernel = sm100_stand_ins
    a, b, offs = torch.randn(40, 64).to(BF16), torch.randn(3, 64, 24).to(BF16), _offs([9, 0, 20])
    a_index = torch.randint(0, 40, (33,), dtype=torch.int32)
    out = gemm.run(capability, a, b, offs, None, a_index)
    (call,) = gemm_kernel.calls
    assert call["a_index"] is a_index and call["out"].shape == (33, 24)
    assert call["config"].name == "n128" and (out == 7).all()
    gate_up = torch.randn(3, 256, 64).to(BF16)  # I = 128: the fused kernel's tiles fit
    h = swiglu.run(capability, a, gate_up, offs, a_index)
    (call,) = swiglu_kernel.calls
    assert call["b"].shape == (3, 256, 64) and call["b"].stride(2) == 1
    assert call["a_index"] is a_index and h.shape == (33, 128) and (h == 7).all()


def test_sm100_path_runs_what_its_kernel_declines_elsewhere(sm100_stand_ins):
    """K not whole 16-byte chunks, I off the fused tile, fp16 (which torch's
    grouped_mm does not take): the same results, without the kernel."""
    from ts_moe.ops import gemm, swiglu

    capability, gemm_kernel, swiglu_kernel = sm100_stand_ins
    offs = _offs([9, 0, 20])
    a_index = torch.randint(0, 40, (33,), dtype=torch.int32)
    odd_k, b60 = torch.randn(40, 72).to(BF16)[:, :60], torch.randn(3, 60, 24).to(BF16)
    got = gemm.run(capability, odd_k, b60, offs, None, a_index)
    assert rel_err(got, _gathered_loop(odd_k, b60, offs, a_index)) < 1e-2
    half = gemm.run(capability, odd_k.half(), b60.half(), offs, None, a_index)
    assert rel_err(half, _gathered_loop(odd_k, b60, offs, a_index)) < 1e-2
    assert gemm_kernel.calls == []
    a = torch.randn(40, 64).to(BF16)
    small_i = torch.randn(3, 96, 64).to(BF16)  # I = 48: the GEMM to fp32, then the activation
    h = swiglu.run(capability, a, small_i, offs, a_index)
    assert swiglu_kernel.calls == []
    (call,) = gemm_kernel.calls  # the GEMM to h took the (recording) sm_100 kernel
    assert call["out"].dtype == torch.float32 and call["a_index"] is a_index
    assert h.shape == (33, 48) and (h == (F.silu(torch.tensor(7.0)) * 7).to(BF16)).all()
