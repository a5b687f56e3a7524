"""The op surface on any device: validation, semantics, torch.library checks."""

import pytest
import torch

import ts_moe
from ts_moe.reference import segment_ends

from .helpers import rel_err


def _problem(m=37, k=64, n=48, e=5, dtype=torch.bfloat16, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = (torch.randn(e, k, n, generator=g) * k**-0.5).to(dtype)
    cuts = torch.sort(torch.randint(0, max(m - 2, 1), (e - 1,), generator=g)).values
    offs = torch.cat([cuts, torch.tensor([m - 3])]).to(torch.int32)  # 3 tail rows
    return a, b, offs


def _loop(a, b, offs):
    out = torch.zeros(a.shape[0], b.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end].float() @ b[e].float()
        start = end
    return out


def test_matches_loop_and_zeroes_tail():
    a, b, offs = _problem()
    out = ts_moe.grouped_gemm(a, b, offs)
    assert out.dtype == a.dtype and out.shape == (a.shape[0], b.shape[2])
    assert rel_err(out, _loop(a, b, offs)) < 1e-2
    assert (out[int(offs[-1]):] == 0).all()


def test_matches_torch_grouped_mm_where_defined():
    """Against torch's own grouped_mm (the CPU build has it, as the other
    semantics tests use it): equal on the rows it defines."""
    a, b, offs = _problem(m=64, k=64, n=64, e=4)
    ref = torch.nn.functional.grouped_mm(a, b, offs=offs)
    end = int(offs[-1])
    assert rel_err(ts_moe.grouped_gemm(a, b, offs)[:end], ref[:end]) < 1e-2


def test_kmajor_weights_and_fp32_out():
    a, b, offs = _problem(dtype=torch.float16)
    w = b.transpose(1, 2).contiguous()  # (E, N, K) nn.Linear layout
    out = ts_moe.grouped_gemm(a, w.transpose(-2, -1), offs, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert rel_err(out, _loop(a, b, offs)) < 1e-3


def test_swiglu_reference_matches_unfused():
    a, _, offs = _problem(e=3)
    gate_up = torch.randn(3, 2 * 32, a.shape[1]).bfloat16()
    h = ts_moe.grouped_gemm(a, gate_up.transpose(-2, -1), offs, out_dtype=torch.float32)
    ref = torch.nn.functional.silu(h[:, :32]) * h[:, 32:]
    assert rel_err(ts_moe.grouped_gemm_swiglu(a, gate_up, offs), ref) < 1e-2


def test_bad_offsets_are_safe_and_defined():
    a, b, _ = _problem(m=20, e=4)
    offs = torch.tensor([9, 4, 50, -3], dtype=torch.int32)  # decreasing, too big, negative
    ends = segment_ends(offs, 20)
    assert ends.tolist() == [9, 9, 20, 20]
    ref = _loop(a, b, ends.to(torch.int32))
    assert rel_err(ts_moe.grouped_gemm(a, b, offs), ref) < 1e-2


def test_reference_takes_host_row_ends():
    """The bench passes row ends built on the host (an int64 cumsum of its counts;
    no sync, so graph-capturable): same result as the op's int32 offs."""
    from ts_moe.reference import grouped_gemm_reference, grouped_gemm_swiglu_reference

    a, b, offs = _problem()
    ends = torch.tensor(offs.tolist())
    assert torch.equal(grouped_gemm_reference(a, b, ends), grouped_gemm_reference(a, b, offs))
    gate_up = torch.randn(5, 64, a.shape[1]).bfloat16()
    assert torch.equal(grouped_gemm_swiglu_reference(a, gate_up, ends),
                       grouped_gemm_swiglu_reference(a, gate_up, offs))


@pytest.mark.parametrize("m, e", [(0, 3), (5, 1), (1, 4)])
def test_edge_sizes(m, e):
    a, b, offs = _problem(m=max(m, 1), e=e)
    a = a[:m]
    offs = offs.clamp(max=m)
    out = ts_moe.grouped_gemm(a, b, offs)
    assert out.shape == (m, b.shape[2])
    if m:
        assert rel_err(out, _loop(a, b, segment_ends(offs, m).to(torch.int32))) < 1e-2 or \
            _loop(a, b, offs).abs().sum() == 0


BAD = [
    (lambda a, b, o: (a.to(torch.int8), b.to(torch.int8), o), TypeError,
     "a must be bfloat16, float16, float32 or float64"),
    (lambda a, b, o: (a.float(), b, o), TypeError, "b must have a's dtype"),
    (lambda a, b, o: (a, b.half(), o), TypeError, "b must have a's dtype"),
    (lambda a, b, o: (a, b, o.long()), TypeError, "offs must be int32"),
    (lambda a, b, o: (a[None], b, o), ValueError, "a must be 2-D"),
    (lambda a, b, o: (a, b[0, 0], o), ValueError, "b must be 2-D or 3-D"),
    (lambda a, b, o: (a, b, o[:-1]), ValueError, "one entry per expert"),
    (lambda a, b, o: (a[:, :56], b, o), ValueError, "K mismatch"),
    (lambda a, b, o: (a, torch.randn(5, 48, 68).bfloat16()[:, :, :64].transpose(1, 2), o),
     ValueError, "b: stride 68 of dim 2 is not a multiple of 8"),
    (lambda a, b, o: (a[:, ::2], b[:, ::2], o), ValueError, "a needs one of its last two dims"),
    (lambda a, b, o: (torch.randn(37, 72).bfloat16()[:, :68][:, :64], b, o), None, None),
    (lambda a, b, o: ("a", b, o), TypeError, "a must be a torch.Tensor"),
]


@pytest.mark.parametrize("make, exc, msg", BAD)
def test_validation(make, exc, msg):
    args = make(*_problem())
    if exc is None:  # 72-element row stride: 16-byte aligned, accepted
        ts_moe.grouped_gemm(*args)
        return
    with pytest.raises(exc, match=msg):
        ts_moe.grouped_gemm(*args)


def test_misaligned_row_stride_rejected():
    a, b, offs = _problem()
    base = torch.randn(a.shape[0], 68).bfloat16()  # 136-byte rows
    with pytest.raises(ValueError, match="stride 68 of dim 0"):
        ts_moe.grouped_gemm(base[:, :64], b, offs)


def test_out_dtype_checked():
    a, b, offs = _problem()
    with pytest.raises(TypeError, match="out_dtype"):
        ts_moe.grouped_gemm(a, b, offs, out_dtype=torch.int8)


@pytest.mark.parametrize("kmajor", [False, True])
def test_opcheck(kmajor):
    a, b, offs = _problem()
    if kmajor:
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    torch.library.opcheck(torch.ops.ts_moe.grouped_gemm.default, (a, b, offs))
    torch.library.opcheck(torch.ops.ts_moe.grouped_gemm.default, (a, b, offs),
                          {"out_dtype": torch.float32})
    gate_up = torch.randn(b.shape[0], 32, a.shape[1]).bfloat16()
    torch.library.opcheck(torch.ops.ts_moe.grouped_gemm_swiglu.default, (a, gate_up, offs))


def test_torch_compile_fullgraph():
    a, b, offs = _problem()
    fn = torch.compile(lambda a, b, o: ts_moe.grouped_gemm(a, b, o).float().sum(0),
                       fullgraph=True, dynamic=True)
    assert rel_err(fn(a, b, offs), _loop(a, b, offs).sum(0)) < 1e-2


def test_prefetch_weights_is_a_hint_everywhere():
    """``prefetch_weights`` changes no result: CPU, the op's schema (opcheck: fake,
    autograd) and torch.compile accept it; anything but a bool is refused."""
    a, b, offs = _problem()
    plain = ts_moe.grouped_gemm(a, b, offs)
    assert torch.equal(ts_moe.grouped_gemm(a, b, offs, prefetch_weights=True), plain)
    torch.library.opcheck(torch.ops.ts_moe.grouped_gemm.default, (a, b, offs),
                          {"prefetch_weights": True})
    fn = torch.compile(lambda a, b, o: ts_moe.grouped_gemm(a, b, o, prefetch_weights=True),
                       fullgraph=True)
    assert torch.equal(fn(a, b, offs), plain)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="prefetch_weights must be a bool"):
            ts_moe.grouped_gemm(a, b, offs, prefetch_weights=bad)
