"""CPU: the torch stand-ins ``scripts/vllm_gpu_check.py`` gives vLLM's Triton experts for
the compiled helper ops a GPU machine without vLLM's extensions lacks
(``scripts/vllm_standin_ops.py``) do what vLLM's ops do, by their definitions, and are
defined only where missing. Needs torch only."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ts_moe
from ts_moe.fp8.reference import dequantize

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "vllm_standin_ops.py"
_spec = importlib.util.spec_from_file_location("vllm_standin_ops", SCRIPT)
ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ops)


def align_loop(topk_ids, num_experts, block_size):
    """moe_align_block_size by its definition: per expert, its slots' flat indices in slot
    order, padded with the slot count to a multiple of block_size; a block's expert."""
    flat = topk_ids.flatten().tolist()
    sorted_ids, block_experts = [], []
    for e in range(num_experts):
        mine = [i for i, x in enumerate(flat) if x == e]
        padded = -(-len(mine) // block_size) * block_size
        sorted_ids += mine + [len(flat)] * (padded - len(mine))
        block_experts += [e] * (padded // block_size)
    return sorted_ids, block_experts


@pytest.mark.parametrize("tokens, experts, top_k, block", [(5, 8, 2, 4), (33, 16, 4, 16),
                                                           (1, 128, 8, 64), (64, 4, 2, 8)])
def test_moe_align_block_size_groups_and_pads_the_slots_by_expert(tokens, experts, top_k,
                                                                  block):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k).indices.to(torch.int32)
    capacity = ids.numel() + experts * (block - 1)
    sorted_ids = torch.full((capacity,), -7, dtype=torch.int32)
    block_experts = torch.full((-(-capacity // block),), -7, dtype=torch.int32)
    total = torch.zeros(1, dtype=torch.int32)
    ops.moe_align_block_size(ids, experts, block, sorted_ids, block_experts, total)
    want_ids, want_experts = align_loop(ids, experts, block)
    assert int(total) == len(want_ids)
    assert sorted_ids[:len(want_ids)].tolist() == want_ids
    assert block_experts[:len(want_experts)].tolist() == want_experts
    assert (block_experts[len(want_experts):] == -1).all()  # blocks past the total


def test_moe_align_block_size_refuses_what_it_does_not_serve():
    ids = torch.zeros(2, 1, dtype=torch.int32)
    out = (torch.empty(8, dtype=torch.int32), torch.empty(2, dtype=torch.int32),
           torch.empty(1, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="expert_map"):
        ops.moe_align_block_size(ids, 2, 4, *out, expert_map=torch.arange(2))


def test_moe_sum_silu_and_mul_and_the_group_quantizer():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 3, 32, generator=g).bfloat16()
    out = torch.empty(6, 32, dtype=torch.bfloat16)
    ops.moe_sum(rows, out)
    assert torch.equal(out, rows.float().sum(1).bfloat16())
    expert_map = torch.tensor([0, -1, 1], dtype=torch.int32)
    ids = torch.randint(0, 3, (6, 3), generator=g, dtype=torch.int32)
    ops.moe_sum(rows, out, ids, expert_map)
    kept = (expert_map[ids.long()] >= 0).unsqueeze(-1)
    assert torch.equal(out, (rows.float() * kept).sum(1).bfloat16())

    h = torch.randn(5, 64, generator=g).bfloat16()
    act = torch.empty(5, 32, dtype=torch.bfloat16)
    ops.silu_and_mul(act, h)
    assert torch.equal(act, (F.silu(h[:, :32].float()) * h[:, 32:].float()).bfloat16())

    x = torch.randn(7, 256, generator=g).bfloat16()
    q, s = torch.empty(7, 256, dtype=ops.FP8), torch.empty(7, 2)
    ops.per_token_group_fp8_quant(x, q, s, 128, 1e-10, -448.0, 448.0, False, False, False)
    back = q.float().view(7, 2, 128) * s.unsqueeze(-1)
    tq, ts = ts_moe.quantize_fp8(x, "blockwise_1x128")  # ts_moe's 1x128 quantizer: the same
    assert torch.allclose(s, ts) and torch.allclose(back.view(7, 256),
                                                    dequantize(tq, ts, "blockwise_1x128"))
    ops.per_token_group_fp8_quant(x, q, s, 128, 1e-10, -448.0, 448.0, True, False, False)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # ue8m0: powers of two


def test_install_defines_only_the_missing_ops_once():
    code = ("import importlib.util, sys, torch; "
            f"spec = importlib.util.spec_from_file_location('m', {str(SCRIPT)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "first = m.install(); second = m.install(); "
            "out = torch.empty(2, 4); torch.ops._C.silu_and_mul(out, torch.ones(2, 8)); "
            "print(first, second, round(float(out[0, 0]), 4))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items()
                                            if k != "PYTEST_ADDOPTS"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [
        "['_moe_C::moe_align_block_size',", "'_moe_C::moe_sum',", "'_C::silu_and_mul',",
        "'_C::per_token_group_fp8_quant']", "[]", str(round(float(F.silu(torch.ones(()))), 4))]
