"""Kernel timeline of one CUDA-graph replay of the MoE block: where the time goes.

``python scripts/block_timeline.py H I E TOP_K [T] [--router-kernel]`` (e.g.
``4096 14336 8 2`` for Mixtral-8x7B) on a CUDA machine (``--router-kernel``:
with :func:`ts_moe.use_router_kernel`): ``ts_moe.moe_forward`` (every stage, as
``decode_graphs=False`` runs it) captured in a CUDA graph, replayed, and the
last of five profiled replays printed kernel by kernel (torch.profiler's CUDA
activity): start, duration and the gap before each kernel, in microseconds,
and the weight-streaming floor of the GEMMs beside their durations.  The
inputs are the moe_block suite's (``bench.moe_block.shaped_inputs``).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.cases import traffic  # noqa: E402
from bench.moe_block import shaped_inputs  # noqa: E402
from ts_moe.moe import moe_forward  # noqa: E402

HBM_BYTES_PER_US = 4.47e6  # H200 HBM read roof: bench/notes/2026-12-04-direct-store-epilogue.md


def main(hidden: int, inter: int, experts: int, top_k: int, tokens: int = 1) -> None:
    case, inp = shaped_inputs(hidden, inter, experts, top_k, tokens, torch.device("cuda"))

    def block():
        return moe_forward(inp.x, inp.router, inp.gate_up, inp.down, top_k,
                           decode_graphs=False)

    with torch.no_grad():
        block()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            block()
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per_replay = len(kernels) // 5
    last = kernels[-per_replay:]
    t0, prev_end = last[0].time_range.start, last[0].time_range.start
    print(f"{per_replay} kernels per replay; replay span "
          f"{last[-1].time_range.end - t0:.1f} us")
    print(f"{'start':>8} {'gap':>6} {'dur':>7}  kernel")
    for e in last:
        start, end = e.time_range.start, e.time_range.end
        print(f"{start - t0:8.1f} {start - prev_end:6.1f} {end - start:7.1f}  {e.name[:90]}")
        prev_end = end
    weights = traffic(case)["weights"]  # the touched experts' gate_up and down: 2:1
    print(f"floor at 4.47 TB/s, {case.touched_experts} experts: "
          f"gate_up {2 * weights / 3 / HBM_BYTES_PER_US:.1f} us, "
          f"down {weights / 3 / HBM_BYTES_PER_US:.1f} us")


if __name__ == "__main__":
    if "--router-kernel" in sys.argv:
        import ts_moe

        sys.argv.remove("--router-kernel")
        ts_moe.use_router_kernel()
    main(*map(int, sys.argv[1:6]))
