"""GPU: the TMA-store epilogue variant of the sm_90 GEMM (``grouped_gemm_sm90_tma_store``,
awaiting its A/B) against fp32 references, plain and SwiGLU: whole tiles (TMA stores)
beside partial ones (thread stores) in one walk, a tile at every expert boundary, empty
experts, one row, the zero tail, N not a multiple of the tile, long walks (the buffers'
reuse over many tiles), both weight layouts where the configuration takes them."""

import pytest
import torch

from ts_moe.reference import grouped_gemm_swiglu_reference

from .helpers import random_counts, rel_err
from .test_grouped_gemm_gpu import make, reference

pytestmark = pytest.mark.gpu
CONFIGS = ["prefill_p2", "prefill", "mid", "decode"]


def _variant():
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as c
    from csrc_free_kernels.hopper import grouped_gemm_sm90_launch as launch
    from csrc_free_kernels.hopper import grouped_gemm_sm90_tma_store as v
    return c, launch, v


def run(a, b, offs, config):
    c, launch, v = _variant()
    out = torch.full((a.shape[0], b.shape[2]), float("nan"), device="cuda", dtype=a.dtype)
    launch.launch(a, b, offs, out, c.CONFIGS[config], v.GroupedGemmTmaStoreSm90)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten (NaN) output elements"
    return out


def check(a, b, offs, config):
    ref = reference(a, b, offs)
    out = run(a, b, offs, config)
    end = int(offs[-1]) if offs.numel() else 0
    assert rel_err(out, ref) < 1e-2
    if end:  # all experts empty: no routed row, only the zero tail below
        rows = (out[:end].float() - ref[:end]).norm(dim=1) / ref[:end].norm(dim=1).clamp_min(1e-6)
        assert rows.max() < 2e-2, f"worst row {int(rows.argmax())}: {float(rows.max())}"
    assert (out[end:] == 0).all()


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("kmajor", [False, True])
def test_whole_and_partial_tiles(config, kmajor):
    # experts of 256 rows (whole 128-row tiles only), 301 and 500 (a partial last tile),
    # one row; N = 392 (a partial last n-tile, clipped by the tensor map); 48 tail rows
    counts = [0, 256, 301, 1, 0, 500, 150, 256]
    check(*make(1512, 256, 392, 8, counts=counts, kmajor=kmajor), config)


@pytest.mark.parametrize("config", CONFIGS)
def test_routing_extremes(config):
    k, n = 128, 256
    check(*make(777, k, n, 8, counts=[0, 0, 0, 777, 0, 0, 0, 0]), config)
    check(*make(1024, k, n, 8, counts=[0, 0, 0, 1024, 0, 0, 0, 0]), config)  # all whole
    check(*make(1, k, n, 8, counts=[0, 0, 1, 0, 0, 0, 0, 0]), config)
    check(*make(64, k, n, 8, counts=[0] * 8), config)
    check(*make(3000, k, n, 64, counts=random_counts(3000, 64, skew=1.2)), config)


@pytest.mark.parametrize("config", ["prefill_p2", "prefill"])
def test_long_walks(config):
    check(*make(8192, 2048, 4096, 8), config)
    check(*make(8192, 768, 2048, 64, kmajor=True), config)  # Qwen3's down, short K


@pytest.mark.parametrize("config", ["prefill_p2", "mid"])
def test_swiglu(config):
    c, launch, v = _variant()
    e, h, inter = 6, 256, 256
    a = torch.randn(1000, h, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * h**-0.5
    from .helpers import counts_to_offs
    offs = counts_to_offs([0, 301, 1, 256, 300, 94])  # 48 rows past the last expert
    out = torch.full((1000, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    launch.launch(a, gate_up.transpose(-2, -1), offs, out, c.CONFIGS[config],
                  v.GroupedGemmSwigluTmaStoreSm90)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    ref = grouped_gemm_swiglu_reference(a.float(), gate_up.float(), offs)
    assert rel_err(out[:952], ref[:952]) < 1e-2
    assert (out[952:] == 0).all()
