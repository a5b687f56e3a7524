"""``python -m bench overhead``: host time of one op call, GPU work excluded.

The calls are queued behind a long ``torch.cuda._sleep`` kernel, so the host
never waits for the GPU; fewer calls than the launch queue holds (~1000),
or a full queue would block the host and count GPU time.  A decode-sized
problem (Mixtral gate_up at T=16 would do; its size does not change the host
work), the median of several batches.
"""

import argparse
import statistics
import sys
import time

import torch

CALLS = 200
MAX_CALLS = 500  # the launch queue holds ~1000 kernels; room for calls that launch two


def _per_call_us(fn, calls: int = CALLS, batches: int = 7) -> float:
    samples = []
    for _ in range(batches):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~60 ms of GPU time ahead of the calls
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def measure(n_calls: int = CALLS) -> dict[str, float]:
    import ts_moe

    a = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8, 4096, 1024, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(8, 1024, 4096, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(4, 33, 4, dtype=torch.int32, device="cuda")
    thunks = {
        "torch.ops.ts_moe.grouped_gemm": lambda: torch.ops.ts_moe.grouped_gemm(a, b, offs),
        "ts_moe.grouped_gemm": lambda: ts_moe.grouped_gemm(a, b, offs),
        "torch.ops.ts_moe.grouped_gemm_swiglu":
            lambda: torch.ops.ts_moe.grouped_gemm_swiglu(a, gate_up, offs),
        "torch._grouped_mm": lambda: torch._grouped_mm(a, b, offs=offs),
    }
    for fn in thunks.values():  # compile / load the kernels first
        fn()
    return {name: _per_call_us(fn, n_calls) for name, fn in thunks.items()}


def main(argv=()) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench overhead",
        description="Host time of one op call, GPU work excluded: the calls queue behind a long "
                    "GPU sleep. Needs CUDA.")
    parser.add_argument("--calls", type=int, default=CALLS,
                        help=f"calls per timed batch, 1 to {MAX_CALLS}: under the launch "
                             f"queue's ~1000, or the host waits for the GPU (default {CALLS})")
    args = parser.parse_args(list(argv))
    if not 1 <= args.calls <= MAX_CALLS:
        parser.error(f"--calls {args.calls}: must be 1 to {MAX_CALLS} (a full launch queue "
                     f"would block the host and count GPU time)")
    if not torch.cuda.is_available():
        print("python -m bench overhead: needs a CUDA GPU (it times op calls queued behind "
              "GPU work); torch sees none here", file=sys.stderr)
        return 2
    for name, us in measure(args.calls).items():
        print(f"{name:40s} {us:7.2f} us per call (host)")
    return 0
