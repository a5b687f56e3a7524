"""Host time of one ``ts_moe.moe_forward`` call (eager, no grad) and where it goes.

``python scripts/host_profile.py H I E TOP_K`` (e.g. ``4096 14336 8 2`` for
Mixtral-8x7B) on a CUDA machine: the GPU is kept busy with ``torch.cuda._sleep``
so that only the host's work is timed (100 calls: within the launch queue),
then the same calls under cProfile, by own time.
"""

import cProfile
import pstats
import sys
import time

import torch

from ts_moe.moe import moe_forward


def main(hidden: int, inter: int, experts: int, top_k: int, calls: int = 100) -> None:
    def rand(*shape, fan_in):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * fan_in ** -0.5

    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    router = rand(experts, hidden, fan_in=hidden)
    gate_up = rand(experts, 2 * inter, hidden, fan_in=hidden)
    down = rand(experts, hidden, inter, fan_in=inter)
    with torch.no_grad():
        for _ in range(20):
            moe_forward(x, router, gate_up, down, top_k)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))
        t0 = time.perf_counter()
        for _ in range(calls):
            moe_forward(x, router, gate_up, down, top_k)
        t1 = time.perf_counter()
        print(f"host time per call: {1e6 * (t1 - t0) / calls:.1f} us")
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            moe_forward(x, router, gate_up, down, top_k)
        prof.disable()
        torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]))
