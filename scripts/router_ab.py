#!/usr/bin/env python3
"""The router's kernels (``ts_moe.use_router_kernel``) against the default path,
alone and inside the decode block.

    python scripts/router_ab.py [--T 1,4,16,64]

For each moe_block model (Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3; the suite's
cases and inputs, ``bench.moe_block.suite_inputs``) and token count: the logits
alone, ``F.linear`` then the router kernel (the sm_90 backends of the path table,
``ts_moe.ops.paths``); the routing alone, the one-CTA ``route_slots`` then ``route_topk`` +
``sort_slots``
(two launches; twenty calls per CUDA graph each); and the block
(``bench.moe_block.stages_graph_ms``) with
:func:`ts_moe.use_router_kernel` off, on, and off again (the spread between
the two "off" columns is the noise; "on" is the op's choice, ``F.linear``
where the kernel would read more than
``csrc_free_kernels.routing.router_sm90_launch.ROUTER_KERNEL_MAX_READ``).
µs per call.  The kernel's logits are
checked against float64 first (relative error per row).  Needs an sm_90 GPU.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.moe_block import stages_graph_ms, suite_inputs  # noqa: E402
from bench.timing import measure  # noqa: E402
from ts_moe import ops  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", default="1,4,16,64", help="token counts")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("scripts/router_ab.py: needs a CUDA GPU; torch sees none here", file=sys.stderr)
        return 2
    from csrc_free_kernels.routing import route_sm90_launch as route_sm90
    from ts_moe.ops import Op, paths
    from ts_moe.ops.backend import run_first

    table = paths.TABLE[paths.Path.KERNEL_SM90]  # the shipped backends, named

    def kernel(op, *args):
        return run_first((table[op],), *args)

    dev = torch.device("cuda")
    print("| model | T | F.linear | router kernel | route_slots | route_topk + sort_slots "
          "| block, kernels off | on | off again |\n|---|---|---|---|---|---|---|---|---|")
    for model, tokens, inp in suite_inputs(map(int, args.T.split(",")), dev):
        exact = inp.x.double() @ inp.router.double().t()
        got = kernel(Op.ROUTER_LOGITS, inp.x, inp.router).double()
        worst = ((got - exact).norm(dim=1) / exact.norm(dim=1)).max().item()
        if worst > 1e-2:
            print(f"{model.name} T={tokens}: router kernel off by {worst:.3g} (rel. per row)",
                  file=sys.stderr)
            return 1
        row = [measure([lambda: fn(inp.x, inp.router)] * 20, dev, graph=True, target_ms=20).ms
               for fn in (F.linear, lambda x, w: kernel(Op.ROUTER_LOGITS, x, w))]
        logits = F.linear(inp.x, inp.router)
        lanes = route_sm90.lane_width(model.experts)

        def split():
            _, ids = table[Op.ROUTE_TOPK].run(logits, inp.top_k, lanes)
            return kernel(Op.SORT_SLOTS, ids, model.experts)

        if route_sm90.fits(tokens * inp.top_k, model.experts):  # the one-CTA kernel's slots
            for routing in (lambda: kernel(Op.ROUTE_SLOTS, logits, inp.top_k), split):
                row.append(measure([routing] * 20, dev, graph=True, target_ms=20).ms)
        else:
            row += [float("nan")] * 2
        for enabled in (False, True, False):
            previous = ops.use_router_kernel(enabled)
            try:
                row.append(stages_graph_ms(inp, dev))
            finally:
                ops.use_router_kernel(previous)
        print(f"| {model.name} | {tokens} | " + " | ".join(f"{ms * 1e3:.1f}" for ms in row)
              + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
