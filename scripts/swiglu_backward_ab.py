#!/usr/bin/env python3
"""Keep or recompute the SwiGLU pre-activation h for the backward: time and peak memory.

``python scripts/swiglu_backward_ab.py``: for each model's gate_up GEMM at
T tokens (uniform routing, randn data), the forward + backward of
``ts_moe.grouped_gemm_swiglu`` with ``ts_moe.ops.swiglu.SWIGLU_KEEPS_H`` True
(the forward writes h (M, 2I) and keeps it) and False (the fused forward,
h recomputed in the backward), median of CUDA-event times, and the peak
memory above the inputs.  Needs a CUDA GPU.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import ts_moe  # noqa: E402
from bench.cases import MODELS  # noqa: E402
from bench.timing import measure  # noqa: E402
from ts_moe.ops import swiglu as swiglu_ops  # noqa: E402


def time_and_peak(x, gate_up, offs, index, grad, reps):
    """Median ms of one forward + backward (the harness's timer) and its peak GiB."""
    def step():
        out = ts_moe.grouped_gemm_swiglu(x, gate_up, offs, a_index=index)
        out.backward(grad)
        x.grad = gate_up.grad = None

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    peak = torch.cuda.max_memory_allocated() - base
    timing = measure([step], torch.device("cuda"), min_iters=reps, max_iters=reps)
    return timing.ms, peak / 2**30


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=lambda s: [int(t) for t in s.split(",")], default=[4096, 16384])
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    print(f"{'model':<15} {'T':>6} {'keep h ms':>10} {'GiB':>6} {'recompute ms':>13} {'GiB':>6}")
    for name, model in MODELS.items():
        experts, hidden, inter, top_k = model.experts, model.hidden, model.inter, model.top_k
        for tokens in args.T:
            g = torch.Generator(device="cuda").manual_seed(0)
            m = tokens * top_k
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16,
                            generator=g).requires_grad_()
            gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g)
                       * hidden**-0.5).to(torch.bfloat16).requires_grad_()
            index = torch.randint(0, tokens, (m,), device="cuda", dtype=torch.int32, generator=g)
            offs = torch.linspace(m / experts, m, experts, device="cuda").round().to(torch.int32)
            grad = torch.randn(m, inter, device="cuda", dtype=torch.bfloat16, generator=g)
            row = []
            for keep in (True, False):
                swiglu_ops.SWIGLU_KEEPS_H = keep
                row += time_and_peak(x, gate_up, offs, index, grad, args.reps)
            print(f"{name:<15} {tokens:>6} {row[0]:>10.3f} {row[1]:>6.2f} {row[2]:>13.3f} "
                  f"{row[3]:>6.2f}")
            del x, gate_up, index, grad
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
