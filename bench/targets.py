"""``python -m bench targets RESULT.json``: the grouped GEMM performance targets, met or not.

The targets (issue 4), per case of a grouped_gemm run:

- T <= 128: ts_moe >= 1.10x the faster of ``torch_grouped_mm`` and ``cublas_grouped``;
- T = 1024: >= 1.20x that peer;
- T <= 1024: where the ratio would need more than 90 % of the run's measured HBM
  read bandwidth, >= 90 % of it instead;
- T >= 4096: >= 1.10x ``torch_grouped_mm``; Mixtral gate_up at T = 16384 also
  >= 700 TFLOP/s.
"""

import argparse
from dataclasses import dataclass
from pathlib import Path

from . import report

STREAM_RATIO, MID_RATIO, LARGE_RATIO = 1.10, 1.20, 1.10
HBM_CAP = 0.90
TFLOPS_TARGET = {("mixtral-8x7b", "gate_up", 16384): 700.0}


@dataclass
class Verdict:
    case: tuple  # (model, gemm, T, routing)
    ms: float
    peer: str
    peer_ms: float
    target: str
    tbps: float
    met: bool

    @property
    def ratio(self) -> float:
        return self.peer_ms / self.ms


def judge(group: list[dict], hbm_tbps: float, backend: str = "ts_moe") -> Verdict | None:
    """The verdict for one case's records (None: ``backend`` or every peer was not timed)."""
    timed = {r["backend"]: r for r in group if r["status"] == "ok"}
    r = timed.get(backend)
    key = (group[0]["model"], group[0]["gemm"], group[0]["T"], group[0]["routing"])
    T = key[2]
    names = ("torch_grouped_mm", "cublas_grouped") if T <= 1024 else ("torch_grouped_mm",)
    peers = [timed[n] for n in names if n in timed]
    if r is None or not peers:
        return None
    peer = min(peers, key=lambda p: p["ms"])
    ratio = peer["ms"] / r["ms"]
    want = STREAM_RATIO if T <= 128 else MID_RATIO if T <= 1024 else LARGE_RATIO
    target = f">= {want:.2f}x"
    met = ratio >= want
    if T <= 1024:
        needed = want * peer["tbps"]
        if needed > HBM_CAP * hbm_tbps:
            cap = HBM_CAP * hbm_tbps
            target = (f">= {cap:.2f} TB/s ({100 * HBM_CAP:.0f}% HBM; {want:.2f}x would need "
                      f"{needed:.2f})")
            met = r["tbps"] >= cap
    tflops = TFLOPS_TARGET.get(key[:3])
    if tflops is not None:
        target += f", >= {tflops:.0f} TFLOP/s"
        met = met and r["tflops"] >= tflops
    return Verdict(key, r["ms"], peer["backend"], peer["ms"], target, r["tbps"], met)


def verdicts(result: dict, backend: str = "ts_moe") -> list[Verdict]:
    if result["suite"] != "grouped_gemm":
        raise ValueError(f"targets are for grouped_gemm runs, not {result['suite']!r}")
    if not result.get("roofs"):
        raise ValueError("the run has no measured roofs (a CPU run, or one with --no-roofs): "
                         "the targets need its HBM bandwidth")
    hbm = result["roofs"]["hbm_read_tbps"]
    out = [judge(g, hbm, backend) for g in report.case_groups(result["cases"]).values()]
    return [v for v in out if v is not None]


def render_markdown(vs: list[Verdict]) -> str:
    met = sum(v.met for v in vs)
    lines = [f"**{met} of {len(vs)} met, {len(vs) - met} missed.**", "",
             "| model | gemm | T | routing | ts_moe ms | peer (ms) | ratio | target | "
             "ts_moe TB/s | met |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for v in vs:
        model, gemm, T, routing = v.case
        lines.append(f"| {model} | {gemm} | {T} | {routing} | {v.ms:.3f} | {v.peer} "
                     f"{v.peer_ms:.3f} | {v.ratio:.2f}x | {v.target} | {v.tbps:.2f} | "
                     f"{'yes' if v.met else '**no**'} |")
    return "\n".join(lines) + "\n"


def main(argv) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench targets",
        description="The grouped GEMM performance targets of a grouped_gemm run, met or not "
                    "(a markdown table on stdout).")
    parser.add_argument("json", type=Path, help="a run's JSON, e.g. "
                        "bench/results/nvidia-h200-grouped_gemm.json")
    args = parser.parse_args(argv)
    if not args.json.is_file():
        parser.error(f"no such file: {args.json}")
    try:
        result = report.load_json(args.json)
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        parser.error(f"{args.json} is not a run's JSON: {exc}")
    try:
        vs = verdicts(result)
    except ValueError as exc:  # not a grouped_gemm run, or no roofs
        parser.error(f"{args.json}: {exc}")
    except (KeyError, TypeError, AttributeError) as exc:
        parser.error(f"{args.json} is not a run's JSON ({type(exc).__name__}: {exc})")
    if not vs:
        parser.error(f"{args.json}: no case has ts_moe and a peer (torch_grouped_mm, "
                     f"cublas_grouped) both timed")
    print(render_markdown(vs), end="")
    return 0
