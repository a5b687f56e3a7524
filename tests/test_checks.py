"""The hot path's one check (ts_moe.checks.layout_ready) pinned against the full
check: wherever it says a call is ready, the full check passes and the
operands are in the layout every backend reads (so skipping the views is
safe); and the usual layouts are ready (so the hot path is taken)."""

import itertools

import pytest
import torch

from ts_moe.checks import ALIGN_BYTES, check_grouped_gemm_args, layout_ready

CPU = -1  # what get_device() gives a CPU tensor: the checks compare it like a CUDA index


def _a_variants(m, k, dtype):
    base = torch.randn(m, k + 8).to(dtype)
    yield "k_major", base[:, :k].contiguous()
    yield "padded_rows", base[:, :k]
    yield "m_major", torch.randn(k, m).to(dtype).t()
    yield "strided", torch.randn(m, 2 * k).to(dtype)[:, ::2]
    yield "unaligned_rows", torch.randn(m, k + 1).to(dtype)[:, :k]
    yield "broadcast", base[:1, :k].expand(m, k)
    yield "offset", torch.randn(m * k + 1).to(dtype)[1:].view(m, k)


def _b_variants(e, k, n, dtype):
    yield "n_major", torch.randn(e, k, n).to(dtype)
    yield "k_major", torch.randn(e, n, k).to(dtype).transpose(1, 2)
    yield "padded", torch.randn(e, k, n + 8).to(dtype)[:, :, :n]
    yield "unaligned", torch.randn(e, k, n + 1).to(dtype)[:, :, :n]
    yield "broadcast", torch.randn(1, k, n).to(dtype).expand(e, k, n)
    yield "wrong_k", torch.randn(e, k + 8, n).to(dtype)


def _offs_variants(e):
    yield "int32", torch.arange(1, e + 1, dtype=torch.int32)
    yield "int64", torch.arange(1, e + 1)
    yield "strided", torch.arange(1, 2 * e + 1, dtype=torch.int32)[::2]
    yield "short", torch.arange(1, e, dtype=torch.int32)


def _in_backend_layout(a, b) -> bool:
    def aligned(t, dims):
        elems = ALIGN_BYTES // t.element_size()
        return all(t.stride(d) > 0 and t.stride(d) % elems == 0 for d in dims)

    return (a.stride(1) == 1 and aligned(a, [0])
            and ((b.stride(2) == 1 and aligned(b, [0, 1])) or (b.stride(1) == 1 and aligned(b, [0, 2])))
            and a.data_ptr() % ALIGN_BYTES == 0 and b.data_ptr() % ALIGN_BYTES == 0)


SHAPES = [(37, 64, 48, 5), (1, 8, 8, 1), (16, 24, 1, 3), (8, 1, 16, 2), (0, 64, 48, 5)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


@pytest.mark.parametrize("m, k, n, e", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ready_means_valid_and_in_the_backends_layout(m, k, n, e, dtype):
    ready = 0
    for (an, a), (bn, b), (on, offs), out_dtype in itertools.product(
            _a_variants(m, k, dtype), _b_variants(e, k, n, dtype), _offs_variants(e),
            (None, dtype, torch.float32, torch.float16)):
        if not layout_ready(a, b, offs, out_dtype, CPU):
            continue
        ready += 1
        check_grouped_gemm_args(a, b, offs, out_dtype)  # raises if the predicate lied
        assert _in_backend_layout(a, b), (an, bn, on, out_dtype)
    if m == 0 or dtype == torch.float64:
        assert ready == 0  # empty calls and the float64 reference take the full path


def test_the_usual_layouts_are_ready():
    a, offs = torch.randn(37, 64).bfloat16(), torch.tensor([3, 9, 9, 20, 30], dtype=torch.int32)
    for b in (torch.randn(5, 64, 48).bfloat16(),                    # (E, K, N)
              torch.randn(5, 48, 64).bfloat16().transpose(1, 2)):   # nn.Linear (E, N, K), viewed
        for out_dtype in (None, torch.bfloat16, torch.float32):
            assert layout_ready(a, b, offs, out_dtype, CPU)
        assert layout_ready(a.float(), b.float(), offs, None, CPU)
        assert not layout_ready(a.double(), b.double(), offs, None, CPU)
        assert not layout_ready(a[:0], b, offs, None, CPU)
        assert not layout_ready(a, b, offs, torch.float16, CPU)


def test_the_swiglu_form_reads_k_on_the_last_dim():
    a = torch.randn(12, 64).bfloat16()
    gate_up, offs = torch.randn(3, 32, 64).bfloat16(), torch.tensor([4, 8, 12], dtype=torch.int32)
    assert layout_ready(a, gate_up, offs, None, CPU, k_dim=2)
    assert not layout_ready(a, gate_up, offs, None, CPU)  # K = 32 on dim 1: no
    assert not layout_ready(a, gate_up[:, :, :56], offs, None, CPU, k_dim=2)  # K mismatch
    assert not layout_ready(a.cuda() if torch.cuda.is_available() else a, gate_up, offs, None, 0,
                            k_dim=2)  # another device
