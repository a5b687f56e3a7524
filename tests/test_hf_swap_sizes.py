"""The transformers swaps refuse hidden and intermediate sizes that are not multiples
of 8 when they switch (replace_moe_blocks) or at the module's first forward (the
experts interface, whose switch transformers makes), naming the module and the size."""

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers.integrations.moe import ExpertsInterface  # noqa: E402

from ts_moe.integrations.transformers import register, replace_moe_blocks  # noqa: E402

from .test_hf_integration import MixtralSparseMoeBlock  # noqa: E402 (the transformers-4 one)


def _model(hidden, inter, **kw):
    config = MixtralConfig(vocab_size=32, hidden_size=hidden, intermediate_size=inter,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           num_local_experts=4, num_experts_per_tok=2, **kw)
    return MixtralForCausalLM(config).eval()


@pytest.mark.parametrize("hidden,inter,bad", [(60, 128, "hidden_size = 60"),
                                              (64, 100, "intermediate_size = 100")])
def test_replace_refuses_sizes_at_the_switch(hidden, inter, bad):
    model = _model(hidden, inter)
    before = [type(layer.mlp) for layer in model.model.layers]
    with pytest.raises(ValueError, match=rf"model\.layers\.0\.mlp: {bad} must be a multiple of 8"):
        replace_moe_blocks(model)
    assert [type(layer.mlp) for layer in model.model.layers] == before  # nothing switched


@pytest.mark.parametrize("hidden,inter,bad", [(60, 128, "hidden_size = 60"),
                                              (64, 36, "intermediate_size = 36")])
def test_replace_refuses_transformers4_sizes_at_the_switch(hidden, inter, bad):
    model = torch.nn.ModuleDict({"moe": MixtralSparseMoeBlock(hidden, inter, 4, 2)})
    with pytest.raises(ValueError, match=rf"moe: {bad} must be a multiple of 8"):
        replace_moe_blocks(model)
    assert type(model["moe"]) is MixtralSparseMoeBlock and hasattr(model["moe"], "experts")


@pytest.fixture
def registered():
    register()
    yield
    ExpertsInterface._global_mapping.pop("ts_moe", None)


def test_experts_interface_names_the_module_and_size(registered):
    model = _model(60, 128, experts_implementation="ts_moe")
    with pytest.raises(ValueError, match="MixtralExperts: hidden_size = 60 must be a multiple"):
        model(torch.randint(0, 32, (1, 4)))
