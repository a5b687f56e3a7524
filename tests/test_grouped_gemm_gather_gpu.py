"""GPU: the gathering variant of the sm_90 GEMM (``grouped_gemm_sm90_gather``, awaiting its
A/B) against fp32 references of ``a[a_index] @ b[e]``, plain and SwiGLU, per row and
overall, on poisoned outputs: every configuration, both weight layouts of the plain
kernel, indices outside ``[0, M)`` (zero rows), repeated indices (top-k), empty experts,
one row, all experts empty, the zero tail, a K tail, N not a multiple of the tile, long
walks over the ring."""

import pytest
import torch

from ts_moe.reference import grouped_gemm_swiglu_reference

from .helpers import counts_to_offs, random_counts, rel_err
from .test_grouped_gemm_gpu import reference

pytestmark = pytest.mark.gpu
PLAIN = ["prefill_p2", "prefill", "mid", "decode", "decode_p2", "decode16", "decode16_n64"]
SWIGLU = ["prefill_p2", "prefill"]


def _variant():
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as c
    from csrc_free_kernels.hopper import grouped_gemm_sm90_gather as v
    return c, v


def make(m_tokens, rows, k, n, e, counts=None, kmajor=True, bad=0, dtype=torch.bfloat16):
    """Tokens (m_tokens, K), weights, offs over ``rows`` output rows, and an index of
    ``rows`` token rows (top-k style: repeats), ``bad`` of them outside [0, M)."""
    a = torch.randn(m_tokens, k, device="cuda", dtype=dtype)
    if kmajor:
        b = (torch.randn(e, n, k, device="cuda", dtype=dtype) * k**-0.5).transpose(-2, -1)
    else:
        b = torch.randn(e, k, n, device="cuda", dtype=dtype) * k**-0.5
    offs = counts_to_offs(random_counts(rows, e) if counts is None else counts)
    index = torch.randint(0, max(m_tokens, 1), (rows,), device="cuda", dtype=torch.int32)
    if bad:
        where = torch.randperm(rows, device="cuda")[:bad]
        index[where[::2]] = -1
        index[where[1::2]] = m_tokens + 7
    return a, b, offs, index


def gathered(a, index):
    ok = (index >= 0) & (index < a.shape[0])
    rows = a[index.clamp(0, max(a.shape[0] - 1, 0)).long()]
    return torch.where(ok[:, None], rows, torch.zeros_like(rows))


def run(a, b, offs, index, config, swiglu=False):
    c, v = _variant()
    n = b.shape[2] // 2 if swiglu else b.shape[2]
    out = torch.full((index.shape[0], n), float("nan"), device="cuda", dtype=a.dtype)
    v.launch(a, b, offs, out, index, c.CONFIGS[config], swiglu=swiglu)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten (NaN) output elements"
    return out


def check(a, b, offs, index, config, swiglu=False):
    x = gathered(a, index)
    if swiglu:
        ref = grouped_gemm_swiglu_reference(x, b.transpose(-2, -1), offs).float()
    else:
        ref = reference(x, b, offs)
    out = run(a, b, offs, index, config, swiglu)
    end = int(offs[-1]) if offs.numel() else 0
    assert rel_err(out, ref) < 1e-2
    if end:
        rows = (out[:end].float() - ref[:end]).norm(dim=1)
        scale = ref[:end].norm(dim=1)
        live = scale > 0
        if live.any():
            worst = (rows[live] / scale[live]).max()
            assert worst < 2e-2, f"worst row error {float(worst)}"
        assert (out[:end][~live] == 0).all(), "a zero (dropped) row is not zero"
    assert (out[end:] == 0).all()


@pytest.mark.parametrize("config", PLAIN)
@pytest.mark.parametrize("kmajor", [True, False])
def test_plain_against_the_gathered_reference(config, kmajor):
    # 600 tokens read by 1512 rows (repeats), 20 indices outside [0, M); experts of
    # 256, 301, 500 rows, one row, empty ones; N = 392 (a partial n-tile); 48 tail rows
    counts = [0, 256, 301, 1, 0, 500, 150, 256]
    check(*make(600, 1512, 256, 392, 8, counts=counts, kmajor=kmajor, bad=20), config)


def test_fp16_tokens():
    counts = [0, 256, 301, 1, 0, 500, 150, 256]
    check(*make(600, 1512, 256, 392, 8, counts=counts, bad=20, dtype=torch.float16), "prefill")


@pytest.mark.parametrize("config", SWIGLU)
def test_swiglu_against_the_gathered_reference(config):
    counts = [0, 256, 301, 1, 0, 500, 150, 256]
    check(*make(600, 1512, 256, 512, 8, counts=counts, bad=20), config, swiglu=True)


@pytest.mark.parametrize("config", ["prefill_p2", "mid", "decode16"])
def test_routing_extremes(config):
    k, n = 136, 256  # K = 136: a K tail of 8 columns in the last k-tile
    check(*make(300, 777, k, n, 8, counts=[0, 0, 0, 777, 0, 0, 0, 0]), config)
    check(*make(1, 1, k, n, 8, counts=[0, 0, 1, 0, 0, 0, 0, 0]), config)
    check(*make(64, 64, k, n, 8, counts=[0] * 8), config)  # every row in the zero tail
    check(*make(64, 64, k, n, 8, counts=[64] + [0] * 7, bad=64), config)  # all dropped


@pytest.mark.parametrize("config", ["prefill_p2", "prefill"])
def test_long_walks_over_the_ring(config):
    """Qwen3-30B-A3B's down projection at T = 4096 (128 experts, K = 768: twelve
    k-tiles a tile, hundreds of tiles a CTA) and a DeepSeek-V3-like K = 7168."""
    check(*make(4096, 32768, 768, 2048, 128), config)
    check(*make(512, 4096, 7168, 512, 16), config)
