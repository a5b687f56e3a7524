#!/usr/bin/env python3
"""ts_moe's vLLM experts on an sm_90 GPU: against vLLM 0.33's default Triton experts on the
same weights, and under CUDA-graph capture at vLLM's decode sizes.

    python scripts/vllm_gpu_check.py --vllm-tree /tmp/vllm-py --commit HASH --out r.json
    python scripts/vllm_gpu_check.py --vllm-tree ... --models qwen3-30b-a3b --formats bf16

``--vllm-tree``: a directory that holds vLLM 0.33.0's Python package (``vllm/``) and the
pure-Python packages its imports need that the machine lacks; it goes first on
``sys.path``. vLLM's compiled extensions are not needed: the helper ops its Triton experts
call and the machine lacks are torch stand-ins (``scripts/vllm_standin_ops.py``), and the
results name them, so that vLLM's times read "with torch stand-ins for ...".

For each model (``bench.cases``: Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3 expert shapes,
all experts on one GPU) and format (bf16; block FP8 128x128 with 1x128 activations), one
set of random weights and, per token count, one routing (softmax top-k, renormalised):

1. each backend through vLLM's ``FusedMoEKernel`` with its no-DP/EP prepare/finalize:
   ``ts_moe`` (``TsMoeExperts`` / ``TsMoeFp8Experts``) and ``vllm_triton`` (vLLM's
   ``TritonExperts``, its default on Hopper for both formats); their outputs compared
   (relative error, reported; a failed check is reported, and that case not timed);
2. each timed at T = 1, 16, 128, 1024, 4096 (``bench.timing.measure``: CUDA events, the
   median), eagerly and as a CUDA graph of one call;
3. ts_moe's experts captured in a CUDA graph at each of vLLM's decode sizes and replayed:
   bit-equal to the eager call, or the case says how it differs.

Writes one JSON (``--out``): the rows, the stand-ins, the provenance (``bench.provenance``)
and the vLLM release. Needs about 40 GB of GPU memory for DeepSeek-V3 in bf16.
"""

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "scripts"))

TOKENS = (1, 16, 128, 1024, 4096)
DECODE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # vLLM's smallest capture sizes
MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")
FORMATS = ("bf16", "fp8")
BLOCK = [128, 128]
CHECK_LIMIT = {"bf16": 2e-2, "fp8": 6e-2}  # relative error between the two backends


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-tree", type=Path, required=True,
                   help="directory holding vLLM 0.33.0's Python package (put first on sys.path)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--decode-sizes", default=",".join(map(str, DECODE_SIZES)))
    p.add_argument("--commit", default=None, help="the commit of this tree (a copy without .git)")
    p.add_argument("--out", type=Path, default=Path("vllm_gpu_check.json"))
    return p.parse_args(argv)


def route(tokens, experts, top_k, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    probs = torch.randn(tokens, experts, generator=g, device=device).softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


class Layer:
    """One model's experts in one format: the weights both backends read, and each
    backend's ``FusedMoEKernel`` on them."""

    def __init__(self, model, fmt, device):
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import (
            FusedMoEConfig, FusedMoEParallelConfig, FusedMoEQuantConfig, RoutingMethodType,
            fp8_w8a8_moe_quant_config)
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
        from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
            MoEPrepareAndFinalizeNoDPEPModular)

        import ts_moe
        from ts_moe.integrations.vllm_experts import TsMoeExperts, TsMoeFp8Experts

        self.model, self.fmt, self.device = model, fmt, device
        self.silu = MoEActivation.SILU
        g = torch.Generator(device=device).manual_seed(0)
        e, h, i = model.experts, model.hidden, model.inter
        w13 = torch.randn(e, 2 * i, h, generator=g, device=device, dtype=torch.bfloat16)
        w13.mul_(h**-0.5)
        w2 = torch.randn(e, h, i, generator=g, device=device, dtype=torch.bfloat16).mul_(i**-0.5)
        config = FusedMoEConfig(
            num_experts=e, experts_per_token=model.top_k, hidden_dim=h, intermediate_size=i,
            num_local_experts=e, num_logical_experts=e, activation=MoEActivation.SILU,
            device=device, routing_method=RoutingMethodType.Renormalize,
            moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
            in_dtype=torch.bfloat16)
        if fmt == "bf16":
            self.w13, self.w2 = w13, w2
            quant, ts_cls = FusedMoEQuantConfig.make(), TsMoeExperts
        else:
            self.w13, s13 = ts_moe.quantize_fp8(w13, "blockwise_128x128")
            self.w2, s2 = ts_moe.quantize_fp8(w2, "blockwise_128x128")
            quant = fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2, block_shape=BLOCK)
            ts_cls = TsMoeFp8Experts
        del w13, w2
        supported, reason = ts_cls.is_supported_config(
            ts_cls, config, *self._keys(fmt), mk.FusedMoEActivationFormat.Standard)
        if not supported:
            raise RuntimeError(f"ts_moe declines {model.name} {fmt}: {reason}")
        self.kernels = {
            "ts_moe": mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(),
                                        ts_cls(moe_config=config, quant_config=quant)),
            "vllm_triton": mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(),
                                             TritonExperts(moe_config=config,
                                                           quant_config=quant)),
        }

    @staticmethod
    def _keys(fmt):
        if fmt == "bf16":
            return None, None
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            kFp8Dynamic128Sym, kFp8Static128BlockSym)
        return kFp8Static128BlockSym, kFp8Dynamic128Sym

    def call(self, backend, x, weights, ids):
        return lambda: self.kernels[backend].apply(
            x, self.w13, self.w2, weights, ids, activation=self.silu,
            global_num_experts=self.model.experts, expert_map=None,
            apply_router_weight_on_input=False)


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def case(layer, tokens, measure):
    """Both backends at ``tokens``: their agreement, then each one's eager and graph time."""
    m = layer.model
    x = torch.randn(tokens, m.hidden, device=layer.device, dtype=torch.bfloat16)
    weights, ids = route(tokens, m.experts, m.top_k, layer.device, seed=tokens)
    outs = {b: layer.call(b, x, weights, ids)() for b in layer.kernels}
    err = rel_err(outs["ts_moe"], outs["vllm_triton"])
    row = {"model": m.name, "format": layer.fmt, "tokens": tokens, "rel_err": err,
           "check": "ok" if err <= CHECK_LIMIT[layer.fmt] else
           f"failed: relative error {err:.3g} > {CHECK_LIMIT[layer.fmt]}"}
    if row["check"] != "ok":
        return row
    for backend in layer.kernels:
        run = layer.call(backend, x, weights, ids)
        for graph in (False, True):
            key = f"{backend}_{'graph' if graph else 'eager'}_ms"
            try:
                row[key] = measure([run], torch.device(layer.device), graph=graph).ms
            except Exception as exc:  # reported in the row; the other timings go on
                row[key] = None
                row.setdefault("errors", []).append(f"{key}: {type(exc).__name__}: {exc}")
    for graph in ("eager", "graph"):
        ts, tr = row.get(f"ts_moe_{graph}_ms"), row.get(f"vllm_triton_{graph}_ms")
        row[f"speedup_{graph}"] = tr / ts if ts and tr else None
    return row


def decode_graphs(layer, sizes):
    """ts_moe's experts captured at each decode size, replayed on new inputs copied into
    the captured ones: bit-equal to the eager call on the same inputs."""
    rows = []
    m = layer.model
    for tokens in sizes:
        x = torch.randn(tokens, m.hidden, device=layer.device, dtype=torch.bfloat16)
        weights, ids = route(tokens, m.experts, m.top_k, layer.device, seed=1000 + tokens)
        run = layer.call("ts_moe", x, weights, ids)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()  # warm: kernels built, workspaces allocated
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        new_weights, new_ids = route(tokens, m.experts, m.top_k, layer.device,
                                     seed=2000 + tokens)
        x.copy_(torch.randn_like(x))
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        eager = run()
        torch.cuda.synchronize()
        same = torch.equal(captured, eager)
        rows.append({"model": m.name, "format": layer.fmt, "tokens": tokens,
                     "graph_equals_eager": same,
                     "max_abs_diff": float((captured.float() - eager.float()).abs().max())})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(args.vllm_tree))
    import vllm_standin_ops

    stand_ins = vllm_standin_ops.install()  # before vLLM looks its ops up
    import vllm
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.worker.workspace import init_workspace_manager

    from bench.cases import MODELS as BENCH_MODELS
    from bench.provenance import collect
    from bench.timing import measure

    if not torch.cuda.is_available():
        print("no CUDA device: this script runs on an sm_90 GPU", file=sys.stderr)
        return 2
    device = "cuda"
    init_workspace_manager(torch.device(device))
    result = {"vllm": vllm.__version__, "stand_ins": stand_ins,
              "vllm_triton_label": ("vLLM's Triton experts" + (
                  f" with torch stand-ins for {', '.join(stand_ins)}" if stand_ins else "")),
              "provenance": collect(torch.device(device), given_commit=args.commit),
              "rows": [], "decode_graphs": [], "failures": []}
    with set_current_vllm_config(VllmConfig()):
        for name in args.models.split(","):
            for fmt in args.formats.split(","):
                try:
                    layer = Layer(BENCH_MODELS[name], fmt, device)
                    for tokens in map(int, args.tokens.split(",")):
                        row = case(layer, tokens, measure)
                        result["rows"].append(row)
                        print(json.dumps(row), flush=True)
                    result["decode_graphs"] += decode_graphs(
                        layer, list(map(int, args.decode_sizes.split(","))))
                except Exception:  # the next model and format still run
                    result["failures"].append({"model": name, "format": fmt,
                                               "error": traceback.format_exc()})
                    print(result["failures"][-1]["error"], file=sys.stderr, flush=True)
                layer = None
                torch.cuda.empty_cache()
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}: {len(result['rows'])} cases, "
          f"{len(result['failures'])} failures; vLLM's side: {result['vllm_triton_label']}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
