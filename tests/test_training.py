"""Fine-tuning a tiny MixtralForCausalLM whose MoE blocks run on ts_moe.

The swapped model (``replace_moe_blocks``, and transformers 5's
``experts_implementation="ts_moe"``) and the unswapped one (transformers' own
experts) train side by side from the same weights on the same batches; their
losses must agree within bf16 tolerance at every one of 20 steps, and fall.
On the CPU in CI (the reference path), on the H200 in the GPU tests (kernels).
"""

import pytest
import torch

import ts_moe

transformers = pytest.importorskip("transformers", minversion="5")
from transformers import MixtralForCausalLM  # noqa: E402

from ts_moe.integrations.transformers import register, replace_moe_blocks  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # gpu: sm_90 only (conftest)
STEPS = 20
LR = 2.0


def _models(tmp_path, device, implementation):
    path = ts_moe.make_tiny_mixtral(tmp_path / "m", names="v5", layers=2, init_std=0.05)
    load = dict(dtype=torch.bfloat16, experts_implementation="eager")
    ref = MixtralForCausalLM.from_pretrained(path, **load).to(device).train()
    if implementation == "replace":
        model = MixtralForCausalLM.from_pretrained(path, **load).to(device).train()
        assert replace_moe_blocks(model) == 2
    else:
        register()
        model = MixtralForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, experts_implementation="ts_moe").to(device).train()
    return model, ref


def _train(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # not Adam: it would hide a gradient's scale
    losses = []
    for tokens in batches:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("implementation", ["replace", "experts_implementation"])
@pytest.mark.parametrize("device", DEVICES)
def test_finetune_follows_unswapped_loss(tmp_path, device, implementation):
    model, ref = _models(tmp_path, device, implementation)
    experts = [m for n, m in model.named_modules() if n.endswith("experts")]
    assert all(m.gate_up_proj.requires_grad for m in experts)
    before = [m.gate_up_proj.detach().clone() for m in experts]
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (4, 32), generator=g).to(device) for _ in range(STEPS)]
    got, want = _train(model, batches), _train(ref, batches)
    # bf16 training: the two models' roundings differ from the first step on
    # and compound (measured on the CPU: 4e-4 at most)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 5e-3 * abs(b), f"step {step}: ts_moe {a:.4f}, transformers {b:.4f}"
    assert got[-1] < got[0] - 0.5  # it learns (the batches reuse 64 of 256 tokens)
    for m, old in zip(experts, before):  # the expert weights trained
        assert not torch.equal(m.gate_up_proj.detach(), old)
