"""A weight stack that broadcasts one matrix over its experts (stride 0 on E, as
``w.expand(E, K, N)``) is read as that one matrix: a call of a few rows never copies the
broadcast whole (2**24 experts took 8.6 GB for a 4-row call), and gives the one matrix's
product on the rows up to the last segment end, zeros after, as the dense stack would."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import ts_moe

E = 2**16
BF16 = torch.bfloat16


def _largest_allocation(fn):
    """``(fn(), the largest single allocation it made, in bytes)``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return out, max((e.self_cpu_memory_usage for e in prof.events()), default=0)


def _offs(ends: dict) -> torch.Tensor:
    """offs (E,) int32: 0, then each ``{expert: end}`` from that expert on."""
    offs = torch.zeros(E, dtype=torch.int32)
    for expert, end in sorted(ends.items()):
        offs[expert:] = end
    return offs


@pytest.mark.parametrize("op", ["grouped_gemm", "grouped_gemm_swiglu"])
@pytest.mark.parametrize("ends", [{10: 2, 100: 4}, {7: 5, 9: 3}],
                         ids=["increasing", "the last end below the largest"])
def test_a_broadcast_weight_is_one_matrix(op, ends):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 16, generator=g).to(BF16)
    w = torch.randn(1, 16, 32, generator=g).to(BF16)
    offs = _offs(ends)
    last = max(ends.values())  # the backends' last segment end: cummax of the clamped offs
    if op == "grouped_gemm":
        out, largest = _largest_allocation(lambda: ts_moe.grouped_gemm(a, w.expand(E, 16, 32),
                                                                       offs))
        dense = ts_moe.grouped_gemm(a, w, torch.tensor([last], dtype=torch.int32))
    else:
        gate_up = w.transpose(-2, -1)  # (1, 2I, H)
        out, largest = _largest_allocation(lambda: ts_moe.grouped_gemm_swiglu(
            a, gate_up.expand(E, 32, 16), offs))
        dense = ts_moe.grouped_gemm_swiglu(a, gate_up, torch.tensor([last], dtype=torch.int32))
    assert torch.equal(out, dense)
    assert (out[last:] == 0).all() and (out[:last] != 0).any()
    assert largest < E * 16, largest  # the broadcast whole is E * 1 KiB


def test_experts_forward_with_broadcast_experts():
    """The layer's experts, 2**16 of them all one matrix pair, for 4 tokens: the same
    output as that one expert for every slot, no stack copied."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, generator=g).to(BF16)
    gate_up = torch.randn(1, 32, 16, generator=g).to(BF16)
    down = torch.randn(1, 16, 16, generator=g).to(BF16)
    ids = torch.randint(0, E, (4, 2), generator=g)
    weights = torch.rand(4, 2, generator=g)
    out, largest = _largest_allocation(lambda: ts_moe.experts_forward(
        x, ids, weights, gate_up.expand(E, 32, 16), down.expand(E, 16, 16)))
    one = ts_moe.experts_forward(x, torch.zeros_like(ids), weights, gate_up, down)
    assert torch.equal(out, one)
    assert largest < E * 16, largest  # sort_slots' offs and ids are E * 8 bytes at most
