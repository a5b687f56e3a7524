"""A small ragged problem in every tile configuration of the sm_90 kernel
(the named ones, and the opt-in ``store_warp`` epilogue where it applies).

    python -m tests.gpu_small_check

The compute-sanitizer target of ``test_compute_sanitizer`` (a process of its
own, so the tool sees every launch); prints one ``rel err`` line per
configuration and fails on a wrong result.
"""

import dataclasses

import torch

from csrc_free_kernels import grouped_gemm_sm90 as sm90
from ts_moe.reference import grouped_gemm_reference


def configs() -> list:
    """Every named configuration, and the opt-in ``store_warp`` epilogue on each
    one that takes it (128-row tiles shared by both warpgroups)."""
    named = list(sm90.CONFIGS.values())
    return named + [dataclasses.replace(c, name=f"{c.name}:sw", store_warp=True)
                    for c in named if c.tile_m == 128 and not c.pingpong]


def main() -> None:
    torch.manual_seed(0)
    a = torch.randn(300, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, 128, 136, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([40, 40, 171, 290], dtype=torch.int32, device="cuda")
    ref = grouped_gemm_reference(a, b, offs, torch.float32)
    for cfg in configs():
        out = sm90.grouped_gemm(a, b, offs, config=cfg)
        torch.cuda.synchronize()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        print(f"{cfg.name}: rel err {err:.2e}")
        assert err < 1e-2


if __name__ == "__main__":
    main()
