#!/usr/bin/env python3
"""Where a training step of the MoE layer spends its GPU time, kernel by kernel.

    python scripts/training_profile.py MODEL:T[:ROUTING] ... [--backends A,B] [--json OUT]

For each case and each backend of the ``training`` suite's layer cases (default
``ts_moe`` and ``torch_layer``), on the suite's inputs (``torch.randn``, the same tensors for every
backend): one step (forward, then ``autograd.grad`` of x, both stacks and the routing
weights) is checked against the fp32 reference (``--no-check``: not), warmed up, timed (CUDA events, median of
``--iters``), then profiled once with torch.profiler's CUDA activity; the kernels are
summed by name (calls, total microseconds, share of the step) and the largest printed.
The peak memory of one step is printed beside its time.  Needs a CUDA GPU.
"""

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench import cases, training  # noqa: E402


def rel_err(got, ref) -> float:
    got, ref = got.float(), ref.float()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def time_step(step, iters: int) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_table(step) -> list:
    """(name, calls, total us) of one profiled step, largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    calls, total = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            calls[ev.name] += 1
            total[ev.name] += ev.device_time
    return sorted(((n, calls[n], total[n]) for n in total), key=lambda r: -r[2])


def _step(factories, name: str, case, device, inp):
    """The backend's step; ``ts_moe_ops``: ts_moe with each op's own gradient (the layer's
    one-node backward, :mod:`ts_moe.experts_grad`, switched off): the A/B of that node."""
    if name != "ts_moe_ops":
        return factories[name](case, device)(inp)
    from ts_moe import experts_grad

    step = factories["ts_moe"](case, device)(inp)

    def without_node():
        real, experts_grad.wants_node = experts_grad.wants_node, lambda *t: False
        try:
            return step()
        finally:
            experts_grad.wants_node = real
    return without_node


def profile_case(spec: str, names: list, args) -> dict:
    model, tokens, *routing = spec.split(":")
    case = cases.make_case(cases.model_named(model), "layer", int(tokens),
                           routing[0] if routing else "uniform", weight_layout="hf",
                           step="fwd+bwd")
    device = torch.device("cuda")
    inp = training.make_layer_train_inputs(case, device)
    ref = None if args.no_check else training.reference_layer_train(inp)
    factories = training.training_backends()
    report = {"case": case.describe(), "backends": {}}
    print(f"\n##### {case.describe()}")
    for name in names:
        step = _step(factories, name, case, device, inp)
        got = step()
        errs = [] if ref is None else [rel_err(g, r) for g, r in zip(got, ref)]
        del got
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        ms = time_step(step, args.iters)
        table = kernel_table(step)
        gpu_us = sum(r[2] for r in table)
        print(f"== {name}: {ms:.3f} ms/step (kernels {gpu_us / 1e3:.3f} ms), peak +"
              f"{peak / 2**30:.2f} GiB, rel err out/dx/dgu/ddown/dw = "
              + " ".join(f"{e:.1e}" for e in errs))
        for kname, n, us in table[:args.top]:
            print(f"  {us / 1e3:8.3f} ms {100 * us / gpu_us:5.1f}% x{n:<3d} {kname[:110]}")
        report["backends"][name] = {"ms": ms, "kernel_ms": gpu_us / 1e3, "peak_bytes": peak,
                                    "rel_err": errs,
                                    "kernels": [[k, n, us] for k, n, us in table]}
        del step
        torch.cuda.empty_cache()
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="+", help="MODEL:T[:ROUTING]")
    p.add_argument("--backends", default="ts_moe,torch_layer")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("training_profile.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    reports = []
    for spec in args.cases:
        reports.append(profile_case(spec, args.backends.split(","), args))
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"device": torch.cuda.get_device_name(), "cases": reports}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
