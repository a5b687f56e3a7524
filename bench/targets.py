"""``python -m bench targets RESULT.json``: the performance targets of a run, met or not.

Each run is also checked for staleness: a warning on stderr when it is older
than the last change to the kernels or the ops (:func:`bench.provenance.staleness`).

The forward targets, per case of a grouped_gemm run, in either weight
layout (``--weight-layout``; the JSON says which).  Each is a time: the
strictest of ``peer ms / ratio`` over its peers, but never below the time at
``cap`` of the roof that bounds the case (HBM read or dense bf16, both
measured in the same run):

- T <= 128: >= 1.10x the faster of ``torch_grouped_mm`` and ``cublas_grouped``,
  or 92 % of the roof (the host-time guard is ``python -m bench overhead``'s);
- 128 < T < 4096: >= 1.20x the fastest of ``torch_grouped_mm``,
  ``cublas_grouped`` and ``cublas_loop``, or 90 % of the roof;
- T >= 4096: >= 1.10x ``torch_grouped_mm`` and >= 1.0x ``cublas_loop``, or 95 %
  of the roof.

The training targets, per case of a training run (one verdict per case and peer):

- a GEMM's ``fwd`` and ``dA``: the forward targets above;
- ``dW``: >= 1.10x ``torch_grouped_mm`` (torch's k-grouped ``_grouped_mm``) and
  >= 1.0x ``cublas_loop``; where a ratio would need more than 95 % of the run's
  measured dense bf16 roof, >= 95 % of it instead;
- the layer's ``fwd+bwd`` at T >= 4096: >= 1.25x ``hf_grouped_mm`` and >= 1.10x
  ``torch_layer``, and a peak memory no higher than that peer's.

The decode-block targets, per case of a moe_block run, for ``ts_moe``:

- CUDA graph: Mixtral-8x7B and DeepSeek-V3 at T = 1 in <= 0.18 ms, Qwen3-30B-A3B
  in <= 30 us; T = 16 and 64 within 1.15x of the case's weight-streaming floor;
- eager: Mixtral-8x7B T = 1 in <= 0.22 ms, Qwen3-30B-A3B T = 1 in <= 80 us, and
  faster than every transformers experts implementation timed (the fastest
  is the verdict's peer).  The host-time target (<= 60 us per call) is
  ``scripts/host_profile.py``'s.
- FP8 (its ``ts_moe_fp8_*`` backends): the Mixtral-8x7B block at T = 1 under CUDA
  graphs in <= 0.11 ms.

The FP8 targets, per case of an fp8 run, for ``ts_moe_fp8`` (the case's
step is its recipe):

- T <= 128: >= 1.8x ``ts_moe_bf16`` on the same case, or >= 90 % of the roof that
  bounds it (the HBM read roof, counting FP8 bytes);
- T >= 4096: blockwise >= 1.6x ``ts_moe_bf16`` and >= 1.0x ``F_scaled_grouped_mm``
  (where the run's torch accepted it); rowwise >= 1.10x ``torch_scaled_grouped_mm``.
"""

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from . import provenance, report
from .roofs import roof_fraction

# the forward targets by T: (peers and the ratio over each, the roof cap)
STREAM_T, LARGE_T = 128, 4096
FORWARD = {
    "stream": ((("torch_grouped_mm", 1.10), ("cublas_grouped", 1.10)), 0.92),
    "mid": ((("torch_grouped_mm", 1.20), ("cublas_grouped", 1.20), ("cublas_loop", 1.20)), 0.90),
    "large": ((("torch_grouped_mm", 1.10), ("cublas_loop", 1.00)), 0.95),
}
SUITES = ("grouped_gemm", "training", "moe_block", "fp8")
# training: (peer, ratio) per step; dW's ratios are capped at FLOP_CAP x the bf16 roof
DW_PEERS = (("torch_grouped_mm", 1.10), ("cublas_loop", 1.00))
FLOP_CAP = 0.95
LAYER_PEERS = (("hf_grouped_mm", 1.25), ("torch_layer", 1.10))
LAYER_MIN_T = 4096
# the decode block: ms bounds by (model, T), graph and eager; the floor ratio at T
BLOCK_GRAPH_MS = {("mixtral-8x7b", 1): 0.18, ("deepseek-v3", 1): 0.18,
                  ("qwen3-30b-a3b", 1): 0.030}
BLOCK_EAGER_MS = {("mixtral-8x7b", 1): 0.22, ("qwen3-30b-a3b", 1): 0.080}
BLOCK_FLOOR_RATIO, BLOCK_FLOOR_T = 1.15, (16, 64)
HF_BACKENDS = ("hf_eager", "hf_grouped_mm", "hf_batched_mm")
# FP8: the decode ratio over ts_moe bf16 or the roof fraction; T >= 4096 peers by recipe;
# the FP8 block's graph bound
FP8_DECODE_RATIO, FP8_DECODE_ROOF = 1.8, 0.90
FP8_LARGE_PEERS = {"blockwise": (("ts_moe_bf16", 1.6), ("F_scaled_grouped_mm", 1.0)),
                   "rowwise": (("torch_scaled_grouped_mm", 1.10),)}
BLOCK_FP8_GRAPH_MS = {("mixtral-8x7b", 1): 0.11}
FP8_BLOCK_BACKENDS = ("ts_moe_fp8_rowwise", "ts_moe_fp8_blockwise")


@dataclass
class Verdict:
    case: tuple  # (model, gemm, T, routing)
    ms: float
    peer: str
    peer_ms: float
    target: str
    tbps: float
    met: bool
    step: str | None = None  # training runs: fwd, dA, dW, fwd+bwd
    tflops: float | None = None
    peak: int | None = None  # training runs: peak memory, bytes (None: not measured)
    peer_peak: int | None = None
    roof: float | None = None  # forward runs: the fraction of the bounding roof reached

    @property
    def ratio(self) -> float:
        return self.peer_ms / self.ms


def forward_regime(T: int) -> str:
    return "stream" if T <= STREAM_T else "large" if T >= LARGE_T else "mid"


def judge(group: list[dict], roofs: dict, backend: str = "ts_moe") -> Verdict | None:
    """The verdict for one case's records (None: ``backend`` or every peer was not timed).

    T <= 128 and 128 < T < 4096 take the faster peer (the target is that peer's
    time over the ratio); T >= 4096 must beat each peer by its ratio.  In each,
    a target time under the roof's time at the cap becomes that time."""
    timed = {r["backend"]: r for r in group if r["status"] == "ok"}
    r = timed.get(backend)
    key = (group[0]["model"], group[0]["gemm"], group[0]["T"], group[0]["routing"])
    regime = forward_regime(key[2])
    peers, cap = FORWARD[regime]
    wants = [(timed[name], want) for name, want in peers if name in timed]
    if r is None or not wants:
        return None
    peer, want = min(wants, key=lambda pw: pw[0]["ms"] / pw[1])  # the strictest
    target_ms = peer["ms"] / want
    target = f">= {want:.2f}x each peer" if regime == "large" else f">= {want:.2f}x"
    frac, bound = roof_fraction(r["ms"], r["flops"], r["bytes"], roofs)
    if frac is not None:
        roof_ms = frac * r["ms"]
        if roof_ms / cap > target_ms:
            target_ms = roof_ms / cap
            target = (f">= {100 * cap:.0f}% of the {bound} roof ({want:.2f}x would need "
                      f"{100 * roof_ms / (peer['ms'] / want):.0f}%)")
    return Verdict(key, r["ms"], peer["backend"], peer["ms"], target, r["tbps"],
                   r["ms"] <= target_ms, tflops=r["tflops"], roof=frac)


def judge_peer(r: dict, peer: dict, want: float, flop_cap: float | None = None,
               memory: bool = False) -> Verdict:
    """``r`` against one peer: ``peer_ms / ms >= want``; with ``flop_cap`` (TFLOP/s),
    where ``want`` would need more than the cap, ``r``'s TFLOP/s >= the cap
    instead; with ``memory``, also a peak memory no higher than the peer's
    (where both were measured)."""
    key = (r["model"], r["gemm"], r["T"], r["routing"])
    ratio = peer["ms"] / r["ms"]
    target, met = f">= {want:.2f}x", ratio >= want
    needed = want * peer["tflops"]
    if flop_cap is not None and needed > flop_cap:
        target = (f">= {flop_cap:.0f} TFLOP/s ({100 * FLOP_CAP:.0f}% of the bf16 roof; "
                  f"{want:.2f}x would need {needed:.0f})")
        met = r["tflops"] >= flop_cap
    peak, peer_peak = r.get("peak_mem_bytes"), peer.get("peak_mem_bytes")
    if memory:
        target += ", peak memory <= the peer's"
        if peak is not None and peer_peak is not None:
            met = met and peak <= peer_peak
    return Verdict(key, r["ms"], peer["backend"], peer["ms"], target, r["tbps"], met,
                   step=r.get("step"), tflops=r["tflops"], peak=peak, peer_peak=peer_peak)


def judge_training(group: list[dict], roofs: dict, backend: str = "ts_moe") -> list[Verdict]:
    """The verdicts of one training case's records: one per peer that was timed
    (none where ``backend`` was not timed)."""
    timed = {r["backend"]: r for r in group if r["status"] == "ok"}
    r = timed.get(backend)
    if r is None:
        return []
    step = r.get("step")
    if step in ("fwd", "dA"):
        v = judge(group, roofs, backend)
        return [] if v is None else [dataclasses.replace(
            v, step=step, tflops=r["tflops"], peak=r.get("peak_mem_bytes"),
            peer_peak=timed[v.peer].get("peak_mem_bytes"))]
    if step == "dW":
        cap = FLOP_CAP * roofs["bf16_dense_tflops"]
        return [judge_peer(r, timed[p], want, flop_cap=cap) for p, want in DW_PEERS
                if p in timed]
    if r["gemm"] == "layer" and r["T"] >= LAYER_MIN_T:
        return [judge_peer(r, timed[p], want, memory=True) for p, want in LAYER_PEERS
                if p in timed]
    return []


def judge_block(group: list[dict], backend: str = "ts_moe") -> list[Verdict]:
    """The verdicts of one moe_block case: ``backend``'s graph time against its
    bound (``peer`` "bound" or "floor"), its eager time against its bound and
    against the fastest transformers implementation timed."""
    timed = {r["backend"]: r for r in group if r["status"] == "ok"}
    r = timed.get(backend)
    if r is None:
        return []
    key = (r["model"], r["gemm"], r["T"], r["routing"])
    model_t = (r["model"], r["T"])
    out = []

    def bound(step, ms, peer, peer_ms, target):
        out.append(Verdict(key, ms, peer, peer_ms, target, r["tbps"], ms <= peer_ms,
                           step=step, tflops=r["tflops"]))

    graph = r.get("graph_ms")
    if graph is not None and model_t in BLOCK_GRAPH_MS:
        bound("graph", graph, "bound", BLOCK_GRAPH_MS[model_t],
              f"<= {BLOCK_GRAPH_MS[model_t]:.3f} ms")
    elif graph is not None and r["T"] in BLOCK_FLOOR_T and r.get("floor_ms"):
        bound("graph", graph, "floor", BLOCK_FLOOR_RATIO * r["floor_ms"],
              f"<= {BLOCK_FLOOR_RATIO:.2f}x the floor ({r['floor_ms']:.3f} ms)")
    if model_t in BLOCK_EAGER_MS:
        bound("eager", r["ms"], "bound", BLOCK_EAGER_MS[model_t],
              f"<= {BLOCK_EAGER_MS[model_t]:.3f} ms")
    hf = [timed[b] for b in HF_BACKENDS if b in timed]
    if hf:
        peer = min(hf, key=lambda p: p["ms"])
        out.append(Verdict(key, r["ms"], peer["backend"], peer["ms"], "> 1.00x (the fastest)",
                           r["tbps"], r["ms"] < peer["ms"], step="eager", tflops=r["tflops"]))
    return out


def judge_fp8(group: list[dict], backend: str = "ts_moe_fp8") -> list[Verdict]:
    """The verdicts of one fp8 case (its step the recipe): T <= 128 one (the bf16 ratio
    or the roof fraction, either meets it), T >= 4096 one per peer timed."""
    timed = {r["backend"]: r for r in group if r["status"] == "ok"}
    r = timed.get(backend)
    if r is None:
        return []
    if r["T"] >= LARGE_T:
        return [judge_peer(r, timed[p], want) for p, want in FP8_LARGE_PEERS.get(r["step"], ())
                if p in timed]
    if r["T"] > STREAM_T:
        return []
    key = (r["model"], r["gemm"], r["T"], r["routing"])
    bf16, frac = timed.get("ts_moe_bf16"), r.get("roof_frac")
    met = (bf16 is not None and bf16["ms"] / r["ms"] >= FP8_DECODE_RATIO) or (
        frac is not None and frac >= FP8_DECODE_ROOF)
    reached = "not measured" if frac is None else f"{100 * frac:.0f}%"
    target = (f">= {FP8_DECODE_RATIO:.2f}x or >= {100 * FP8_DECODE_ROOF:.0f}% of the "
              f"{r.get('bound') or 'hbm'} roof (reached: {reached})")
    return [Verdict(key, r["ms"], "ts_moe_bf16" if bf16 else "roof",
                    bf16["ms"] if bf16 else r["ms"], target, r["tbps"], met, step=r["step"],
                    tflops=r["tflops"], roof=frac)]


def judge_block_fp8(group: list[dict]) -> list[Verdict]:
    """The FP8 block backends' graph times against their bound (Mixtral-8x7B at T = 1)."""
    out = []
    for r in group:
        model_t = (r["model"], r["T"])
        if (r["backend"] in FP8_BLOCK_BACKENDS and r["status"] == "ok"
                and r.get("graph_ms") is not None and model_t in BLOCK_FP8_GRAPH_MS):
            bound = BLOCK_FP8_GRAPH_MS[model_t]
            out.append(Verdict((r["model"], r["gemm"], r["T"], r["routing"]), r["graph_ms"],
                               "bound", bound, f"<= {bound:.3f} ms", r["tbps"],
                               r["graph_ms"] <= bound, step=f"graph {r['backend']}",
                               tflops=r["tflops"]))
    return out


def verdicts(result: dict, backend: str = "ts_moe") -> list[Verdict]:
    if result["suite"] not in SUITES:
        raise ValueError(f"targets are for grouped_gemm, training, moe_block and fp8 runs, "
                         f"not {result['suite']!r}")
    if result["suite"] == "fp8":  # ratios, and the roof fractions its records carry
        groups = report.case_groups(result["cases"]).values()
        fp8_backend = "ts_moe_fp8" if backend == "ts_moe" else backend
        return [v for g in groups for v in judge_fp8(g, fp8_backend)]
    if result["suite"] == "moe_block":  # bounds in ms and the run's own floors
        groups = report.case_groups(result["cases"]).values()
        fp8 = [v for g in groups for v in judge_block_fp8(g)] if backend == "ts_moe" else []
        return [v for g in groups for v in judge_block(g, backend)] + fp8
    if not result.get("roofs"):
        raise ValueError("the run has no measured roofs (a CPU run, or one with --no-roofs): "
                         "the targets need its HBM bandwidth and bf16 roof")
    groups = report.case_groups(result["cases"]).values()
    if result["suite"] == "training":
        return [v for g in groups for v in judge_training(g, result["roofs"], backend)]
    out = [judge(g, result["roofs"], backend) for g in groups]
    return [v for v in out if v is not None]


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / (1 << 30):.2f}"


def _table(vs: list[Verdict], header: list[str], row) -> str:
    """The count line and a markdown table: ``header``'s columns, ``row(v)``'s
    cells for each verdict, and the verdict last."""
    met = sum(v.met for v in vs)
    lines = [f"**{met} of {len(vs)} met, {len(vs) - met} missed.**", "",
             "| " + " | ".join(header + ["met"]) + " |", "|---" * (len(header) + 1) + "|"]
    lines += ["| " + " | ".join(row(v) + ["yes" if v.met else "**no**"]) + " |" for v in vs]
    return "\n".join(lines) + "\n"


def render_training_markdown(vs: list[Verdict], name: str = "ts_moe") -> str:
    def row(v):
        model, gemm, T, routing = v.case
        peak = f"{_gib(v.peak)} / {_gib(v.peer_peak)}" if v.peak is not None else ""
        return [model, gemm, str(v.step), str(T), routing, f"{v.ms:.3f}",
                f"{v.peer} {v.peer_ms:.3f}", f"{v.ratio:.2f}x", v.target, f"{v.tflops:.0f}",
                peak]

    return _table(vs, ["model", "gemm", "step", "T", "routing", f"{name} ms", "peer (ms)",
                       "ratio", "target", f"{name} TFLOP/s", f"peak GiB ({name} / peer)"], row)


def render_block_markdown(vs: list[Verdict], name: str = "ts_moe") -> str:
    def row(v):
        model, _, T, _ = v.case
        return [model, str(T), str(v.step), f"{v.ms:.4f}", f"{v.peer} {v.peer_ms:.4f}",
                f"{v.ratio:.2f}x", v.target]

    return _table(vs, ["model", "T", "mode", f"{name} ms", "against (ms)", "ratio", "target"],
                  row)


def render_markdown(vs: list[Verdict], name: str = "ts_moe") -> str:
    def row(v):
        model, gemm, T, routing = v.case
        roof = "" if v.roof is None else f"{100 * v.roof:.0f}%"
        return [model, gemm, str(T), routing, f"{v.ms:.3f}", f"{v.peer} {v.peer_ms:.3f}",
                f"{v.ratio:.2f}x", v.target, f"{v.tbps:.2f}", f"{v.tflops:.0f}", roof]

    return _table(vs, ["model", "gemm", "T", "routing", f"{name} ms", "strictest peer (ms)",
                       "ratio", "target", f"{name} TB/s", "TFLOP/s", "roof"], row)


def main(argv) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench targets",
        description="The performance targets of a grouped_gemm, training or moe_block run, "
                    "met or not (a markdown table on stdout).")
    parser.add_argument("json", type=Path, help="a run's JSON, e.g. "
                        "bench/results/nvidia-h200-grouped_gemm.json, "
                        "bench/results/nvidia-h200-training.json or "
                        "bench/results/nvidia-h200-moe_block.json")
    parser.add_argument("--backend", default="ts_moe",
                        help="the backend judged (default ts_moe), e.g. a variant timed in "
                             "the same run: ts_moe_router_kernel, ts_moe:band_m=16")
    args = parser.parse_args(argv)
    if not args.json.is_file():
        parser.error(f"no such file: {args.json}")
    try:
        result = report.load_json(args.json)
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        parser.error(f"{args.json} is not a run's JSON: {exc}")
    try:
        vs = verdicts(result, args.backend)
    except ValueError as exc:  # a suite without targets, or no roofs
        parser.error(f"{args.json}: {exc}")
    except (KeyError, TypeError, AttributeError) as exc:
        parser.error(f"{args.json} is not a run's JSON ({type(exc).__name__}: {exc})")
    warning = provenance.staleness(result)
    if warning:
        print(warning, file=sys.stderr)
    suite = result["suite"]
    if not vs:
        peers = {"training": "torch_grouped_mm, cublas_loop, hf_grouped_mm, torch_layer",
                 "moe_block": ", ".join(HF_BACKENDS) + ", or a bound at its T",
                 "fp8": "ts_moe_bf16, torch_scaled_grouped_mm, F_scaled_grouped_mm, "
                        "or the roof at T <= 128"}.get(
                     suite, "torch_grouped_mm, cublas_grouped, cublas_loop")
        parser.error(f"{args.json}: no case has {args.backend} and a peer ({peers}) both timed")
    render = {"training": render_training_markdown, "moe_block": render_block_markdown,
              "fp8": render_training_markdown}.get(suite, render_markdown)
    print(render(vs, args.backend), end="")
    return 0
