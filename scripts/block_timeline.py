"""Kernel timeline of one CUDA-graph replay of the MoE block: where the time goes.

``python scripts/block_timeline.py H I E TOP_K [T]`` (e.g. ``4096 14336 8 2`` for
Mixtral-8x7B) on a CUDA machine: ``ts_moe.moe_forward`` (every stage, as
``decode_graphs=False`` runs it) captured in a CUDA graph, replayed, and the
last of five profiled replays printed kernel by kernel (torch.profiler's CUDA
activity): start, duration and the gap before each kernel, in microseconds,
and the weight-streaming floor of the GEMMs beside their durations.
"""

import sys

import torch

from ts_moe.moe import moe_forward


def main(hidden: int, inter: int, experts: int, top_k: int, tokens: int = 1) -> None:
    def rand(*shape, fan_in):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * fan_in ** -0.5

    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    router = rand(experts, hidden, fan_in=hidden)
    gate_up = rand(experts, 2 * inter, hidden, fan_in=hidden)
    down = rand(experts, hidden, inter, fan_in=inter)

    def block():
        return moe_forward(x, router, gate_up, down, top_k, decode_graphs=False)

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
    touched = min(experts, tokens * top_k)
    hbm = 4.47e6  # bytes per us at the H200's measured read roof (bench/RESULTS.md)
    weights = touched * inter * hidden * 2  # the touched experts' down_proj bytes (gate_up: 2x)
    print(f"floor at 4.47 TB/s, {touched} experts: gate_up {2 * weights / hbm:.1f} us, "
          f"down {weights / hbm:.1f} us")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:6]))
