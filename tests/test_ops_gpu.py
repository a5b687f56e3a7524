"""The op surface on the H200: the same results and errors as on the CPU, no
silently missing gradient, rows up to the int32 limit, and the sizes and dtypes
F.grouped_mm accepts (odd K and N in aligned buffers, float32)."""

import pytest
import torch
import torch.nn.functional as F

import ts_moe
from ts_moe.ops import Op, Path, paths

from .helpers import rel_err
from .test_ops_semantics import _aligned_buffers, _loop, _offs, _outcome

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _per_row_rel_err(out, ref) -> float:
    """The largest ||out[r] - ref[r]|| / ||ref[r]|| over the rows whose reference is not zero."""
    out, ref = out.double(), ref.double()
    num = (out - ref).norm(dim=1)
    den = ref.norm(dim=1)
    live = den > 0
    assert (num[~live] == 0).all(), "rows that must be zero are not"
    return (num[live] / den[live]).max().item() if live.any() else 0.0


def _same_on_cpu_and_cuda(make, out_dtype=None):
    """CUDA eager gives the CPU's result (to bf16 rounding) or the CPU's error, on the
    same values and strides (``make(device)`` builds the arguments on that device)."""
    torch.manual_seed(0)
    a, b, offs = make("cpu")
    cpu = _outcome(ts_moe.grouped_gemm, a, b, offs, out_dtype)
    torch.manual_seed(0)
    ga, gb, goffs = make("cuda")
    assert ga.stride() == a.stride() and gb.stride() == b.stride()
    cuda = _outcome(ts_moe.grouped_gemm, ga, gb, goffs, out_dtype)
    assert cpu[0] == cuda[0], (cpu, cuda)
    if cpu[0] == "error":
        assert cpu[1:] == cuda[1:]
        return cuda
    got = cuda[1]
    assert got.shape == cpu[1].shape and got.dtype == cpu[1].dtype
    assert got.stride() == cpu[1].stride()  # rows padded to 16 bytes on every path
    if a.numel() and b.numel():
        ref = _loop(a, b, offs)
        assert rel_err(got.cpu(), ref) < 1e-2
        assert _per_row_rel_err(got.cpu(), ref) < 2e-2
    else:
        assert (got == 0).all()
    return cuda


def _bf16(*shape):
    return torch.randn(*shape).to(BF16)


CASES = {  # device -> (a, b, offs), the views taken on the device
    "k_zero": lambda d: (_bf16(50, 8).to(d)[:, :0], _bf16(3, 8, 24).to(d)[:, :0],
                         _offs([10, 20, 15]).to(d)),
    "n_zero": lambda d: (_bf16(50, 16).to(d), _bf16(3, 16, 0).to(d), _offs([10, 20, 15]).to(d)),
    "m_zero": lambda d: (_bf16(0, 16).to(d), _bf16(3, 16, 24).to(d), _offs([0, 0, 0]).to(d)),
    "m_major_unaligned": lambda d: (_bf16(64, 37).to(d).t(), _bf16(3, 64, 16).to(d),
                                    _offs([10, 10, 17]).to(d)),
    "m_major_aligned": lambda d: (_bf16(64, 40).to(d).t(), _bf16(3, 64, 16).to(d),
                                  _offs([10, 10, 17]).to(d)),
    "strided_a": lambda d: (_bf16(37, 128).to(d)[:, ::2], _bf16(3, 64, 16).to(d),
                            _offs([10, 10, 17]).to(d)),
    "a_one_row_transposed": lambda d: (_bf16(40, 1).to(d).t(), _bf16(3, 40, 24).to(d),
                                       _offs([0, 1, 0]).to(d)),
    "a_broadcast_row": lambda d: (_bf16(1, 40).to(d).expand(37, 40), _bf16(3, 40, 24).to(d),
                                  _offs([10, 10, 17]).to(d)),
    "b_broadcast_expert": lambda d: (_bf16(37, 40).to(d), _bf16(1, 40, 24).to(d).expand(3, 40, 24),
                                     _offs([10, 10, 17]).to(d)),
    "b_one_column_kmajor": lambda d: (_bf16(37, 40).to(d), _bf16(3, 1, 40).to(d).transpose(1, 2),
                                      _offs([10, 10, 17]).to(d)),
    "bad_offs": lambda d: (_bf16(37, 40).to(d), _bf16(3, 40, 24).to(d),
                           torch.tensor([9, 4, 50], dtype=torch.int32).to(d)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_matches_cpu(case):
    _same_on_cpu_and_cuda(CASES[case])


@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_unaligned_k_and_n_like_grouped_mm(dtype, kmajor):
    """PyTorch's own 2-D x 3-D test shape (n = 7, k = 259 in aligned buffers)."""
    def make(device):
        return _aligned_buffers(dtype=dtype, kmajor=kmajor, device=device)

    _, out = _same_on_cpu_and_cuda(make)
    ref = F.grouped_mm(*make("cuda")[:2], offs=make("cuda")[2])
    assert rel_err(out[:58], ref[:58]) < 1e-2
    assert (out[58:] == 0).all()
    if dtype != torch.float32:  # fp32 output of the bf16/fp16 kernel, 4-element row padding
        _same_on_cpu_and_cuda(make, torch.float32)


@pytest.mark.parametrize("inter", [7, 96, 128])
def test_swiglu_any_intermediate_size(inter):
    """I = 7 and 96 are not whole tiles of the fused kernel: the two-pass path, padded rows."""
    a = torch.randn(300, 264, device="cuda", dtype=BF16)[:, :259]
    gate_up = torch.randn(4, 2 * inter, 264, device="cuda", dtype=BF16).mul_(0.06)[:, :, :259]
    offs = _offs([40, 0, 171, 80]).cuda()
    out = ts_moe.grouped_gemm_swiglu(a, gate_up, offs)
    assert out.shape == (300, inter) and out.stride(0) % 8 == 0
    h = _loop(a.cpu(), gate_up.cpu().transpose(1, 2), offs.cpu())
    ref = F.silu(h[:, :inter]) * h[:, inter:]
    assert rel_err(out.cpu(), ref) < 1e-2 and _per_row_rel_err(out[:291].cpu(), ref[:291]) < 2e-2
    assert (out[291:] == 0).all()


def test_paths_on_this_gpu():
    capability = torch.cuda.get_device_capability(torch.cuda.current_device())

    def first(*args):
        return paths.paths_for(Op.GROUPED_GEMM, capability, *args)[0]

    assert first(BF16) is Path.KERNEL_SM90
    assert first(torch.float16, torch.float32) is Path.KERNEL_SM90
    assert first(torch.float32) is Path.TORCH_GROUPED_MM
    assert first(BF16, None, 600) is Path.TORCH_GROUPED_MM


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_torch_grouped_mm_path(dtype):
    """More experts than the kernel takes (bf16) and float32: torch's grouped_mm, with
    this op's semantics (zero tail, bad offs read as the kernels read them)."""
    experts = 600 if dtype == BF16 else 5
    counts = torch.randint(0, 4, (experts,))
    counts[3] = 0
    a = torch.randn(int(counts.sum()) + 5, 64, device="cuda", dtype=dtype)
    b = torch.randn(experts, 64, 40, device="cuda", dtype=dtype) * 0.125
    offs = counts.cumsum(0).to(torch.int32).cuda()
    out = ts_moe.grouped_gemm(a, b, offs)
    ref = _loop(a.cpu(), b.cpu(), offs.cpu())
    assert rel_err(out.cpu(), ref) < (1e-2 if dtype == BF16 else 1e-5)
    assert (out[-5:] == 0).all()


def test_rows_near_the_int32_limit():
    """M = 2**31 - 8 rows: the tile count of one expert must not wrap (it did: zeros)."""
    m, k, n = 2**31 - 8, 8, 8
    torch.cuda.empty_cache()
    a = torch.randn(m, k, device="cuda", dtype=BF16)
    for offs_list in ([m], [m // 2 + 3, m]):
        experts = len(offs_list)
        b = torch.randn(experts, k, n, device="cuda", dtype=BF16)
        offs = torch.tensor(offs_list, dtype=torch.int32, device="cuda")
        out = ts_moe.grouped_gemm(a, b, offs)
        worst, start = 0.0, 0
        for e, end in enumerate(offs_list):
            # fp32 reference, 32 M rows at a time: a and out already take 64 GB,
            # and the chunks' float64 copies must fit beside them
            for lo in range(start, end, 1 << 25):
                hi = min(lo + (1 << 25), end)
                ref = a[lo:hi].float() @ b[e].float()
                got = out[lo:hi]
                assert torch.isfinite(got).all()
                worst = max(worst, _per_row_rel_err(got, ref))
                del ref, got
            start = end
        assert worst < 2e-2, f"{experts} experts: worst row rel err {worst}"
        del out
    torch.cuda.empty_cache()
    big = torch.randn(1, 8, device="cuda", dtype=BF16).expand(2**31, 8)
    with pytest.raises(ValueError, match="a has 2147483648 rows"):
        ts_moe.grouped_gemm(big, torch.randn(1, 8, 8, device="cuda", dtype=BF16),
                            torch.tensor([5], dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("swiglu", [False, True])
def test_a_index_on_the_gpu(dtype, swiglu):
    """Gathered rows (duplicates, out-of-range indices read as zero rows) on the kernel
    path (bf16: no host sync) and torch's (fp32, whose loop syncs): the CPU's result."""
    torch.manual_seed(0)
    m, k, n, e, rows = 300, 264, 96, 6, 700
    a = torch.randn(m, 272, dtype=dtype)[:, :k]
    b = torch.randn(e, k, n, dtype=dtype) * k**-0.5
    gate_up = torch.randn(e, n, k, dtype=dtype) * k**-0.5
    a_index = torch.randint(0, m, (rows,), dtype=torch.int32)
    a_index[::50] = torch.tensor([-7, m, 2**31 - 1, 12] * 4, dtype=torch.int32)[:14]
    offs = _offs([100, 0, 250, 1, 300, 20])
    op = ts_moe.grouped_gemm_swiglu if swiglu else ts_moe.grouped_gemm
    w = gate_up if swiglu else b
    want = op(a, w, offs, a_index=a_index)
    ga = torch.empty(m, 272, dtype=dtype, device="cuda")[:, :k].copy_(a)
    gw, goffs, gidx = w.cuda(), offs.cuda(), a_index.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error" if dtype == BF16 else 0)
    try:
        got = op(ga, gw, goffs, a_index=gidx)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert got.shape == want.shape
    assert rel_err(got.cpu(), want) < (1e-2 if dtype == BF16 else 1e-5)
    assert (got[int(offs[-1]):] == 0).all()
    assert (got[:int(offs[-1])][(a_index[:int(offs[-1])] < 0).cuda()] == 0).all()
