"""GPU: the ping-pong variant of the sm_90 GEMM (``grouped_gemm_sm90_pingpong``, awaiting
its A/B) against fp32 references: ragged and empty experts, one row, the zero tail, N
not a multiple of its 192-column tiles, and long walks (many tiles a CTA, many more
k-tiles than stages: a warpgroup must never wait on a stage more than one phase behind)."""

import pytest
import torch

from .helpers import random_counts, rel_err
from .test_grouped_gemm_gpu import make, reference

pytestmark = pytest.mark.gpu


def _run(a, b, offs, config):
    from csrc_free_kernels.hopper import grouped_gemm_sm90_launch as launch
    from csrc_free_kernels.hopper import grouped_gemm_sm90_pingpong as pp

    out = torch.full((a.shape[0], b.shape[2]), float("nan"), device="cuda", dtype=a.dtype)
    launch.launch(a, b, offs, out, pp.CONFIGS[config], pp.GroupedGemmPingpongSm90)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten (NaN) output elements"
    return out


def check(a, b, offs, config):
    ref = reference(a, b, offs)
    out = _run(a, b, offs, config)
    end = int(offs[-1]) if offs.numel() else 0
    assert rel_err(out, ref) < 1e-2
    rows = (out[:end].float() - ref[:end]).norm(dim=1) / ref[:end].norm(dim=1).clamp_min(1e-6)
    assert rows.max() < 2e-2, f"worst row {int(rows.argmax())}: {float(rows.max())}"
    assert (out[end:] == 0).all()


CONFIGS = ["pp192", "pp192_c2"]


@pytest.mark.parametrize("config", CONFIGS)
def test_ragged_experts_and_tails(config):
    # 48 rows past the last expert; N = 392: two 192-column tiles and an 8-column one
    check(*make(1000, 256, 392, 6, counts=[0, 301, 1, 0, 500, 150], kmajor=True), config)


@pytest.mark.parametrize("config", CONFIGS)
def test_routing_extremes(config):
    k, n = 128, 384
    check(*make(777, k, n, 8, counts=[0, 0, 0, 777, 0, 0, 0, 0], kmajor=True), config)
    check(*make(8, k, n, 8, counts=[1] * 8, kmajor=True), config)
    check(*make(1, k, n, 8, counts=[0, 0, 1, 0, 0, 0, 0, 0], kmajor=True), config)
    counts = torch.zeros(512, dtype=torch.long)
    counts[torch.randperm(512)[:5]] = torch.tensor([100, 3, 250, 1, 46])
    check(*make(400, k, n, 512, counts=counts, kmajor=True), config)
    check(*make(3000, k, n, 64, counts=random_counts(3000, 64, skew=1.2), kmajor=True), config)


def test_all_experts_empty():
    a, b, offs = make(64, 128, 384, 8, counts=[0] * 8, kmajor=True)
    assert (_run(a, b, offs, "pp192_c2") == 0).all()


@pytest.mark.parametrize("config", CONFIGS)
def test_long_walks(config):
    check(*make(4096, 2048, 4096, 8, kmajor=True), config)
    check(*make(4096, 2048, 4096, 8, counts=[1000, 0, 37, 2000, 0, 900, 159, 0],
                kmajor=True), config)


def test_qwen3_down_shape():
    """Qwen3-30B-A3B down at T = 4096 (128 experts, K = 768, N = 2048): the A/B's case."""
    a, b, offs = make(32768, 768, 2048, 128, kmajor=True)
    check(a, b, offs, "pp192_c2")
