"""Timing: CUDA events (perf_counter on CPU), median of many calls, inputs
rotated so the L2 cache never holds them, optional CUDA-graph replay; NVTX.

Eager timing records an event pair around every call, so a call whose
host-side work is longer than its kernels measures the host (that *is* its
eager cost); ``graph=True`` replays a CUDA graph of the calls instead, which
leaves only GPU time (what a graph-captured model would see).
"""

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ts_moe.nvtx import nvtx_range  # noqa: F401  (one ts_moe NVTX domain for all ranges)

DEFAULT_L2_BYTES = 60 << 20  # H200
# enough copies that the set cycled through is ~3x L2: by the time a copy
# comes round again, L2 has been refilled three times over
L2_MULTIPLE = 3
MIN_COPIES = 2
MAX_COPIES = 16


@dataclass
class Timing:
    ms: float  # median per call
    iters: int
    graphed: bool
    samples: list  # ms per call of each timed unit


def l2_bytes(device: torch.device) -> int:
    """L2 size of the GPU; 0 on CPU (rotation then only keeps two copies)."""
    if device.type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", DEFAULT_L2_BYTES)


def rotation_copies(read_bytes: int, alloc_bytes: int, l2: int, budget_bytes: int) -> int:
    """How many copies of a case's inputs to cycle through.

    ``read_bytes``: what one call reads (touched weights + activations);
    ``alloc_bytes``: what one copy occupies.  Enough copies that the rotation
    reads ``L2_MULTIPLE`` x L2, at least two (a weight set far larger than L2
    still leaves its tail in L2 for the next call), at most what fits in
    ``budget_bytes`` (never fewer than one).
    """
    want = max(MIN_COPIES, math.ceil(L2_MULTIPLE * l2 / max(read_bytes, 1)))
    fit = max(1, budget_bytes // max(alloc_bytes, 1))
    return min(want, fit, MAX_COPIES)


def iterations(estimate_ms: float, target_ms: float, min_iters: int, max_iters: int) -> int:
    """Calls to time: about ``target_ms`` of work, within [min_iters, max_iters]."""
    if estimate_ms <= 0:
        return max_iters
    return max(min_iters, min(max_iters, math.ceil(target_ms / estimate_ms)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_calls(calls: Sequence[Callable], iters: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``iters`` calls, cycling through ``calls``."""
    n = len(calls)
    if device.type != "cuda":
        times = []
        for i in range(iters):
            t0 = time.perf_counter()
            calls[i % n]()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        calls[i % n]()
        ends[i].record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _capture(thunks: Sequence[Callable], device: torch.device) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of one call per input copy (warmed up on a side stream first,
    as capture requires)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for run in thunks:
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for run in thunks:
            run()
    return graph


def measure(thunks: Sequence[Callable], device: torch.device, *, target_ms: float = 100.0,
            min_iters: int = 5, max_iters: int = 200, graph: bool = False) -> Timing:
    """Median time of one call, cycling through ``thunks`` (one per input copy).

    Warm-up: one call per copy (first calls compile and autotune), then one
    more round that estimates the time per call and so the iteration count.
    ``graph``: capture one call per copy into a CUDA graph and time replays
    (per call = replay / copies).
    """
    per_call = 1  # calls per timed unit
    units: Sequence[Callable] = thunks
    if graph:
        g = _capture(thunks, device)
        units, per_call = [g.replay], len(thunks)
    for run in units:
        run()
    _sync(device)
    estimate = statistics.mean(_time_calls(units, len(units), device))
    n = iterations(estimate, target_ms, min_iters, max_iters)
    with nvtx_range(f"timed x{n * per_call}"):
        times = _time_calls(units, n, device)
    samples = [t / per_call for t in times]
    return Timing(statistics.median(samples), n * per_call, graph, samples)


@contextlib.contextmanager
def profiled(device: torch.device):
    """``torch.cuda.profiler.start()/stop()`` around the block (on CUDA): with
    ``nsys profile --capture-range=cudaProfilerApi`` only the block is captured."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.profiler.start()
    try:
        yield
    finally:
        torch.cuda.profiler.stop()
