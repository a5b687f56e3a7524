"""Expert parallelism over NCCL: every GPU of the machine a rank (one GPU: a
group of one, which still runs the exchange and the CUDA-graph capture).

Outputs and gradients equal the single-GPU layer's on all the ranks' tokens
(bf16: relative error <= 1e-2 per row); the capacity mode is captured in a CUDA
graph and replayed on new tokens.  NVLink multicast stays off
(``NCCL_NVLS_ENABLE=0``), as the machines here require.
"""

import os

import pytest
import torch
import torch.distributed as dist

import ts_moe
from ts_moe.distributed import ExpertParallelMoE

from .helpers import rel_err
from .ranks import run_ranks

pytestmark = pytest.mark.gpu  # skipped without an sm_90 GPU (conftest)
E, H, I, TOP_K = 16, 1024, 512, 2
BF16 = torch.bfloat16


def _weights():
    g = torch.Generator().manual_seed(0)
    return {"router": torch.randn(E, H, generator=g).to(BF16),
            "gate_up_proj": (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(BF16),
            "down_proj": (torch.randn(E, H, I, generator=g) * I**-0.5).to(BF16)}


def _tokens(world):
    """Tokens per rank, all the tokens, and an output gradient for them."""
    g = torch.Generator().manual_seed(1)
    counts = [300 + 97 * r for r in range(world)]
    return (counts, torch.randn(sum(counts), H, generator=g).to(BF16),
            torch.randn(sum(counts), H, generator=g).to(BF16))


def _nccl(rank, world, init_method):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def _scenarios(rank, world):
    counts, x_all, grad_all = _tokens(world)
    rows = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
    x = x_all[rows].cuda().requires_grad_()
    weights = {k: v.cuda() for k, v in _weights().items()}
    result = {}
    exact = ExpertParallelMoE.from_weights(weights, TOP_K)
    out = exact(x)
    out.backward(grad_all[rows].cuda())
    result["exact"] = {"out": out.detach().cpu(), "dx": x.grad.cpu(),
                       "router": exact.router.grad.float().cpu(),
                       "gate_up": exact.gate_up_proj.grad.cpu(),
                       "down": exact.down_proj.grad.cpu(), "first": exact.first_expert}
    capped = ExpertParallelMoE.from_weights(weights, TOP_K, capacity=max(counts) * TOP_K)
    with torch.no_grad():
        static = x.detach().clone()
        capped(static)  # warm up (compiles the kernels) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = capped(static)
        static.copy_(torch.flip(x.detach(), [0]))  # new tokens, replayed
        graph.replay()
        result["graph"] = (captured.cpu(), capped(static).cpu(), int(capped.dropped_slots))
    return result


@pytest.fixture(scope="module")
def ranks():
    world = torch.cuda.device_count()
    return world, run_ranks(world, _nccl, _scenarios)


def test_nccl_matches_one_gpu(ranks):
    world, results = ranks
    counts, x_all, grad_all = _tokens(world)
    layer = ts_moe.MoE.from_weights({k: v.cuda() for k, v in _weights().items()}, TOP_K)
    for p in layer.parameters():
        p.requires_grad_()
    x = x_all.cuda().requires_grad_()
    out = layer(x)
    out.backward(grad_all.cuda())
    per_rank = E // world
    for r, result in enumerate(results):
        got = result["exact"]
        rows = slice(sum(counts[:r]), sum(counts[:r + 1]))
        assert rel_err(got["out"], out[rows].detach().cpu()) <= 1e-2
        assert rel_err(got["dx"], x.grad[rows].cpu()) <= 1e-2
        experts = slice(got["first"], got["first"] + per_rank)
        assert rel_err(got["gate_up"], layer.gate_up_proj.grad[experts].cpu()) <= 1e-2
        assert rel_err(got["down"], layer.down_proj.grad[experts].cpu()) <= 1e-2
    router = sum(result["exact"]["router"] for result in results)  # replicated: summed
    assert rel_err(router, layer.router.grad.float().cpu()) <= 1e-2


def test_capacity_mode_replays_in_a_cuda_graph(ranks):
    _, results = ranks
    for result in results:
        captured, eager, dropped = result["graph"]
        assert dropped == 0
        assert torch.equal(captured, eager)
