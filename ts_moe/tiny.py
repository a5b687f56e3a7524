"""A tiny random Mixtral checkpoint in the real Hugging Face format, for tests and the demo.

Needs ``transformers``: the model is ``MixtralForCausalLM(MixtralConfig(...))``
with its own random init, in bfloat16.  ``names="v4"`` writes it with
``save_pretrained`` (transformers 5 saves the transformers-4 expert names,
``block_sparse_moe.experts.{e}.w1/w2/w3``); ``names="v5"`` writes the
in-memory transformers-5 names (``mlp.experts.gate_up_proj`` / ``down_proj``)
in the same sharded layout.
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


def make_tiny_mixtral(out_dir, *, layers: int = 2, hidden: int = 64, intermediate: int = 128,
                      experts: int = 4, top_k: int = 2, vocab: int = 256, names: str = "v4",
                      shards: int = 2, seed: int = 0, init_std: float = 0.02) -> Path:
    """Write a random bf16 Mixtral checkpoint to ``out_dir``; returns its path.

    4 attention heads, 2 key/value heads.  ``shards``: the weights are split
    into at least that many files by size (1: one ``model.safetensors``).
    ``init_std``: the config's ``initializer_range``.  The global RNG state is
    left as it was.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

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
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    max_shard_bytes = math.ceil(total / shards) if shards > 1 else total
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
