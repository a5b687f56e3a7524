"""The sm_90 k-grouped (weight-gradient) GEMM against fp32 references."""

import pytest
import torch

from ts_moe.reference import grouped_gemm_k_reference

from .helpers import counts_to_offs, random_counts, rel_err

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}


def dw():
    from . import kernel_calls
    return kernel_calls


def dwc():
    from csrc_free_kernels.hopper import grouped_gemm_dw_sm90_config
    return grouped_gemm_dw_sm90_config


def make(m, k, n, counts, dtype=torch.bfloat16):
    """a (M, K), dy (M, N) randn; offs from counts (their sum may be < M: the
    rows past it belong to no expert)."""
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    return a, dy, counts_to_offs(counts)


def run_poisoned(a, dy, offs, out_dtype=None, out=None, **kw):
    """Poison out with NaN first: every element must then be written."""
    if out is None:
        out = torch.full((offs.shape[0], a.shape[1], dy.shape[1]), float("nan"),
                         device="cuda", dtype=out_dtype or a.dtype)
    else:
        out.fill_(float("nan"))
    res = dw().grouped_gemm_k(a, dy, offs, out, **kw)
    torch.cuda.synchronize()
    assert res is out
    assert torch.isfinite(out).all(), "unwritten (NaN) output elements"
    return out


def check(a, dy, offs, out_dtype=None, tol=None, **kw):
    """Per expert and overall relative error against the fp32 reference;
    exact zeros for experts without rows."""
    tol = tol or TOL[a.dtype]
    ref = grouped_gemm_k_reference(a.t(), dy, offs, torch.float32)
    out = run_poisoned(a, dy, offs, out_dtype, **kw)
    m = a.shape[0]
    ends = torch.cummax(offs.long().clamp(0, m), 0).values.tolist()
    start = 0
    for e, end in enumerate(ends):
        if end == start:
            assert (out[e] == 0).all(), f"expert {e} has no rows but a nonzero output"
        else:
            err = rel_err(out[e], ref[e])
            assert err < tol, f"expert {e} (rows {start}:{end}): rel err {err}"
        start = end
    err = rel_err(out, ref)
    assert err < tol, f"rel err {err}"
    return out


CONFIGS = ["dw_128x256", "dw_128x128"]


def test_configs_cover_the_module():
    assert set(CONFIGS) == set(dwc().CONFIGS)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_ragged(config, dtype, out_dtype):
    # empty experts, a 1-row expert, unaligned starts (301, 302, 802), 48 rows
    # past offs[-1]; K and N multiples of 8 but not of the tiles
    a, dy, offs = make(1000, 264, 392, [0, 301, 1, 0, 500, 150], dtype)
    out = check(a, dy, offs, out_dtype, config=dwc().CONFIGS[config])
    assert out.dtype == (out_dtype or dtype)


@pytest.mark.parametrize("config", CONFIGS)
def test_routing_extremes(config):
    cfg = dwc().CONFIGS[config]
    k, n = 136, 264
    check(*make(777, k, n, [0, 0, 0, 777, 0, 0, 0, 0]), config=cfg)   # one expert
    check(*make(8, k, n, [1] * 8), config=cfg)                         # 1 row each
    check(*make(1, k, n, [0, 0, 1, 0]), config=cfg)                    # M = 1
    check(*make(64, k, n, [0] * 8), config=cfg)                        # all empty: zeros
    check(*make(300, k, n, [300]), config=cfg)                         # E = 1
    check(*make(1000, 8, 8, [3, 0, 997]), config=cfg)                  # K = N = 8
    check(*make(3000, k, n, random_counts(3000, 64, skew=1.2)), config=cfg)  # skewed
    check(*make(4096, k, n, random_counts(4000, 256)), config=cfg)     # E = 256, 96 past
    counts = torch.zeros(512, dtype=torch.long)
    counts[torch.randperm(512)[:5]] = torch.tensor([100, 3, 250, 1, 46])
    check(*make(400, k, n, counts), config=cfg)                        # E = 512, most empty


def test_rows_past_the_end_and_bad_offsets_are_excluded():
    a, dy, offs = make(500, 128, 256, [100, 57, 200])  # 143 rows past offs[-1]
    a[357:] = float("nan")
    dy[357:] = float("inf")
    check(a, dy, offs)
    # invalid offs: ends = cummax(clamp(offs, 0, M)) = [200, 200, 300, 300]
    a, dy, _ = make(300, 128, 128, [1])
    check(a, dy, torch.tensor([200, 50, 10_000, -5], dtype=torch.int32, device="cuda"))


def test_unaligned_starts_every_residue():
    # expert starts at every residue mod 64 and lengths 1..70 around the chunk size
    counts = [1 + (7 * i) % 70 for i in range(64)]
    check(*make(sum(counts) + 5, 200, 136, counts))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_strided_operands_and_padded_out(config, out_dtype):
    cfg = dwc().CONFIGS[config]
    a, dy, offs = make(600, 264, 392, [100, 0, 333, 167])
    wide_a = torch.randn(600, 320, device="cuda", dtype=a.dtype)[:, :264].copy_(a)
    wide_dy = torch.randn(600, 400, device="cuda", dtype=a.dtype)[:, :392].copy_(dy)
    ref = check(a, dy, offs, out_dtype, config=cfg)
    # out rows padded to 400 columns (expert stride = K * 400)
    out = torch.empty(4, 264, 400, device="cuda", dtype=out_dtype)[:, :, :392]
    assert torch.equal(run_poisoned(wide_a, wide_dy, offs, out=out, config=cfg), ref)
    # padded rows and columns (expert stride = 272 * 400): the stores stop at
    # each expert's K and N edges and leave the padding as it was
    buf = torch.full((4, 272, 400), 7.0, device="cuda", dtype=out_dtype)
    out = buf[:, :264, :392]
    dw().grouped_gemm_k(a, dy, offs, out, config=cfg)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    assert (buf[:, 264:] == 7.0).all() and (buf[:, :, 392:] == 7.0).all()


def test_large():
    m, k, n, e = 32768, 4096, 2048, 8
    check(*make(m, k, n, random_counts(m - 100, e, skew=0.8)))


def test_deterministic():
    a, dy, offs = make(20000, 1024, 768, random_counts(20000, 16, skew=1.0))
    for cfg in dwc().CONFIGS.values():
        first = run_poisoned(a, dy, offs, config=cfg).clone()
        second = run_poisoned(a, dy, offs, config=cfg)
        assert torch.equal(first, second)
        first = run_poisoned(a, dy, offs, torch.float32, config=cfg).clone()
        assert torch.equal(first, run_poisoned(a, dy, offs, torch.float32, config=cfg))


def test_no_host_sync_and_cuda_graph():
    m, k, n, e = 2048, 512, 384, 8
    a, dy, offs = make(m, k, n, random_counts(m, e))
    out = torch.empty(e, k, n, device="cuda", dtype=a.dtype)
    dw().grouped_gemm_k(a, dy, offs, out)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dw().grouped_gemm_k(a, dy, offs, out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dw().grouped_gemm_k(a, dy, offs, out)
    for skew in (0.0, 1.5, 3.0):  # new data and new routing, same buffers
        a.copy_(torch.randn_like(a))
        dy.copy_(torch.randn_like(dy))
        offs.copy_(counts_to_offs(random_counts(m - 10, e, skew=skew)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = grouped_gemm_k_reference(a.t(), dy, offs, torch.float32)
        assert rel_err(out, ref) < 1e-2


def test_matches_torch_grouped_mm():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not available")
    a, dy, offs = make(4096, 512, 768, [512] * 8)
    out = run_poisoned(a, dy, offs)
    assert rel_err(out, torch._grouped_mm(a.t(), dy, offs=offs)) < 1e-2

