#!/usr/bin/env python3
"""The decode block with and without ``prefetch_weights``, and ``route_slots`` alone.

    python scripts/prefetch_ab.py [--T 1,16,64]

For each moe_block model (Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3; the suite's
cases and inputs, ``bench.moe_block.suite_inputs``) and token count: the block's
time under a CUDA graph (``bench.moe_block.stages_graph_ms``) with the sm_90 GEMMs' weight
prefetch as the layer sets it, then with the hint dropped (the runs of the sm_90
GEMM backends wrapped for the measurement), then as set again (the spread between the
two "on" columns is the noise); and ``ts_moe.ops.route_slots`` alone, twenty
calls per graph.  µs per call.  Needs an sm_90 GPU.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.moe_block import stages_graph_ms, suite_inputs  # noqa: E402
from bench.timing import measure  # noqa: E402
from ts_moe import ops  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", default="1,16,64", help="token counts")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("scripts/prefetch_ab.py: needs a CUDA GPU; torch sees none here", file=sys.stderr)
        return 2
    from ts_moe.ops import Op, paths

    dev = torch.device("cuda")
    table = paths.TABLE[paths.Path.KERNEL_SM90]
    backends = (table[Op.GROUPED_GEMM], table[Op.GROUPED_GEMM_SWIGLU])  # the op layer's sm_90 GEMMs

    def dropped(run):
        return lambda *a, prefetch_weights=False, **kw: run(*a, **kw)

    print("| model | T | prefetch on | off | on again | route_slots |\n|---|---|---|---|---|---|")
    for model, tokens, inp in suite_inputs(map(int, args.T.split(",")), dev):
        row = []
        for drop in (False, True, False):
            for backend in backends if drop else ():
                backend.run = dropped(backend.run)
            try:
                row.append(stages_graph_ms(inp, dev))
            finally:
                for backend in backends if drop else ():
                    del backend.run  # the class's method again
        logits = torch.nn.functional.linear(inp.x, inp.router)
        row.append(measure([lambda: ops.route_slots(logits, inp.top_k)] * 20, dev, graph=True,
                           target_ms=20).ms)
        print(f"| {model.name} | {tokens} | " + " | ".join(f"{ms * 1e3:.1f}" for ms in row)
              + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
