"""``python -m bench.expert_parallel``: time the expert-parallel MoE layer.

    python -m bench.expert_parallel                    # every GPU a rank (NCCL), both models
    python -m bench.expert_parallel --world 2 --T 1,16,4096 --mode capacity
    python -m bench.expert_parallel --device cpu --world 2   # gloo smoke run (CPU)

Each rank holds E / W experts of a Mixtral-8x7B or DeepSeek-V3 layer
(:class:`ts_moe.distributed.ExpertParallelMoE`, random bf16 weights) and runs
the forward on ``T`` random tokens of its own.  Per case: ms per call (the
slowest rank's mean over ``--iters`` calls), the exchange alone with the same
split sizes (dispatch and return: ``all_to_all_single`` twice) and its share of
the call, the bytes it moves to other ranks per rank, and those bytes against
the all-to-all bandwidth measured on a 256 MB buffer in the same run.  NVLink
multicast stays off (``NCCL_NVLS_ENABLE=0``).  Rank 0 prints the table and
writes ``<out-dir>/<gpu>-x<W>-expert_parallel.json`` with the run's provenance
(:mod:`bench.provenance`).  The default out-dir is outside the checkout
(:func:`bench.report.default_out_dir`); a CPU run saves nothing unless
``--out-dir`` is given.
"""

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import provenance, report
from .cases import MODELS, SMOKE_MODELS

EP_MODELS = ("mixtral-8x7b", "deepseek-v3")
EP_T = (1, 16, 128, 1024, 4096, 16384)
BANDWIDTH_BYTES = 256 << 20


def _csv(kind):
    return lambda text: [kind(v) for v in text.split(",") if v.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.expert_parallel",
                                description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--world", type=int, default=0, help="ranks (default: every GPU; CPU: 2)")
    p.add_argument("--models", type=_csv(str), default=None)
    p.add_argument("--T", type=_csv(int), default=None, help="tokens per rank")
    p.add_argument("--mode", choices=("exact", "capacity"), default="exact")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out-dir", type=Path,
                   help=f"where the JSON goes (default {report.default_out_dir()}; on the CPU "
                        "nothing is saved unless this is given)")
    return p


def _timed(fn, iters: int, device: torch.device) -> float:
    """Mean ms per call over ``iters`` calls after two, the slowest rank's."""
    for _ in range(2):
        fn()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = torch.tensor([(time.perf_counter() - start) * 1e3 / iters], dtype=torch.float64,
                      device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def _bandwidth(world: int, device: torch.device, dtype, iters: int) -> float:
    """GB/s each rank sends to the others in a 256 MB all_to_all_single."""
    rows = BANDWIDTH_BYTES // (world * 1024 * dtype.itemsize) * world
    x = torch.randn(rows, 1024, device=device).to(dtype)
    out = torch.empty_like(x)
    ms = _timed(lambda: dist.all_to_all_single(out, x), iters, device)
    return x.numel() * dtype.itemsize * (world - 1) / world / ms / 1e6


def _rank_main(rank: int, world: int, init_file: str, args, out_file: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from ts_moe.distributed import ExpertParallelMoE, all_to_all_rows

    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{init_file}", rank=rank, world_size=world)
    dtype = torch.bfloat16
    models = args.models or (EP_MODELS if device.type == "cuda" else tuple(SMOKE_MODELS))
    table = {**MODELS, **SMOKE_MODELS}
    bandwidth = _bandwidth(world, device, dtype, 5)
    records = []
    for name in models:
        m = table[name]
        g = torch.Generator(device=device).manual_seed(rank)
        for tokens in args.T or (EP_T if device.type == "cuda" else (4, 64)):
            capacity = None if args.mode == "exact" else max(1, tokens * m.top_k)
            layer = ExpertParallelMoE(m.hidden, m.inter, m.experts, m.top_k, capacity=capacity,
                                      device=device, dtype=dtype)
            x = torch.randn(tokens, m.hidden, device=device, generator=g).to(dtype)
            send, recv = layer.exchange_rows(x)
            with torch.no_grad():
                ms = _timed(lambda: layer(x), args.iters, device)
            if capacity is not None:  # the capacity mode moves W * C rows each way
                send = recv = [capacity] * world
            rows = torch.empty(sum(send), m.hidden, device=device, dtype=dtype)
            exchange_ms = _timed(lambda: all_to_all_rows(
                all_to_all_rows(rows, sum(recv), recv, send), sum(send), send, recv),
                args.iters, device)
            moved = (sum(send) - send[rank] + sum(recv) - recv[rank]) * m.hidden * 2
            total = torch.tensor([moved], dtype=torch.float64, device=device)
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
            records.append({"model": name, "T": tokens, "mode": args.mode, "ms": ms,
                            "exchange_ms": exchange_ms, "exchange_share": exchange_ms / ms,
                            "bytes_per_rank": int(total.item()),
                            "exchange_gbps": total.item() / exchange_ms / 1e6,
                            "alltoall_gbps": bandwidth})
            del layer
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(records, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    argv_used = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv_used)
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if world < 1 or (args.device == "cuda" and world > torch.cuda.device_count()):
        print(f"python -m bench.expert_parallel: --world {world} needs that many GPUs "
              f"({torch.cuda.device_count()} here)", file=sys.stderr)
        return 2
    prov = provenance.collect(torch.device(args.device, 0) if args.device == "cuda" else None)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "records.json")
        mp.spawn(_rank_main, args=(world, os.path.join(d, "init"), args, out), nprocs=world)
        records = json.loads(Path(out).read_text())
    gpu = (torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu")
    result = {"suite": "expert_parallel", "device": gpu, "world": world,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "cuda": torch.version.cuda, "provenance": prov,
              "command": shlex.join(["python", "-m", "bench.expert_parallel", *argv_used]),
              "cases": records}
    print(f"| model | T per rank | mode | ms | exchange ms | share | MB moved per rank | "
          f"exchange GB/s | all-to-all GB/s |\n|---|---|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['model']} | {r['T']} | {r['mode']} | {r['ms']:.3f} | {r['exchange_ms']:.3f} "
              f"| {r['exchange_share']:.0%} | {r['bytes_per_rank'] / 1e6:.1f} | "
              f"{r['exchange_gbps']:.0f} | {r['alltoall_gbps']:.0f} |")
    if args.out_dir is None and args.device == "cpu":
        print("not saved (a CPU run; --out-dir to save)", file=sys.stderr)
        return 0
    out_dir = args.out_dir or report.default_out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{report.sanitize(gpu)}-x{world}-expert_parallel.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
