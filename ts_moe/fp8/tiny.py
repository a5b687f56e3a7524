"""Tiny random FP8 MoE checkpoints in the on-disk formats of the real releases, for tests
and the demo (safetensors only; no transformers needed).

Namings (per layer ``L``, expert ``e``):

- ``mixtral``: ``model.layers.L.block_sparse_moe.gate.weight`` (E, H) and
  ``...block_sparse_moe.experts.e.w1.weight`` (gate, (I, H)), ``w3`` (up), ``w2``
  (down, (H, I)) (Neural Magic / RedHat Mixtral FP8);
- ``qwen3_moe``: ``model.layers.L.mlp.gate.weight`` and
  ``...mlp.experts.e.gate_proj.weight``, ``up_proj``, ``down_proj`` (Qwen3-30B-A3B-FP8);
- ``deepseek_v3``: the Qwen3 expert names, plus ``mlp.gate.e_score_correction_bias``
  and ``mlp.shared_experts.*``; layer 0 a dense MLP (``first_k_dense_replace = 1``).

Schemes, with each e4m3 ``*.weight``:

- ``blockwise``: ``*.weight_scale_inv`` fp32 (ceil(N/128), ceil(K/128));
  ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`` (DeepSeek-V3,
  Qwen ``-FP8``);
- ``channel``: ``*.weight_scale`` fp32 (N, 1); an llm-compressor ``compressed-tensors``
  config (channel weights, dynamic per-token activations: FP8-dynamic releases);
- ``tensor``: ``*.weight_scale`` fp32 () and a static ``*.input_scale`` ();
  ``{"quant_method": "fp8", "activation_scheme": "static"}`` (AutoFP8 Mixtral).

The router (and, for DeepSeek-V3, the score bias) stays bf16 / fp32.  The weights
are :func:`tiny_moe_weights` quantized by :func:`ts_moe.quantize_fp8`, so a test
can compare a loaded layer with the bf16 weights it stands for.
"""

import json
from pathlib import Path

import torch

from ..tiny import _max_shard_bytes, _save_sharded
from .quantize import quantize_fp8

NAMINGS = ("mixtral", "qwen3_moe", "deepseek_v3")
SCHEMES = ("blockwise", "channel", "tensor")
_RECIPE = {"blockwise": "blockwise_128x128", "channel": "rowwise", "tensor": "tensorwise"}
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
                 "deepseek_v3": ("gate_proj", "up_proj", "down_proj")}


def quantization_config(scheme: str) -> dict:
    """The ``quantization_config`` of config.json that releases of ``scheme`` carry."""
    if scheme == "blockwise":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}
    if scheme == "tensor":
        return {"quant_method": "fp8", "activation_scheme": "static"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "symmetric": True, "dynamic": True}}},
            "ignore": ["lm_head", "re:.*mlp.gate$"]}


def moe_layers(naming: str, layers: int) -> list[int]:
    """The layers that hold experts (DeepSeek-V3's first is dense)."""
    return list(range(1 if naming == "deepseek_v3" and layers > 1 else 0, layers))


def tiny_moe_weights(*, layers: int = 2, hidden: int = 256, intermediate: int = 256,
                     experts: int = 4, seed: int = 0, init_std: float = 0.02,
                     naming: str = "qwen3_moe") -> dict[int, dict[str, torch.Tensor]]:
    """The bf16 expert weights a tiny checkpoint of these arguments quantizes:
    ``{layer: {"router": (E, H), "gate_up_proj": (E, 2I, H), "down_proj": (E, H, I)}}``
    for its MoE layers.  The global RNG state is left as it was."""
    g = torch.Generator().manual_seed(seed)

    def weight(*shape):
        return (torch.randn(*shape, generator=g) * init_std).to(torch.bfloat16)

    return {layer: {"router": weight(experts, hidden),
                    "gate_up_proj": weight(experts, 2 * intermediate, hidden),
                    "down_proj": weight(experts, hidden, intermediate)}
            for layer in moe_layers(naming, layers)}


def _linear(state: dict, key: str, w: torch.Tensor, scheme: str) -> None:
    """``key.weight`` in e4m3 and its scale as ``scheme``'s releases name and shape it."""
    q, scale = quantize_fp8(w.float(), _RECIPE[scheme])
    state[f"{key}.weight"] = q
    if scheme == "blockwise":
        state[f"{key}.weight_scale_inv"] = scale.contiguous()
    elif scheme == "channel":
        state[f"{key}.weight_scale"] = scale.reshape(-1, 1).contiguous()
    else:
        state[f"{key}.weight_scale"] = scale.reshape(())
        state[f"{key}.input_scale"] = torch.tensor(1.0 / 64)


def make_tiny_fp8_checkpoint(out_dir, *, naming: str = "qwen3_moe", scheme: str = "blockwise",
                             layers: int = 2, hidden: int = 256, intermediate: int = 256,
                             experts: int = 4, top_k: int = 2, shards: int = 2, seed: int = 0,
                             init_std: float = 0.02) -> Path:
    """Write a tiny FP8 MoE checkpoint (module docstring) to ``out_dir``; returns its path.

    H and I must be multiples of 16 (of 128 for ``blockwise``, as in every release).
    ``shards``: split by size into at least that many files, with the index.
    """
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    unit = 128 if scheme == "blockwise" else 16
    for name, value in (("hidden", hidden), ("intermediate", intermediate)):
        if isinstance(value, bool) or not isinstance(value, int) or value < unit or value % unit:
            raise ValueError(f"{name} must be a positive multiple of {unit} for the {scheme} "
                             f"scheme, got {value!r}")
    for name, value in (("layers", layers), ("experts", experts), ("top_k", top_k),
                        ("shards", shards)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if top_k > experts:
        raise ValueError(f"top_k = {top_k} exceeds experts = {experts}")
    weights = tiny_moe_weights(layers=layers, hidden=hidden, intermediate=intermediate,
                               experts=experts, seed=seed, init_std=init_std, naming=naming)
    gate, up, down = _EXPERT_NAMES[naming]
    state: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(seed + 1)
    for layer in range(layers):
        block = "block_sparse_moe" if naming == "mixtral" else "mlp"
        prefix = f"model.layers.{layer}.{block}."
        if layer not in weights:  # DeepSeek-V3's dense first layer
            for name, shape in (("gate_proj", (2 * intermediate, hidden)),
                                ("up_proj", (2 * intermediate, hidden)),
                                ("down_proj", (hidden, 2 * intermediate))):
                _linear(state, prefix + name, torch.randn(*shape, generator=g) * init_std, scheme)
            continue
        w = weights[layer]
        state[prefix + "gate.weight"] = w["router"]
        for e in range(experts):
            _linear(state, f"{prefix}experts.{e}.{gate}", w["gate_up_proj"][e, :intermediate],
                    scheme)
            _linear(state, f"{prefix}experts.{e}.{up}", w["gate_up_proj"][e, intermediate:],
                    scheme)
            _linear(state, f"{prefix}experts.{e}.{down}", w["down_proj"][e], scheme)
        if naming == "deepseek_v3":
            state[prefix + "gate.e_score_correction_bias"] = torch.zeros(experts)
            for name, shape in (("gate_proj", (intermediate, hidden)),
                                ("up_proj", (intermediate, hidden)),
                                ("down_proj", (hidden, intermediate))):
                _linear(state, f"{prefix}shared_experts.{name}",
                        torch.randn(*shape, generator=g) * init_std, scheme)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_sharded(state, out_dir, _max_shard_bytes(state, shards))
    config = {"hidden_size": hidden, "num_hidden_layers": layers, "num_experts_per_tok": top_k,
              "initializer_range": init_std, "torch_dtype": "bfloat16",
              "quantization_config": quantization_config(scheme)}
    if naming == "mixtral":
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                      intermediate_size=intermediate, num_local_experts=experts)
    elif naming == "qwen3_moe":
        config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      moe_intermediate_size=intermediate, num_experts=experts,
                      norm_topk_prob=True)
    else:
        config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                      moe_intermediate_size=intermediate, intermediate_size=2 * intermediate,
                      n_routed_experts=experts, n_shared_experts=1,
                      first_k_dense_replace=1 if layers > 1 else 0)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
