#!/usr/bin/env python3
"""Milliseconds per generated token of a real client: greedy ``generate`` of a
Hugging Face MoE model with random weights, its experts on ts_moe or on each of
transformers' experts implementations.

    python scripts/generate_latency.py                       # both models, eager
    python scripts/generate_latency.py --compile             # also generate's compiled decode
    python scripts/generate_latency.py --models mixtral --layers 4 --new-tokens 64
    python scripts/generate_latency.py --impls ts_moe,grouped_mm --compile

Models (bf16, ``--layers`` decoder layers, layer shapes of the real ones):
MixtralForCausalLM with Mixtral-8x7B's (H 4096, I 14336, 8 experts, top-2) and
Qwen3MoeForCausalLM with Qwen3-30B-A3B's (H 2048, I 768, 128 experts, top-8).
Implementations: transformers' ``eager``, ``grouped_mm`` and ``batched_mm``
experts, ts_moe through ``experts_implementation="ts_moe"``, and for Mixtral
also ts_moe through ``replace_moe_blocks``.  Per token = (time of ``N`` new
tokens - time of 2) / (N - 2): decode steps only; what every ``generate``
call costs once (the prefill, the first compiled step's setup) cancels.  The
prompt is the same random tokens for every implementation.  ``--tiny``: small
shapes, for a CPU smoke run of the script itself.
"""

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

SHAPES = {  # name: (config class name, full-size kwargs, tiny kwargs)
    "mixtral": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14336,
                                      num_local_experts=8, num_experts_per_tok=2,
                                      num_attention_heads=32, num_key_value_heads=8,
                                      vocab_size=32000),
                dict(hidden_size=64, intermediate_size=128, num_local_experts=4,
                     num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=256)),
    "qwen3": ("Qwen3MoeConfig", dict(hidden_size=2048, moe_intermediate_size=768,
                                     num_experts=128, num_experts_per_tok=8,
                                     num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                     vocab_size=32000, intermediate_size=6144),
              dict(hidden_size=64, moe_intermediate_size=32, num_experts=8,
                   num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, vocab_size=256, intermediate_size=128)),
}
MODEL_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3": "Qwen3MoeForCausalLM"}
HF_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def build(name: str, layers: int, tiny: bool, device, implementation: str):
    """The model with seeded random weights and ``implementation``'s experts."""
    import transformers

    from ts_moe.integrations.transformers import register, replace_moe_blocks

    config_name, full, small = SHAPES[name]
    config = getattr(transformers, config_name)(num_hidden_layers=layers,
                                                **(small if tiny else full))
    experts = "ts_moe" if implementation == "ts_moe" else (
        "eager" if implementation == "ts_moe_replace" else implementation)
    if experts == "ts_moe":
        register()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device(device):
            model = getattr(transformers, MODEL_CLASSES[name])(config).to(torch.bfloat16)
    model.set_experts_implementation(experts)
    if implementation == "ts_moe_replace":
        replace_moe_blocks(model)
    return model.eval()


def ms_per_token(model, prompt, new_tokens: int, repeats: int, device) -> float:
    def run(n):
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)

    def timed(n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run(n)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    run(new_tokens)  # warm up both lengths: kernels compiled, caches made
    run(2)
    # two lengths that both run decode steps: a cost paid once per generate
    # call, in its prefill or its first (compiled) decode step, cancels
    few = statistics.median(timed(2) for _ in range(repeats))
    many = statistics.median(timed(new_tokens) for _ in range(repeats))
    return (many - few) / (new_tokens - 2) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="mixtral,qwen3")
    p.add_argument("--impls", help="comma-separated subset of eager, grouped_mm, batched_mm, "
                   "ts_moe, ts_moe_replace (default: all)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true",
                   help="also transformers' compiled decode step (a static cache; "
                   "torch.compile(fullgraph=True, mode='reduce-overhead'))")
    p.add_argument("--tiny", action="store_true", help="small shapes (a CPU smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.new_tokens < 3:
        p.error("--new-tokens must be at least 3")
    device = torch.device(args.device)
    print("| model | experts | mode | ms per token |\n|---|---|---|---|")
    for name in args.models.split(","):
        if name not in SHAPES:
            p.error(f"unknown model {name!r}; expected {sorted(SHAPES)}")
        vocab = (SHAPES[name][2] if args.tiny else SHAPES[name][1])["vocab_size"]
        prompt = torch.randint(0, vocab, (1, args.prompt),
                               generator=torch.Generator().manual_seed(1)).to(device)
        impls = (*HF_IMPLEMENTATIONS, "ts_moe") + (("ts_moe_replace",) if name == "mixtral"
                                                   else ())
        if args.impls:
            wanted = args.impls.split(",")
            unknown = sorted(set(wanted) - {*HF_IMPLEMENTATIONS, "ts_moe", "ts_moe_replace"})
            if unknown:
                p.error(f"unknown implementations {unknown}")
            impls = [i for i in impls if i in wanted]
        for impl in impls:
            model = build(name, args.layers, args.tiny, device, impl)
            modes = [("eager", model)]
            if args.compile:
                # the eager row keeps the default (dynamic) cache: with a static
                # one, transformers' generate compiles the forward by itself
                # (bench/notes/2026-12-04-generate-latency.md).  The
                # compiled row is that path, as a user takes it: a static
                # cache, and generate compiles its decode step with
                # torch.compile(fullgraph=True, mode="reduce-overhead") (the
                # prefill stays eager).  A forward compiled by hand instead
                # fails in generate: it reads a CUDA-graph output after the
                # next replay, with every implementation (the same note)
                from transformers import CompileConfig

                compiled = build(name, args.layers, args.tiny, device, impl)
                compiled.generation_config.cache_implementation = "static"
                compiled.generation_config.compile_config = CompileConfig(
                    fullgraph=True, mode="reduce-overhead")
                modes.append(("compiled", compiled))
            for mode, m in modes:
                try:
                    ms = f"{ms_per_token(m, prompt, args.new_tokens, args.repeats, device):.3f}"
                except Exception as exc:  # an implementation this machine can't run
                    ms = f"failed: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
                    traceback.print_exc()  # to stderr, for the failure's origin
                print(f"| {name} | {impl} | {mode} | {ms} |", flush=True)
            del model, modes
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
