"""Expert parallelism when one rank's arguments differ or fail: every rank raises
(the same ValueError where the ranks disagree), none aborts inside gloo or waits
in a collective for a rank that gave up, and the group stays usable.

The ranks are spawned processes (``tests/ranks.py``), so an abort in one
(gloo's SIGABRT on mismatched dtypes) fails the test instead of killing
pytest; the process group's timeout is short, so a rank left waiting fails it
in two minutes instead of half an hour (long enough for a rank that a busy
machine slows: it bounds a hang, not a speed).
"""

import datetime
import functools

import pytest
import torch
import torch.distributed as dist

import ts_moe
from ts_moe.distributed import ExpertParallelMoE

from .ranks import run_ranks

E, H, I, TOP_K = 4, 16, 8, 2
TOKENS = [3, 5]


def _weights(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return {"router": torch.randn(E, H, generator=g, dtype=dtype),
            "gate_up_proj": torch.randn(E, 2 * I, H, generator=g, dtype=dtype) * H**-0.5,
            "down_proj": torch.randn(E, H, I, generator=g, dtype=dtype) * I**-0.5}


def _tokens(rank, dtype=torch.float64):
    x = torch.randn(sum(TOKENS), H, generator=torch.Generator().manual_seed(1), dtype=dtype)
    return x[sum(TOKENS[:rank]):sum(TOKENS[:rank + 1])]


def _outcome(fn):
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _build_and_run(weights, x, **kw):
    layer = ExpertParallelMoE.from_weights(weights, TOP_K, **kw)
    layer(x)  # where construction let mismatched ranks through, the exchange aborts


def _scenarios(rank, world, checkpoint):
    dtype = torch.float32 if rank == 0 else torch.bfloat16
    results = {"dtype": _outcome(lambda: _build_and_run(_weights(dtype), _tokens(rank, dtype)))}
    device = "meta" if rank == 1 else "cpu"
    results["device"] = _outcome(lambda: ExpertParallelMoE(H, I, E, TOP_K, device=device)(
        _tokens(rank, torch.float32).to(device)))
    results["arguments"] = _outcome(lambda: ExpertParallelMoE(H, I, E, 0 if rank else TOP_K))
    weights = _weights()
    if rank == 1:
        del weights["down_proj"]
    results["weights"] = _outcome(lambda: ExpertParallelMoE.from_weights(weights, TOP_K))
    weights = _weights()
    if rank == 1:  # 3 of the 4 experts: neither all of them nor this rank's 2
        weights = {k: v[:3] if k != "router" else v for k, v in weights.items()}
    results["shape"] = _outcome(lambda: ExpertParallelMoE.from_weights(weights, TOP_K))
    path = checkpoint if rank == 0 else checkpoint + "-missing"
    results["checkpoint"] = _outcome(
        lambda: ExpertParallelMoE.from_pretrained(path, 0, device="cpu"))
    # exact mode: rank 1's input refused at the sync, then a good call on both
    layer = ExpertParallelMoE.from_weights(_weights(), TOP_K)
    bad = _tokens(rank).float() if rank == 1 else _tokens(rank)
    with torch.no_grad():
        results["input"] = _outcome(lambda: layer(bad))
        results["after"] = layer(_tokens(rank))
    # last: a rank that raised outside the agreement would leave the other waiting in it
    results["huge"] = _outcome(lambda: ExpertParallelMoE(2**64 if rank else H, I, E, TOP_K))
    return results


def _gloo_short_timeout(rank, world, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = ts_moe.make_tiny_moe_checkpoint(tmp_path_factory.mktemp("ep") / "ckpt", layers=1,
                                           hidden=H, intermediate=I, experts=E)
    return run_ranks(2, _gloo_short_timeout, functools.partial(_scenarios, checkpoint=str(path)))


def test_an_fp32_rank_and_a_bf16_rank_raise_the_same_value_error(results):
    got = [r["dtype"] for r in results]
    assert got[0] == got[1], got
    assert got[0] == ("ValueError: ranks disagree on dtype: dtype per rank "
                      "['torch.float32', 'torch.bfloat16']")


def test_ranks_on_different_device_types_raise_the_same_value_error(results):
    got = [r["device"] for r in results]
    assert got[0] == got[1] == ("ValueError: ranks disagree on device type: "
                                "device type per rank ['cpu', 'meta']")


def test_a_rank_whose_arguments_fail_tells_the_others(results):
    reason = "ValueError: top_k must be a positive int, got 0"
    assert results[1]["arguments"] == reason
    assert results[0]["arguments"] == f"ValueError: the layer was not built on any rank: " \
                                      f"rank 1: {reason}"
    assert results[1]["weights"] == "KeyError: 'down_proj'"
    assert results[0]["weights"] == "ValueError: the layer was not built on any rank: " \
                                    "rank 1: KeyError: 'down_proj'"
    shape = "ValueError: gate_up_proj: expected (4 or 2, 16, 16) for the router's E = 4 " \
            "over 2 ranks and H = 16, got (3, 16, 16)"
    assert results[1]["shape"] == shape
    assert results[0]["shape"] == f"ValueError: the layer was not built on any rank: " \
                                  f"rank 1: {shape}"
    assert results[1]["checkpoint"].startswith("FileNotFoundError: ")
    assert results[0]["checkpoint"].startswith(
        "ValueError: the layer was not built on any rank: rank 1: FileNotFoundError: ")


def test_a_refused_input_raises_on_every_rank_and_the_next_call_runs(results):
    assert results[1]["input"] == ("TypeError: x must be torch.float64 on cpu, got "
                                   "torch.float32 on cpu")
    assert results[0]["input"] == ("RuntimeError: rank(s) [1] refused their input to this call "
                                   "(their own errors say why); no rank ran it")
    layer = ts_moe.MoE.from_weights(_weights(), TOP_K)
    with torch.no_grad():
        want = layer(torch.cat([_tokens(r) for r in range(2)]))
    torch.testing.assert_close(torch.cat([r["after"] for r in results]), want,
                               rtol=1e-12, atol=1e-12)


def test_a_size_past_64_bits_on_one_rank_is_refused_in_the_agreement(results):
    """2**64 passes the argument checks but not into the agreement's int64 row: every
    rank raises the same ValueError from the agreement, none waits in it."""
    got = [r["huge"] for r in results]
    assert got[0] == got[1] == ("ValueError: hidden_size on rank 1: not a 64-bit integer; the "
                                "layer was not built on any rank"), got
