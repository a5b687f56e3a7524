"""A small ragged problem in every tile configuration of the sm_90 kernel, then
the decode block's small kernels (router logits, routing on one CTA and on many,
slot order, combine, row gather) on odd sizes.

    python -m tests.gpu_small_check

The compute-sanitizer target of ``test_compute_sanitizer`` (a process of its
own, so the tool sees every launch); prints one ``rel err`` line per
configuration and fails on a wrong result.
"""


import torch

from csrc_free_kernels.hopper import grouped_gemm_sm90_config as sm90
from tests import kernel_calls as kc
from ts_moe import reference
from ts_moe.reference import grouped_gemm_reference


def configs() -> list:
    """Every named configuration."""
    return list(sm90.CONFIGS.values())


def main() -> None:
    torch.manual_seed(0)
    a = torch.randn(300, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, 128, 136, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([40, 40, 171, 290], dtype=torch.int32, device="cuda")
    ref = grouped_gemm_reference(a, b, offs, torch.float32)
    for cfg in configs():
        out = kc.grouped_gemm(a, b, offs, config=cfg)
        torch.cuda.synchronize()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        print(f"{cfg.name}: rel err {err:.2e}")
        assert err < 1e-2
    route_kernels()


def route_kernels() -> None:
    """Odd sizes (rows of a strided buffer, a partial token tile, E not a power of
    two), each kernel against the torch functions; one line ``route kernels ok``."""
    buf = torch.randn(9, 264 + 8, device="cuda", dtype=torch.bfloat16)
    x, w = buf[:, 8:], torch.randn(33, 264, device="cuda", dtype=torch.bfloat16)
    logits = kc.router_logits(x, w)
    exact = x.double() @ w.double().t()
    assert ((logits.double() - exact).norm() / exact.norm()).item() < 1e-2
    ids_ref = reference.route(logits, 3)[1]
    weights, ids = kc.route_topk(logits, 3)
    assert torch.equal(ids, ids_ref)
    w1, ids1, token_index, offs, inverse = kc.route_slots(logits, 3)
    assert torch.equal(ids1, ids_ref) and torch.equal(w1, weights)
    for got, ref in zip(kc.sort_slots(ids, 33), reference.sort_slots(ids_ref, 33),
                        strict=True):
        assert got.dtype == ref.dtype and torch.equal(got, ref)
    rows = kc.weighted_row_sum(x, token_index, None)
    assert torch.equal(rows, x[token_index.long()])
    out = kc.weighted_row_sum(rows, inverse, weights)
    ref = reference.combine(rows.float(), weights, inverse)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    torch.cuda.synchronize()
    print("route kernels ok")


if __name__ == "__main__":
    main()
