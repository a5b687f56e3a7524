"""A small ragged problem in every tile configuration of the sm_90 kernel
(the named ones, and the opt-in ``store_warp`` epilogue where it applies), then
the decode block's small kernels (router logits, routing on one CTA and on many,
slot order, combine, row gather) on odd sizes.

    python -m tests.gpu_small_check

The compute-sanitizer target of ``test_compute_sanitizer`` (a process of its
own, so the tool sees every launch); prints one ``rel err`` line per
configuration and fails on a wrong result.
"""

import dataclasses

import torch

from csrc_free_kernels.hopper import grouped_gemm_sm90_config as sm90
from csrc_free_kernels.routing import route_sm90_launch as route_sm90
from csrc_free_kernels.routing import router_sm90_launch
from csrc_free_kernels.hopper.grouped_gemm_sm90 import GroupedGemmSm90
from csrc_free_kernels.hopper.grouped_gemm_sm90_launch import grouped_gemm
from csrc_free_kernels.hopper.grouped_gemm_sm90_store_warp import GroupedGemmStoreWarpSm90
from ts_moe import reference
from ts_moe.reference import grouped_gemm_reference


def configs() -> list:
    """(configuration, kernel class): every named configuration, and the opt-in
    store-warp kernel on each one that takes it (128-row tiles shared by both
    warpgroups)."""
    named = list(sm90.CONFIGS.values())
    return [(c, GroupedGemmSm90) for c in named] + [
        (dataclasses.replace(c, name=f"{c.name}:sw"), GroupedGemmStoreWarpSm90)
        for c in named if c.tile_m == 128]


def main() -> None:
    torch.manual_seed(0)
    a = torch.randn(300, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, 128, 136, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([40, 40, 171, 290], dtype=torch.int32, device="cuda")
    ref = grouped_gemm_reference(a, b, offs, torch.float32)
    for cfg, kernel_cls in configs():
        out = grouped_gemm(a, b, offs, config=cfg, kernel_cls=kernel_cls)
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
    logits = router_sm90_launch.router_logits(x, w)
    exact = x.double() @ w.double().t()
    assert ((logits.double() - exact).norm() / exact.norm()).item() < 1e-2
    ids_ref = reference.route(logits, 3)[1]
    weights, ids = router_sm90_launch.route_topk(logits, 3)
    assert torch.equal(ids, ids_ref)
    w1, ids1, token_index, offs, inverse = route_sm90.route_slots(logits, 3)
    assert torch.equal(ids1, ids_ref) and torch.equal(w1, weights)
    for got, ref in zip(route_sm90.sort_slots(ids, 33), reference.sort_slots(ids_ref, 33),
                        strict=True):
        assert got.dtype == ref.dtype and torch.equal(got, ref)
    rows = route_sm90.weighted_row_sum(x, token_index, None, x.new_empty(27, 264))
    assert torch.equal(rows, x[token_index.long()])
    out = route_sm90.weighted_row_sum(rows, inverse, weights, x.new_empty(9, 264))
    ref = reference.combine(rows.float(), weights, inverse)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    torch.cuda.synchronize()
    print("route kernels ok")


if __name__ == "__main__":
    main()
