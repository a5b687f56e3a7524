"""What ``from_pretrained`` takes from a checkpoint's config.json besides the expert
weights: whether the layer reproduces the model's sparse MoE block, its top-k, and
whether the top-k weights are renormalised (:func:`block_settings`).

The layer is a softmax top-k router over SwiGLU experts and nothing else.  The blocks
of these model types in transformers are exactly that:

- ``mixtral``: the top-k weights always renormalised to sum to 1;
- ``qwen3_moe``: renormalised only where ``norm_topk_prob`` is true (absent: false,
  transformers' default);
- ``qwen2_moe``: as ``qwen3_moe``, plus a shared expert behind a sigmoid gate of
  ``shared_expert_intermediate_size`` (absent: 5632) channels; served only where
  that size is 0, for which the shared expert adds exactly zero.

Every other model type is refused, naming what its block has that the layer lacks
where ts_moe knows it; so is an activation other than SiLU (``hidden_act``).
"""

from pathlib import Path
from typing import NamedTuple

from .checkpoint import EXPERT_FIELDS, is_positive_int, local_checkpoint, read_config

SERVED = ("mixtral", "qwen3_moe", "qwen2_moe")
_SHARED_GATED = "a shared expert behind a sigmoid gate"
_LACKS = {
    "qwen2_moe": f"{_SHARED_GATED} (shared_expert_intermediate_size > 0)",
    "qwen3_next": _SHARED_GATED,
    "qwen3_5_moe": _SHARED_GATED,
    "glm4_moe": "a sigmoid router with a score-correction bias and expert groups, and "
                "shared experts",
    "gpt_oss": "a router bias, a softmax over the top-k logits only, and experts with biases "
               "and a clamped SwiGLU",
    "llama4": "a sigmoid router that scales the experts' input, and a shared expert",
    "phimoe": "sparsemixer routing",
}
_DEEPSEEK = ("DeepSeek-V3 routes by sigmoid scores with a bias and expert groups (DeepSeek-V2 "
             "by expert groups) and adds shared experts")


class BlockSettings(NamedTuple):
    """top_k: experts per token; renormalize: whether the top-k weights are divided by
    their sum; num_experts: the expert count config.json declares (None: none);
    config_file: the config.json they come from."""

    top_k: int
    renormalize: bool
    num_experts: int | None
    config_file: Path

    def check_router(self, router_rows: int) -> None:
        """The router's expert count (E, its rows) against top-k: where config.json
        declares no expert count, this is the first place top-k meets one, and a
        ValueError names config.json's field, not the layer's argument."""
        if self.top_k > router_rows:
            raise ValueError(f"{self.config_file}: num_experts_per_tok = {self.top_k} exceeds "
                             f"the router's {router_rows} experts")


def _refusal(config_file, model_type, caller: str) -> ValueError:
    if model_type.startswith("deepseek"):
        lacks = _DEEPSEEK
    elif model_type in _LACKS:
        lacks = f"its block has {_LACKS[model_type]}"
    else:
        lacks = "its block is not one ts_moe knows to be a plain softmax top-k over SwiGLU experts"
    return ValueError(
        f"{config_file}: model_type {model_type!r}: {lacks}; {caller} reproduces the sparse "
        f"MoE blocks of {', '.join(SERVED[:-1])} and {SERVED[-1]} without a shared expert "
        f"only. Load the experts alone (ts_moe.load_mixtral_experts, "
        f"ts_moe.load_fp8_experts) and run ts_moe.experts_forward with the "
        f"model's own routing")


def block_settings(path, caller: str) -> BlockSettings:
    """The layer's settings from the config.json of the checkpoint directory ``path``
    (read through :class:`ts_moe.checkpoint._Checkpoint`); ``caller`` names the
    function in errors.  FileNotFoundError without a directory or a config.json;
    ValueError naming config.json and the field for a model type whose block the
    layer does not reproduce (module docstring), or a bad ``num_experts_per_tok``,
    ``norm_topk_prob``, ``hidden_act`` or size."""
    ckpt = local_checkpoint(path, caller)
    config_file = ckpt.path / "config.json"
    if ckpt.file("config.json", "config.json") is None:
        raise FileNotFoundError(f"{config_file} is missing: {caller} takes the model type "
                                f"and top-k from it")
    config = read_config(ckpt)
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f"{config_file}: model_type must be a string naming the model, got "
                         f"{model_type!r}")
    if model_type not in SERVED:
        raise _refusal(config_file, model_type, caller)
    if model_type == "qwen2_moe" and config.get("shared_expert_intermediate_size", 5632) != 0:
        raise _refusal(config_file, model_type, caller)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{config_file}: hidden_act = {act!r}; the layer's experts are SwiGLU "
                         f"(silu)")
    top_k = config.get("num_experts_per_tok")
    if not is_positive_int(top_k):
        raise ValueError(f"{config_file}: num_experts_per_tok must be a positive int, got "
                         f"{top_k!r}")
    if model_type == "mixtral":
        renormalize = True
    else:
        renormalize = config.get("norm_topk_prob", False)
        if not isinstance(renormalize, bool):
            raise ValueError(f"{config_file}: norm_topk_prob must be true or false, got "
                             f"{renormalize!r}")
    num_experts = next((config[f] for f in EXPERT_FIELDS if f in config), None)
    if num_experts is not None and top_k > num_experts:
        raise ValueError(f"{config_file}: num_experts_per_tok = {top_k} exceeds the "
                         f"{num_experts} experts")
    return BlockSettings(top_k, renormalize, num_experts, config_file)
