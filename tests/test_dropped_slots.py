"""Dropped slots: an expert id outside ``[0, E)`` (``-1``, or an expert-parallel
sentinel ``>= E``) counts for no expert and contributes zero, on every path:
the slot order (op and reference), the permutation, the expert half of the
layer, and the sm_90 routing kernel (its algorithm modelled here on the CPU,
the kernel itself by the ``gpu`` tests)."""

import pytest
import torch

import ts_moe
from ts_moe import reference

IDS = [
    torch.tensor([[-1, 0], [1, 0]]),                       # the issue's example
    torch.tensor([[-1, -1], [-1, -1], [-1, -1]]),          # every slot dropped
    torch.tensor([[2, -1], [-5, 3], [0, 9], [-1, 1]]),     # negative and past E, mixed
    torch.tensor([[3, 2], [1, 0], [-(2**62), 2**62]]),     # far outside int32
]


def _slot_order_loop(experts, num_experts):
    """(token_index, offs, inverse) by a loop: kept slots by expert in slot order,
    then the dropped ones in slot order."""
    flat = experts.reshape(-1).tolist()
    kept = [s for e in range(num_experts) for s, v in enumerate(flat) if v == e]
    order = kept + [s for s, v in enumerate(flat) if not 0 <= v < num_experts]
    counts = [flat.count(e) for e in range(num_experts)]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    inverse = torch.empty(len(flat), dtype=torch.int64)
    inverse[torch.tensor(order, dtype=torch.int64)] = torch.arange(len(flat))
    top_k = experts.shape[1]
    return torch.tensor([s // top_k for s in order], dtype=torch.int32), offs, inverse


def test_the_issue_example_counts_no_expert_for_minus_one():
    slots = ts_moe.sort_slots(torch.tensor([[-1, 0], [1, 0]]), 2)
    assert slots.offs.tolist() == [2, 3]  # expert 0: slots (0, 1), (1, 1); expert 1: (1, 0)
    assert slots.inverse.tolist()[0] == 3  # slot (0, 0) after offs[-1]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("case", range(len(IDS)))
def test_sort_slots_drops_ids_outside_the_experts(case, dtype):
    experts = IDS[case]
    if dtype == torch.int32:
        experts = experts.clamp(-(2**31), 2**31 - 1).to(dtype)
    for sort in (ts_moe.sort_slots, reference.sort_slots):
        got = sort(experts, 4)
        for g, want in zip(got, _slot_order_loop(experts, 4), strict=True):
            assert torch.equal(g, want), sort


def test_permute_puts_dropped_rows_after_the_last_expert():
    x = torch.randn(4, 8)
    d = ts_moe.permute(x, IDS[2], 4)
    assert d.offs.tolist() == [1, 2, 3, 4]
    assert torch.equal(d.x_sorted[4:], x[[0, 1, 2, 3]])  # (0,1), (1,0), (2,1), (3,0)
    for got, want in zip(d, reference.permute(x, IDS[2], 4), strict=True):
        assert torch.equal(got, want)


def _experts_inputs(dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 32, generator=g).to(dtype)
    gate_up = (torch.randn(4, 32, 32, generator=g) * 0.2).to(dtype)
    down = (torch.randn(4, 32, 16, generator=g) * 0.2).to(dtype)
    weights = torch.rand(4, 2, generator=g)
    return [t.to(device) for t in (x, weights, gate_up, down)]


def _experts_loop(x, ids, weights, gate_up, down):
    """fp64, skipping every id outside [0, E)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, row in enumerate(ids.tolist()):
        for k, e in enumerate(row):
            if 0 <= e < gate_up.shape[0]:
                h = gate_up[e].double() @ x[t].double()
                h = torch.nn.functional.silu(h[:16]) * h[16:]
                out[t] += weights[t, k].double() * (down[e].double() @ h)
    return out


def test_experts_forward_gives_zeros_for_a_token_of_dropped_slots():
    x, weights, gate_up, down = _experts_inputs()
    ids = torch.full((4, 2), -1)
    out = ts_moe.experts_forward(x, ids, weights, gate_up, down)
    assert out.shape == x.shape and (out == 0).all()
    mixed = torch.tensor([[-1, -1], [0, -1], [3, 2], [-7, 4]])  # token 0: nothing
    for fused in (True, False):
        out = ts_moe.experts_forward(x, mixed, weights, gate_up, down, fused=fused)
        assert (out[0] == 0).all()
        want = _experts_loop(x, mixed, weights, gate_up, down)
        assert ((out.double() - want).norm() / want.norm()) < 1e-5


def _kernel_model(ids_in, num_experts):
    """The sm_90 routing kernel's slot order (``route_sm90.RouteSlots`` from ids),
    phase by phase: ids outside [0, E) read as E; ranks and counts per chunk of 32
    slots; per expert an exclusive scan over the chunks and a scan of the totals
    (offs); kept slots to ``excl[e] + hist[e, chunk] + rank``, dropped ones to
    the number of slots with a smaller id or an equal id earlier."""
    flat = ids_in.reshape(-1).tolist()
    top_k, slots = ids_in.shape[1], len(flat)
    ids = [v if 0 <= v < num_experts else num_experts for v in flat]
    chunks = (slots + 31) // 32
    rank = [sum(1 for s2 in range(32 * (s // 32), s) if ids[s2] == ids[s]) for s in range(slots)]
    hist = [[sum(1 for s in range(32 * c, min(32 * c + 32, slots)) if ids[s] == e)
             for c in range(chunks)] for e in range(num_experts)]
    total = [sum(row) for row in hist]
    before = [[sum(row[:c]) for c in range(chunks)] for row in hist]
    offs = [sum(total[:e + 1]) for e in range(num_experts)]
    excl = [offs[e] - total[e] for e in range(num_experts)]
    token_index, inverse = [0] * slots, [0] * slots
    for s, e in enumerate(ids):
        if e < num_experts:
            pos = excl[e] + before[e][s // 32] + rank[s]
        else:
            pos = sum(1 for s2, o in enumerate(ids) if o < e or (o == e and s2 < s))
        token_index[pos], inverse[s] = s // top_k, pos
    return (torch.tensor(token_index, dtype=torch.int32), torch.tensor(offs, dtype=torch.int32),
            torch.tensor(inverse))


@pytest.mark.parametrize("tokens,top_k,experts", [(3, 2, 4), (40, 2, 8), (50, 4, 16)])
def test_kernel_slot_order_model_matches_the_reference(tokens, top_k, experts):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(-3, experts + 3, (tokens, top_k), generator=g)
    ids[0, 0] = -1
    for got, want in zip(_kernel_model(ids, experts), reference.sort_slots(ids, experts),
                         strict=True):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_sm90_kernel_drops_slots_on_the_device(dtype):
    """The routing kernel (the op on the sm_90 path) against the reference, with
    -1, other negatives and sentinels, under a sync check; then the expert half
    of the layer gives zeros for a token of dropped slots."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(-4, 36, (300, 3), generator=g).to(dtype)
    ids[:7] = -1
    ids = ids.cuda()
    ts_moe.sort_slots(ids, 32)  # builds or loads the kernel outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = ts_moe.sort_slots(ids, 32)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for g_, want in zip(got, reference.sort_slots(ids.cpu(), 32), strict=True):
        assert torch.equal(g_.cpu(), want)
    x, weights, gate_up, down = _experts_inputs(torch.bfloat16, "cuda")
    mixed = torch.tensor([[-1, -1], [0, -1], [3, 2], [-7, 4]], device="cuda")
    out = ts_moe.experts_forward(x, mixed, weights, gate_up, down, decode_graphs=False)
    assert (out[0] == 0).all()
    want = _experts_loop(x.cpu(), mixed.cpu(), weights.cpu(), gate_up.cpu(), down.cpu())
    assert ((out.cpu().double() - want).norm() / want.norm()) < 1e-2
