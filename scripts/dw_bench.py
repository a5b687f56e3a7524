#!/usr/bin/env python3
"""The k-grouped (weight-gradient) GEMM against torch's, on an sm_90 GPU.

    python scripts/dw_bench.py [--iters 20] [--out-dtype bfloat16|float32]

For each shape (M token rows, K, N, E experts, uniform routing), on
``torch.randn`` bf16 inputs: the kernel
(the sm_90 backend of the path table, ``ts_moe.ops.paths``) in each
configuration of ``grouped_gemm_dw_sm90_config.CONFIGS`` (``*`` marks the one
``choose_config`` picks) and
``torch._grouped_mm(a.t(), dy, offs=ends)``; CUDA-event time per call (ms),
TFLOP/s (``2 M K N`` flops) and the relative difference to torch's result.
"""

import argparse
import sys
from pathlib import Path

try:
    import torch
except ImportError as exc:
    sys.exit(f"{Path(__file__).name}: {exc}: run it with the project's Python")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

SHAPES = [  # M, K, N, E
    (8192, 4096, 28672, 8),
    (131072, 7168, 4096, 256),
    (131072, 2048, 1536, 128),
]


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def rel(x, y) -> float:
    x, y = x.float(), y.float()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args(argv)
    from csrc_free_kernels.hopper import grouped_gemm_dw_sm90_config as g
    from ts_moe.ops import Op, paths

    kernel = paths.TABLE[paths.Path.KERNEL_SM90][Op.GROUPED_GEMM_K]  # the shipped backend

    out_dtype = getattr(torch, args.out_dtype)
    print(f"{'M':>7} {'K':>5} {'N':>6} {'E':>4}  {'kernel':<18} {'ms':>8} {'TFLOP/s':>8} "
          f"{'rel diff':>9}")
    for m, k, n, e in SHAPES:
        torch.manual_seed(0)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        ends = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * (m // e)
        flops = 2 * m * k * n
        theirs = None
        if hasattr(torch, "_grouped_mm"):
            try:
                theirs = torch._grouped_mm(a.t(), dy, offs=ends)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"  torch._grouped_mm failed: {exc}")
        out = torch.empty(e, k, n, device="cuda", dtype=out_dtype)
        chosen = g.choose_config(e, k, n, m).name
        for name, cfg in g.CONFIGS.items():
            ms = time_ms(lambda: kernel.run(a.t(), dy, ends, out, cfg), args.iters)
            diff = f"{rel(out, theirs):9.2e}" if theirs is not None else ""
            label = name + (" *" if name == chosen else "")
            print(f"{m:7d} {k:5d} {n:6d} {e:4d}  {label:<18} {ms:8.3f} "
                  f"{flops / ms / 1e9:8.1f} {diff}")
        if theirs is not None:
            del out
            ms = time_ms(lambda: torch._grouped_mm(a.t(), dy, offs=ends), args.iters)
            print(f"{m:7d} {k:5d} {n:6d} {e:4d}  {'torch._grouped_mm':<18} {ms:8.3f} "
                  f"{flops / ms / 1e9:8.1f}")
        del a, dy, theirs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
