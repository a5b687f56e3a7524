"""Expert parallelism on the CPU: 2 and 4 processes over gloo, on the reference path.

Every rank builds :class:`ts_moe.distributed.ExpertParallelMoE` from one
layer's weights, runs its own tokens forward and backward, and the results
must equal the single-process :class:`ts_moe.MoE` on all the ranks' tokens at
once: outputs and input gradients row for row, each rank's expert gradients
as its slice of the whole layer's, the router's summed over ranks.  Float64,
so "equal" is to rounding.  One spawn per group size runs every scenario.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ts_moe
from ts_moe.distributed import ExpertParallelMoE

from .ranks import run_ranks

E, H, I, TOP_K = 8, 32, 16, 2
TOKENS = [5, 0, 9, 3]  # tokens per rank (a rank with none)
SMALL_CAPACITY = 2


def _layer_weights():
    g = torch.Generator().manual_seed(0)
    return {"router": torch.randn(E, H, generator=g, dtype=torch.float64),
            "gate_up_proj": torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) * H**-0.5,
            "down_proj": torch.randn(E, H, I, generator=g, dtype=torch.float64) * I**-0.5}


def _inputs(world):
    g = torch.Generator().manual_seed(1)
    counts = [TOKENS[r % 4] for r in range(world)]
    x = torch.randn(sum(counts), H, generator=g, dtype=torch.float64)
    grad = torch.randn(sum(counts), H, generator=g, dtype=torch.float64)
    return counts, x, grad


def _run_mode(rank, world, capacity):
    counts, x_all, grad_all = _inputs(world)
    lo = sum(counts[:rank])
    x = x_all[lo:lo + counts[rank]].clone().requires_grad_()
    layer = ExpertParallelMoE.from_weights(_layer_weights(), TOP_K, capacity=capacity)
    out = layer(x)
    out.backward(grad_all[lo:lo + counts[rank]])
    return {"out": out.detach(), "dx": x.grad, "router": layer.router.grad,
            "gate_up": layer.gate_up_proj.grad, "down": layer.down_proj.grad,
            "dropped": int(layer.dropped_slots), "first": layer.first_expert,
            "local": layer.local_experts}


def _expect_error(fn):
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _scenarios(rank, world):
    results = {"exact": _run_mode(rank, world, None),
               "big_capacity": _run_mode(rank, world, max(TOKENS) * TOP_K),
               "small_capacity": _run_mode(rank, world, SMALL_CAPACITY)}
    # a second exact call, for determinism
    results["exact_again"] = _run_mode(rank, world, None)
    results["disagree"] = _expect_error(
        lambda: ExpertParallelMoE(H, I, E, 1 if rank == 1 else TOP_K))
    results["indivisible"] = _expect_error(lambda: ExpertParallelMoE(H, I, world + 1, 1))
    return results


def _gloo(rank, world, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return request.param, run_ranks(request.param, _gloo, _scenarios)


def _reference(world):
    """The single-process layer on every rank's tokens: output, grads."""
    counts, x_all, grad_all = _inputs(world)
    layer = ts_moe.MoE.from_weights(_layer_weights(), TOP_K)
    for p in layer.parameters():
        p.requires_grad_()
    x = x_all.clone().requires_grad_()
    out = layer(x)
    out.backward(grad_all)
    return counts, out.detach(), x.grad, layer


@pytest.mark.parametrize("mode", ["exact", "big_capacity"])
def test_matches_single_process(ranks, mode):
    world, results = ranks
    counts, out, dx, layer = _reference(world)
    lo = 0
    for r, result in enumerate(results):
        got = result[mode]
        rows = slice(lo, lo + counts[r])
        torch.testing.assert_close(got["out"], out[rows], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["dx"], dx[rows], rtol=1e-12, atol=1e-12)
        experts = slice(got["first"], got["first"] + got["local"])
        torch.testing.assert_close(got["gate_up"], layer.gate_up_proj.grad[experts],
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["down"], layer.down_proj.grad[experts],
                                   rtol=1e-12, atol=1e-12)
        assert got["dropped"] == 0
        lo += counts[r]
    router = sum(result[mode]["router"] for result in results)  # replicated: summed
    torch.testing.assert_close(router, layer.router.grad, rtol=1e-12, atol=1e-12)
    assert sorted(r[mode]["first"] for r in results) == [i * E // world for i in range(world)]


def test_exact_is_deterministic(ranks):
    _, results = ranks
    for result in results:
        for key in ("out", "dx", "router", "gate_up", "down"):
            assert torch.equal(result["exact"][key], result["exact_again"][key]), key


def test_small_capacity_reports_drops_and_keeps_the_rest(ranks):
    """Slots past a destination's capacity are counted on their rank and
    contribute zero; a token whose slots all fit is computed exactly."""
    world, results = ranks
    counts, out, _, layer = _reference(world)
    weights_all = _layer_weights()
    local = E // world
    lo, total_dropped = 0, 0
    for r, result in enumerate(results):
        x = _inputs(world)[1][lo:lo + counts[r]]
        _, experts = ts_moe.route(F.linear(x, weights_all["router"]), TOP_K)
        flat = experts.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        dest = flat[order] // local
        place = torch.zeros_like(flat)
        for d in range(world):  # the slot's place in its destination's block
            mine = (dest == d).nonzero().flatten()
            place[order[mine]] = torch.arange(mine.numel())
        kept = (place < SMALL_CAPACITY).view(-1, TOP_K)
        expected = int((~kept).sum())
        assert result["small_capacity"]["dropped"] == expected
        total_dropped += expected
        whole = kept.all(1)
        torch.testing.assert_close(result["small_capacity"]["out"][whole],
                                   out[lo:lo + counts[r]][whole], rtol=1e-12, atol=1e-12)
        lo += counts[r]
    assert total_dropped > 0  # the scenario does exercise dropping


def test_bad_configurations_are_named_on_every_rank(ranks):
    _, results = ranks
    for result in results:
        assert result["disagree"].startswith("ValueError: ranks disagree on top_k")
        assert result["indivisible"].startswith("ValueError: num_experts")
        assert "divisible" in result["indivisible"]


def test_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ExpertParallelMoE(H, I, E, TOP_K)


@pytest.mark.parametrize("names", ["v4", "v5"])
def test_loader_reads_a_ranks_experts(tmp_path, names):
    path = ts_moe.make_tiny_moe_checkpoint(tmp_path / "m", layers=1, experts=4, names=names)
    full = ts_moe.load_mixtral_experts(path, layers=[0], device="cpu")[0]
    part = ts_moe.load_mixtral_experts(path, layers=[0], device="cpu", experts=range(2, 4))[0]
    assert torch.equal(part["router"], full["router"])
    for key in ("gate_up_proj", "down_proj"):
        assert torch.equal(part[key], full[key][2:4])
    for bad in (range(3, 5), range(0), [0, 1]):
        with pytest.raises(ValueError, match="experts"):
            ts_moe.load_mixtral_experts(path, layers=[0], device="cpu", experts=bad)
