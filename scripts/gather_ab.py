#!/usr/bin/env python3
"""The layer's gathered gate_up GEMM by the op against the gathering sm_90 variant.

    python scripts/gather_ab.py [--models qwen3,mixtral,deepseek] [--T 1024,4096,16384]
                                [--rounds 7] [--json OUT]

For each model (the bench's shapes, ``bench.cases.MODELS``) and token count: routed
``torch.randn`` tokens (the bench's uniform routing, its slot order from
``ts_moe.sort_slots``), then the gate_up projection of the rows in expert order,
``x[token_index] @ W_gate_up[e]``, two ways: ``ts_moe.grouped_gemm(x, w, offs,
a_index=...)`` as a call takes it today (the row kernel writes the gathered copy, the
GEMM reads it, with ``prefetch_weights``), and the variant awaiting its A/B,
``csrc_free_kernels.hopper.grouped_gemm_sm90_gather`` (the GEMM reads the rows itself),
in the tiles ``choose_config`` picks; the plain GEMM (the training forward) and the
fused SwiGLU one (inference) where the shapes take it.  The two outputs are compared
first; the times are medians over interleaved rounds (``bench.timing.measure``, the
order alternating), each call on the next of enough token copies that none is in L2.
ms per call.  Needs an sm_90 GPU.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench import cases  # noqa: E402
from bench.timing import l2_bytes, measure  # noqa: E402


def _model(name: str):
    found = [m for m in cases.MODELS if m.startswith(name)]
    if len(found) != 1:
        raise SystemExit(f"scripts/gather_ab.py: model {name!r} matches {found or 'nothing'}")
    return cases.MODELS[found[0]]


def pairs(model, T: int):
    """``[(kind, config name, op call, variant call)]`` of one case on fresh inputs."""
    import ts_moe
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as configs
    from csrc_free_kernels.hopper import grouped_gemm_sm90_gather as variant

    H, inter, E, k = model.hidden, model.inter, model.experts, model.top_k
    g = torch.Generator("cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    gate_up = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16,
                          generator=g).mul_(H ** -0.5)
    w = gate_up.transpose(-2, -1)
    slots = ts_moe.sort_slots(cases.route(T, k, E, "uniform", T).cuda(), E)
    index, offs = slots.token_index, slots.offs
    m = index.shape[0]
    plain = configs.choose_config(E, 2 * inter, H, m)

    # copies of the tokens to rotate through, so that no call finds them in L2
    xs = [x] + [x.clone() for _ in range(min(7, -(-2 * l2_bytes(x.device) // x.nbytes) - 1))]

    def variant_calls(config, n, swiglu):
        def call(xi):
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            return variant.launch(xi, w, offs, out, index, config, swiglu=swiglu)
        return [lambda xi=xi: call(xi) for xi in xs]

    found = [("plain", plain.name,
              [lambda xi=xi: ts_moe.grouped_gemm(xi, w, offs, a_index=index) for xi in xs],
              variant_calls(plain, 2 * inter, False))]
    fused = configs.swiglu_config(E, 2 * inter, H, m)
    if fused:
        found.append(("swiglu", fused.name,
                      [lambda xi=xi: ts_moe.grouped_gemm_swiglu(xi, gate_up, offs, a_index=index)
                       for xi in xs],
                      variant_calls(fused, inter, True)))
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen3,mixtral,deepseek")
    p.add_argument("--T", default="1024,4096,16384", help="token counts")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", help="write the rows (every round's times) here")
    args = p.parse_args(argv)
    models = [_model(m) for m in args.models.split(",")]
    if not torch.cuda.is_available():
        print("scripts/gather_ab.py: needs a CUDA GPU; torch sees none here", file=sys.stderr)
        return 2
    device, rows = torch.device("cuda"), []
    for model in models:
        for T in (int(t) for t in args.T.split(",")):
            for kind, config, op_calls, variant_calls in pairs(model, T):
                want, got = op_calls[0]().float(), variant_calls[0]().float()
                err = float((got - want).norm() / want.norm())
                if not err < 1e-2:
                    print(f"{model.name} T={T} {kind}: the variant differs from the op by "
                          f"{err:.2e}", file=sys.stderr)
                    return 1
                times = {"op": [], "gather": []}
                calls = {"op": op_calls, "gather": variant_calls}
                for r in range(args.rounds):
                    for name in (("op", "gather") if r % 2 == 0 else ("gather", "op")):
                        times[name].append(measure(calls[name], device, target_ms=20).ms)
                ms = {name: statistics.median(t) for name, t in times.items()}
                rows.append({"model": model.name, "T": T, "kind": kind, "config": config,
                             "ms": ms, "rounds": times, "rel_err": err})
                print(f"{model.name:14s} T={T:6d} {kind:6s} {config:11s} op {ms['op']:.3f} ms"
                      f"  gather {ms['gather']:.3f} ms  {ms['op'] / ms['gather']:.3f}x",
                      flush=True)
                if args.json:  # as the rows come: a later failure keeps them
                    Path(args.json).write_text(json.dumps(
                        {"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
