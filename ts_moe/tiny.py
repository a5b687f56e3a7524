"""Tiny random Mixtral checkpoints in the real Hugging Face format, for tests and the demo.

* :func:`make_tiny_moe_checkpoint` writes only what a Mixtral checkpoint holds
  for its MoE blocks (router and experts of each layer, and a config.json), with
  ``safetensors`` alone: the demo's checkpoint, no optional extra needed.
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
from pathlib import Path

import torch
from safetensors.torch import save_file


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


def _save_sharded(state_dict: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> None:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` and their index."""
    shards = _shard_files(state_dict, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], out_dir / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out_dir / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    metadata = {"total_parameters": sum(t.numel() for t in state_dict.values()),
                "total_size": sum(t.numel() * t.element_size() for t in state_dict.values())}
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2) + "\n")


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


def make_tiny_moe_checkpoint(out_dir, *, layers: int = 2, hidden: int = 64,
                             intermediate: int = 128, experts: int = 4, top_k: int = 2,
                             names: str = "v4", shards: int = 2, seed: int = 0,
                             init_std: float = 0.02) -> Path:
    """Write the MoE tensors of a random bf16 Mixtral checkpoint to ``out_dir``; returns its path.

    Per layer ``L``, in the transformers-4 names (``names="v4"``, what
    checkpoints on the Hub hold): ``model.layers.{L}.block_sparse_moe.gate.weight``
    (E, H) and per expert ``...experts.{e}.w1.weight`` (I, H) (gate),
    ``w3.weight`` (I, H) (up), ``w2.weight`` (H, I) (down); in the
    transformers-5 names (``"v5"``): ``model.layers.{L}.mlp.gate.weight``,
    ``mlp.experts.gate_up_proj`` (E, 2I, H) and ``mlp.experts.down_proj``
    (E, H, I).  Weights are N(0, ``init_std``), as Mixtral initializes them;
    the same ``seed`` gives the same weights in both namings (``w1``/``w3`` are
    the gate/up rows of ``gate_up_proj[e]``, ``w2`` is ``down_proj[e]``), so
    either naming can be checked against the other.
    ``shards``: split by size into at least that many files (1: one
    ``model.safetensors``), with the index a sharded checkpoint has.  A
    config.json with Mixtral's fields.  Needs no ``transformers``; the global
    RNG state is left as it was.
    """
    _check_tiny_args(layers=layers, hidden=hidden, intermediate=intermediate, experts=experts,
                     top_k=top_k, names=names, shards=shards)
    g = torch.Generator().manual_seed(seed)

    def weight(*shape):
        return (torch.randn(*shape, generator=g) * init_std).to(torch.bfloat16)

    state: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        router = weight(experts, hidden)
        gate_up = weight(experts, 2 * intermediate, hidden)
        down = weight(experts, hidden, intermediate)
        if names == "v4":
            prefix = f"model.layers.{layer}.block_sparse_moe."
            state[prefix + "gate.weight"] = router
            for e in range(experts):  # clones: safetensors refuses tensors sharing storage
                for w, t in (("w1", gate_up[e, :intermediate]), ("w2", down[e]),
                             ("w3", gate_up[e, intermediate:])):
                    state[f"{prefix}experts.{e}.{w}.weight"] = t.clone()
        else:
            prefix = f"model.layers.{layer}.mlp."
            state[prefix + "gate.weight"] = router
            state[prefix + "experts.gate_up_proj"] = gate_up
            state[prefix + "experts.down_proj"] = down
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_sharded(state, out_dir, _max_shard_bytes(state, shards))
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
              "hidden_size": hidden, "intermediate_size": intermediate,
              "num_hidden_layers": layers, "num_local_experts": experts,
              "num_experts_per_tok": top_k, "initializer_range": init_std,
              "torch_dtype": "bfloat16"}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def make_tiny_mixtral(out_dir, *, layers: int = 2, hidden: int = 64, intermediate: int = 128,
                      experts: int = 4, top_k: int = 2, vocab: int = 256, names: str = "v4",
                      shards: int = 2, seed: int = 0, init_std: float = 0.02) -> Path:
    """Write a random bf16 Mixtral model checkpoint to ``out_dir``; returns its path.

    Needs ``transformers`` (the ``hf`` extra; :func:`make_tiny_moe_checkpoint`
    does not).  4 attention heads, 2 key/value heads.  ``shards``: the weights
    are split into at least that many files by size (1: one
    ``model.safetensors``).  ``init_std``: the config's ``initializer_range``.
    The global RNG state is left as it was.
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

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state_dict = model.state_dict()
    max_shard_bytes = _max_shard_bytes(state_dict, shards)
    if names == "v4":
        model.save_pretrained(out_dir, max_shard_size=max_shard_bytes)
    else:
        model.config.save_pretrained(out_dir)
        model.generation_config.save_pretrained(out_dir)
        _save_sharded(state_dict, out_dir, max_shard_bytes)
    return out_dir


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
