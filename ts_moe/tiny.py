"""Tiny random MoE checkpoints in the real Hugging Face formats, for tests and the demo.

* :func:`make_tiny_checkpoint` writes only what a checkpoint holds for its MoE
  blocks (router and experts of each layer, and a config.json), with ``safetensors``
  alone, in a format (bf16, or an FP8 release's scheme) and a model's naming (Mixtral,
  Qwen3-MoE, DeepSeek-V3): the demo's and the tests' checkpoints, no optional extra
  needed; :func:`make_tiny_moe_checkpoint` (bf16 Mixtral) and
  :func:`make_tiny_fp8_checkpoint` are it with their formats.
* :func:`make_tiny_mixtral` writes a whole ``MixtralForCausalLM(MixtralConfig(...))``
  with its own random init, in bfloat16; it needs ``transformers`` (the ``hf``
  extra).  ``names="v4"`` writes it with ``save_pretrained`` (transformers 5
  saves the transformers-4 expert names, ``block_sparse_moe.experts.{e}.w1/w2/w3``);
  ``names="v5"`` writes the in-memory transformers-5 names
  (``mlp.experts.gate_up_proj`` / ``down_proj``) in the same sharded layout.
"""

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save

from .ops.quantize import quantize_fp8
from .loaders import Fp8Scheme
from .publish import publish


def _shard_files(state_dict: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict]:
    """Greedy packing in key order, each shard at most ``max_shard_bytes`` (or one tensor)."""
    shards, size = [{}], 0
    for key, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor.contiguous()
        size += nbytes
    return shards


def _sharded_files(state_dict: dict[str, torch.Tensor], max_shard_bytes: int) -> dict:
    """``{name: bytes}``: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
    and their index."""
    shards = _shard_files(state_dict, max_shard_bytes)
    if len(shards) == 1:
        return {"model.safetensors": save(shards[0], metadata={"format": "pt"})}
    files, weight_map = {}, {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        files[name] = save(shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    metadata = {"total_parameters": sum(t.numel() for t in state_dict.values()),
                "total_size": sum(t.numel() * t.element_size() for t in state_dict.values())}
    files["model.safetensors.index.json"] = _json_bytes({"metadata": metadata,
                                                         "weight_map": weight_map})
    return files


def _json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()


def _check_tiny_args(*, layers, hidden, intermediate, experts, top_k, names, shards,
                     vocab=1) -> None:
    if names not in ("v4", "v5"):
        raise ValueError(f"names must be 'v4' or 'v5', got {names!r}")
    for name, value in (("layers", layers), ("experts", experts), ("top_k", top_k),
                        ("vocab", vocab), ("shards", shards)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in (("hidden", hidden), ("intermediate", intermediate)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 8 or value % 8:
            raise ValueError(f"{name} must be a positive multiple of 8, got {value!r}")
    if top_k > experts:
        raise ValueError(f"top_k = {top_k} exceeds experts = {experts}")


def _max_shard_bytes(state_dict: dict[str, torch.Tensor], shards: int) -> int:
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    return math.ceil(total / shards) if shards > 1 else total


NAMINGS = ("mixtral", "mixtral_v5", "qwen3_moe", "deepseek_v3")
FORMATS = ("bf16", *(scheme.value for scheme in Fp8Scheme))
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
                 "deepseek_v3": ("gate_proj", "up_proj", "down_proj")}


def quantization_config(scheme: str) -> dict:
    """The ``quantization_config`` of config.json that releases of FP8 ``scheme`` carry."""
    if scheme == Fp8Scheme.BLOCKWISE:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}
    if scheme == Fp8Scheme.TENSOR:
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
    """The bf16 expert weights a tiny checkpoint of these arguments holds (or quantizes):
    ``{layer: {"router": (E, H), "gate_up_proj": (E, 2I, H), "down_proj": (E, H, I)}}``
    for its MoE layers, N(0, ``init_std``).  The global RNG state is left as it was."""
    g = torch.Generator().manual_seed(seed)

    def weight(*shape):
        return (torch.randn(*shape, generator=g) * init_std).to(torch.bfloat16)

    return {layer: {"router": weight(experts, hidden),
                    "gate_up_proj": weight(experts, 2 * intermediate, hidden),
                    "down_proj": weight(experts, hidden, intermediate)}
            for layer in moe_layers(naming, layers)}


def _linear(state: dict, key: str, w: torch.Tensor, format: str) -> None:
    """``key.weight`` as ``format`` stores it: bf16 as it is (a copy: safetensors refuses
    tensors that share storage), or e4m3 with its scale as the scheme's releases name
    and shape it."""
    if format == "bf16":
        state[f"{key}.weight"] = w.to(torch.bfloat16).clone()
        return
    scheme = Fp8Scheme(format)
    q, scale = quantize_fp8(w.float(), scheme.recipe)
    state[f"{key}.weight"] = q
    if scheme is Fp8Scheme.BLOCKWISE:
        state[f"{key}.{scheme.scale_key}"] = scale.contiguous()
    elif scheme is Fp8Scheme.CHANNEL:
        state[f"{key}.{scheme.scale_key}"] = scale.reshape(-1, 1).contiguous()
    else:
        state[f"{key}.{scheme.scale_key}"] = scale.reshape(())
        state[f"{key}.input_scale"] = torch.tensor(1.0 / 64)


def make_tiny_checkpoint(out_dir, *, format: str = "bf16", naming: str = "mixtral",
                         layers: int = 2, hidden: int = 64, intermediate: int = 128,
                         experts: int = 4, top_k: int = 2, shards: int = 2, seed: int = 0,
                         init_std: float = 0.02) -> Path:
    """Write the MoE tensors of a random checkpoint to ``out_dir``; returns its path.

    ``format``: ``"bf16"``, or an FP8 scheme of the releases (each e4m3 ``*.weight``
    with its scale):

    - ``blockwise``: ``*.weight_scale_inv`` fp32 (ceil(N/128), ceil(K/128));
      ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
      "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`` (DeepSeek-V3,
      Qwen ``-FP8``);
    - ``channel``: ``*.weight_scale`` fp32 (N, 1); an llm-compressor ``compressed-tensors``
      config (channel weights, dynamic per-token activations: FP8-dynamic releases);
    - ``tensor``: ``*.weight_scale`` fp32 () and a static ``*.input_scale`` ();
      ``{"quant_method": "fp8", "activation_scheme": "static"}`` (AutoFP8 Mixtral).

    ``naming`` (per layer ``L``, expert ``e``):

    - ``mixtral``: ``model.layers.L.block_sparse_moe.gate.weight`` (E, H) and
      ``...block_sparse_moe.experts.e.w1.weight`` (gate, (I, H)), ``w3`` (up), ``w2``
      (down, (H, I)): what Mixtral checkpoints on the Hub hold;
    - ``mixtral_v5``: transformers 5's in-memory names, ``model.layers.L.mlp.gate.weight``,
      ``mlp.experts.gate_up_proj`` (E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I)
      (bf16 only);
    - ``qwen3_moe``: ``model.layers.L.mlp.gate.weight`` and
      ``...mlp.experts.e.gate_proj.weight``, ``up_proj``, ``down_proj`` (Qwen3-30B-A3B);
    - ``deepseek_v3``: the Qwen3 expert names, plus ``mlp.gate.e_score_correction_bias``
      and ``mlp.shared_experts.*``; layer 0 a dense MLP (``first_k_dense_replace = 1``).

    The experts are :func:`tiny_moe_weights` (so the same ``seed`` gives the same
    weights in every naming, and a test can compare an FP8 layer with the bf16 weights
    it stands for), quantized by :func:`ts_moe.quantize_fp8` for an FP8 format; the
    router (and DeepSeek-V3's score bias) stays bf16 / fp32.  H and I must be multiples
    of 8 (bf16), 16 (FP8), 128 (``blockwise``, as in every release).  ``shards``: split
    by size into at least that many files (1: one ``model.safetensors``), with the
    index a sharded checkpoint has.  A config.json with the model type's fields.  Needs
    no ``transformers``; the global RNG state is left as it was.

    ``out_dir`` is written whole, in place of a checkpoint it held (an earlier index
    and shards removed, a write cut short leaving the old one), and only through a
    path no one else can redirect: :func:`ts_moe.publish.publish`.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
    if naming == "mixtral_v5" and format != "bf16":
        raise ValueError("naming 'mixtral_v5' (stacked experts) is bf16 only")
    for name, value in (("layers", layers), ("experts", experts), ("top_k", top_k),
                        ("shards", shards)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    unit = {"bf16": 8, Fp8Scheme.BLOCKWISE: 128}.get(format, 16)
    for name, value in (("hidden", hidden), ("intermediate", intermediate)):
        if isinstance(value, bool) or not isinstance(value, int) or value < unit or value % unit:
            raise ValueError(f"{name} must be a positive multiple of {unit}"
                             + ("" if format == "bf16" else f" for the {format} scheme")
                             + f", got {value!r}")
    if top_k > experts:
        raise ValueError(f"top_k = {top_k} exceeds experts = {experts}")
    weights = tiny_moe_weights(layers=layers, hidden=hidden, intermediate=intermediate,
                               experts=experts, seed=seed, init_std=init_std, naming=naming)
    state: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(seed + 1)
    for layer in range(layers):
        prefix = f"model.layers.{layer}.{'block_sparse_moe' if naming == 'mixtral' else 'mlp'}."
        if layer not in weights:  # DeepSeek-V3's dense first layer
            for name, shape in (("gate_proj", (2 * intermediate, hidden)),
                                ("up_proj", (2 * intermediate, hidden)),
                                ("down_proj", (hidden, 2 * intermediate))):
                _linear(state, prefix + name, torch.randn(*shape, generator=g) * init_std, format)
            continue
        w = weights[layer]
        state[prefix + "gate.weight"] = w["router"]
        if naming == "mixtral_v5":
            state[prefix + "experts.gate_up_proj"] = w["gate_up_proj"]
            state[prefix + "experts.down_proj"] = w["down_proj"]
            continue
        gate, up, down = _EXPERT_NAMES[naming]
        for e in range(experts):
            for name, t in ((gate, w["gate_up_proj"][e, :intermediate]),
                            (up, w["gate_up_proj"][e, intermediate:]), (down, w["down_proj"][e])):
                _linear(state, f"{prefix}experts.{e}.{name}", t, format)
        if naming == "deepseek_v3":
            state[prefix + "gate.e_score_correction_bias"] = torch.zeros(experts)
            for name, shape in (("gate_proj", (intermediate, hidden)),
                                ("up_proj", (intermediate, hidden)),
                                ("down_proj", (hidden, intermediate))):
                _linear(state, f"{prefix}shared_experts.{name}",
                        torch.randn(*shape, generator=g) * init_std, format)
    files = _sharded_files(state, _max_shard_bytes(state, shards))
    files["config.json"] = _json_bytes(_config(format, naming, layers, hidden, intermediate,
                                               experts, top_k, init_std))
    return publish(out_dir, files)


def _config(format, naming, layers, hidden, intermediate, experts, top_k, init_std) -> dict:
    config = {"hidden_size": hidden, "num_hidden_layers": layers, "num_experts_per_tok": top_k,
              "initializer_range": init_std, "torch_dtype": "bfloat16"}
    if format != "bf16":
        config["quantization_config"] = quantization_config(format)
    if naming in ("mixtral", "mixtral_v5"):
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
    return config


def make_tiny_moe_checkpoint(out_dir, *, layers: int = 2, hidden: int = 64,
                             intermediate: int = 128, experts: int = 4, top_k: int = 2,
                             names: str = "v4", shards: int = 2, seed: int = 0,
                             init_std: float = 0.02) -> Path:
    """Write the MoE tensors of a random bf16 Mixtral checkpoint to ``out_dir``; returns
    its path: :func:`make_tiny_checkpoint` in the ``mixtral`` naming (``names="v4"``,
    the transformers-4 names that checkpoints on the Hub hold) or the ``mixtral_v5``
    one (``names="v5"``).  The same ``seed`` gives the same weights in both namings,
    so either can be checked against the other."""
    if names not in ("v4", "v5"):
        raise ValueError(f"names must be 'v4' or 'v5', got {names!r}")
    return make_tiny_checkpoint(out_dir, naming="mixtral" if names == "v4" else "mixtral_v5",
                                layers=layers, hidden=hidden, intermediate=intermediate,
                                experts=experts, top_k=top_k, shards=shards, seed=seed,
                                init_std=init_std)


def make_tiny_fp8_checkpoint(out_dir, *, naming: str = "qwen3_moe", scheme: str = "blockwise",
                             layers: int = 2, hidden: int = 256, intermediate: int = 256,
                             experts: int = 4, top_k: int = 2, shards: int = 2, seed: int = 0,
                             init_std: float = 0.02) -> Path:
    """Write a tiny FP8 MoE checkpoint of ``scheme`` to ``out_dir``; returns its path:
    :func:`make_tiny_checkpoint` with ``format=scheme``."""
    if scheme not in FORMATS[1:]:
        raise ValueError(f"scheme must be one of {FORMATS[1:]}, got {scheme!r}")
    return make_tiny_checkpoint(out_dir, format=scheme, naming=naming, layers=layers,
                                hidden=hidden, intermediate=intermediate, experts=experts,
                                top_k=top_k, shards=shards, seed=seed, init_std=init_std)


def make_tiny_mixtral(out_dir, *, layers: int = 2, hidden: int = 64, intermediate: int = 128,
                      experts: int = 4, top_k: int = 2, vocab: int = 256, names: str = "v4",
                      shards: int = 2, seed: int = 0, init_std: float = 0.02) -> Path:
    """Write a random bf16 Mixtral model checkpoint to ``out_dir``; returns its path.

    Needs ``transformers`` (the ``hf`` extra; :func:`make_tiny_moe_checkpoint`
    does not).  4 attention heads, 2 key/value heads.  ``shards``: the weights
    are split into at least that many files by size (1: one
    ``model.safetensors``).  ``init_std``: the config's ``initializer_range``.
    The global RNG state is left as it was.  ``out_dir`` is written as
    :func:`make_tiny_checkpoint` writes it (:func:`ts_moe.publish.publish`).
    """
    _check_tiny_args(layers=layers, hidden=hidden, intermediate=intermediate, experts=experts,
                     top_k=top_k, names=names, shards=shards, vocab=vocab)
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=1024,
        initializer_range=init_std, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MixtralForCausalLM(config).to(torch.bfloat16)

    state_dict = model.state_dict()
    max_shard_bytes = _max_shard_bytes(state_dict, shards)
    with tempfile.TemporaryDirectory() as private:  # transformers writes by name: not there
        if names == "v4":
            model.save_pretrained(private, max_shard_size=max_shard_bytes)
        else:
            model.config.save_pretrained(private)
            model.generation_config.save_pretrained(private)
        files = {p.name: p.read_bytes() for p in sorted(Path(private).iterdir())}
    if names == "v5":
        files.update(_sharded_files(state_dict, max_shard_bytes))
    return publish(out_dir, files)


def main(argv=None) -> None:
    """``python scripts/make_tiny_mixtral.py OUT_DIR [--layers N ...]``."""
    parser = argparse.ArgumentParser(description=make_tiny_mixtral.__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--names", choices=("v4", "v5"), default="v4")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-std", type=float, default=0.02)
    args = parser.parse_args(argv)
    path = make_tiny_mixtral(
        args.out_dir, layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
        experts=args.experts, top_k=args.top_k, vocab=args.vocab, names=args.names,
        shards=args.shards, seed=args.seed, init_std=args.init_std)
    print(path)
