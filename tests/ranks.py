"""Run a function on the ranks of a fresh process group, one process each."""

import os
import tempfile

import torch
import torch.multiprocessing as mp


def _rank(rank, world, init_file, out_dir, init, body):
    init(rank, world, f"file://{init_file}")
    try:
        result = body(rank, world)
    except Exception as exc:  # reported by the test, not lost in the child
        result = {"crash": f"{type(exc).__name__}: {exc}"}
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    torch.distributed.destroy_process_group()


def run_ranks(world: int, init, body) -> list:
    """``body(rank, world)`` on ``world`` spawned processes after ``init(rank,
    world, init_method)`` (which calls ``init_process_group``); the ranks'
    results in rank order.  A rank that raised fails the calling test."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(world, os.path.join(d, "init"), d, init, body), nprocs=world)
        results = [torch.load(os.path.join(d, f"{r}.pt")) for r in range(world)]
    for r, result in enumerate(results):
        assert not (isinstance(result, dict) and "crash" in result), \
            f"rank {r}: {result['crash']}"
    return results
