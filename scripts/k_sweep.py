#!/usr/bin/env python3
"""Fixed cost per output tile, from a sweep over K at one (E, M, N).

    scripts/k_sweep.py --experts 256 --rows 512 --n 7168 --k 512,1024,2048,4096

Times the ts_moe kernel in one tile configuration (``--config``: the same at
every K, where the heuristic would switch) and ``torch_grouped_mm`` on the same
``torch.randn`` inputs (rotated past L2; ragged routing, each expert ``rows``
+- 5 %) at each K, and fits ``ms = fixed + per_k * K`` by least squares.  The mainloop scales with K;
what does not (the epilogue, filling the pipeline, the schedule) is ``fixed``:
the share of a case's time that overlapping the epilogue with the next tile's
MMAs could win at most.
"""

import argparse
import sys
from pathlib import Path

try:
    import torch
except ImportError as exc:  # the shebang's python3 is not the project's environment
    sys.exit(f"{Path(__file__).name}: {exc}: run it with the Python that ts_moe is installed "
             f"in (activate its environment, or: path/to/python {sys.argv[0]} ...)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.timing import measure, rotation_copies  # noqa: E402


def inputs(experts, rows, n, k, seed):
    g = torch.Generator("cuda").manual_seed(seed)
    counts = (rows * (0.95 + 0.1 * torch.rand(experts, generator=g, device="cuda"))).int()
    m = int(counts.sum())
    a = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(experts, k, n, generator=g, device="cuda", dtype=torch.bfloat16) * k**-0.5
    return a, b, counts.cumsum(0).int()


def fit(ks, ms):
    """Least-squares line through (K, ms): (fixed ms, ms per K)."""
    n = len(ks)
    mk, mm = sum(ks) / n, sum(ms) / n
    slope = sum((k - mk) * (t - mm) for k, t in zip(ks, ms)) / sum((k - mk) ** 2 for k in ks)
    return mm - slope * mk, slope


def _ks(text: str) -> list[int]:
    """--k: comma-separated K values, at least two different ones (a line needs two points)."""
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if any(k < 1 for k in ks) or len(set(ks)) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: need two or more different K >= 1")
    return ks


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} < 1")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/k_sweep.py", description=__doc__.splitlines()[0] + " Needs an sm_90 GPU.",
        epilog="e.g. scripts/k_sweep.py --experts 256 --rows 512 --n 7168 --k 512,1024,2048,4096")
    p.add_argument("--experts", type=_positive, required=True)
    p.add_argument("--rows", type=_positive, required=True, help="rows per expert (about)")
    p.add_argument("--n", type=_positive, required=True)
    p.add_argument("--k", type=_ks, required=True, help="comma-separated K values (two or more)")
    p.add_argument("--target-ms", type=float, default=100.0)
    p.add_argument("--config", default="prefill",
                   help="ts_moe tile configuration, the same at every K (default prefill)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("scripts/k_sweep.py: needs a CUDA GPU (sm_90); torch sees none here",
              file=sys.stderr)
        return 2
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as sm90
    from ts_moe.ops import Op, paths

    kernel = paths.TABLE[paths.Path.KERNEL_SM90][Op.GROUPED_GEMM]  # the shipped backend

    if args.config not in sm90.CONFIGS:
        p.error(f"--config {args.config!r}: known: {', '.join(sm90.CONFIGS)}")
    ks = args.k
    config = sm90.CONFIGS[args.config]
    fns = {"torch_grouped_mm": lambda a, b, o: torch._grouped_mm(a, b, offs=o),
           f"ts_moe {config.name}": lambda a, b, o: kernel.run(
               a, b, o, a.new_empty(a.shape[0], b.shape[2]), config)}
    times = {name: [] for name in fns}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for k in ks:
        first = inputs(args.experts, args.rows, args.n, k, seed=k)
        size = first[0].nbytes + first[1].nbytes
        copies = [first] + [(x.clone(), y.clone(), o) for x, y, o in
                            [first] * (rotation_copies(size, size, l2, 30 << 30) - 1)]
        for name, fn in fns.items():
            thunks = [lambda c=c, fn=fn: fn(*c) for c in copies]
            times[name].append(measure(thunks, torch.device("cuda"),
                                       target_ms=args.target_ms).ms)
        del copies, first
    print(f"E={args.experts} rows/expert~{args.rows} N={args.n}")
    print("K".rjust(8) + "".join(name.rjust(20) for name in fns))
    for i, k in enumerate(ks):
        print(f"{k:8d}" + "".join(f"{times[name][i]:17.3f} ms" for name in fns))
    for name in fns:
        fixed, per_k = fit(ks, times[name])
        tiles = -(-args.rows // 128) * args.experts * -(-args.n // 256)
        print(f"{name}: fixed {fixed:.3f} ms ({1e3 * fixed / max(tiles / 132, 1):.2f} us "
              f"per wave of 132 128x256 tiles), {1e3 * per_k * 1024:.1f} us per 1024 of K")
    return 0


if __name__ == "__main__":
    sys.exit(main())
