"""Host time of one ``ts_moe.moe_forward`` call (eager, no grad) and where it goes.

``python scripts/host_profile.py H I E TOP_K`` (e.g. ``4096 14336 8 2`` for
Mixtral-8x7B) on a CUDA machine: the GPU is kept busy with ``torch.cuda._sleep``
so that only the host's work is timed (100 calls: within the launch queue),
then the same calls under cProfile, by own time.  The inputs are the
moe_block suite's at T = 1 (``bench.moe_block.shaped_inputs``).
"""

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.moe_block import shaped_inputs  # noqa: E402
from ts_moe.moe import moe_forward  # noqa: E402


def main(hidden: int, inter: int, experts: int, top_k: int, calls: int = 100) -> None:
    _, inp = shaped_inputs(hidden, inter, experts, top_k, 1, torch.device("cuda"))
    x, router, gate_up, down = inp.x, inp.router, inp.gate_up, inp.down
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
