"""``python -m bench``: run a benchmark suite, and the subcommands around it.

    python -m bench                                  # full grouped_gemm suite
    python -m bench --quick                          # ~2 minute subset
    python -m bench --models qwen3 --T 16,1024 --backends ts_moe,torch_grouped_mm
    python -m bench --suite moe_layer --list         # show cases and backends only
    python -m bench report bench/results/nvidia-h200-grouped_gemm.json
    python -m bench overhead                         # host time of one op call
    python -m bench targets bench/results/nvidia-h200-grouped_gemm.json  # issue 4 targets

A run prints one progress line per case on stderr and the results table on
stdout, then writes bench/results/<gpu>-<suite>.json, its plot
(<gpu>-<suite>.png) and its section of bench/RESULTS.md.  Exit status 1 if
any backend computed a wrong result.

The suites are sized for an H200.  On a machine without CUDA (or with
``--device cpu``) the run says so at once and, unless models or token counts
are named, runs the CPU smoke suite instead (:data:`bench.cases.SMOKE_MODELS`):
it checks the harness end to end in well under two minutes; its times are of
the plain-torch reference path, not of any kernel.
"""

import argparse
import datetime
import shlex
import sys
from pathlib import Path

import torch

from . import cases as case_lib
from . import report
from .roofs import measure_roofs
from .runner import SUITES, TOLERANCE, Settings, run_suite


def _csv(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parse.__name__ = f"comma-separated {kind.__name__}"
    return parse


SUBCOMMANDS = {
    "report": "python -m bench report RESULT.json: rebuild a run's RESULTS.md section and plot",
    "targets": "python -m bench targets RESULT.json: the grouped GEMM targets, met or not",
    "overhead": "python -m bench overhead: host time of one op call (needs CUDA)",
}
CPU_TARGET_MS = 10.0  # timed work per backend and case in the CPU smoke suite


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="MoE grouped-GEMM benchmarks, backends side by side. Without CUDA: "
                    "a CPU smoke suite of small models (see --device).",
        epilog="subcommands (each takes --help):\n"
               + "\n".join(f"  {name:9s} {text}" for name, text in SUBCOMMANDS.items()))
    p.add_argument("--suite", choices=sorted(SUITES), default="grouped_gemm")
    p.add_argument("--models", type=_csv(str),
                   help=f"models (unique prefixes work); all: {','.join(case_lib.MODELS)}; "
                        f"CPU smoke: {','.join(case_lib.SMOKE_MODELS)}")
    p.add_argument("--T", type=_csv(int), help="token counts; default "
                   f"{','.join(map(str, case_lib.GEMM_T))} (moe_layer: also 1)")
    p.add_argument("--gemms", type=_csv(str), help="grouped_gemm: gate_up,down (default both)")
    p.add_argument("--routing", type=_csv(str), help="uniform,skewed (default both)")
    p.add_argument("--backends", type=_csv(str), help="default: the suite's usual ones")
    p.add_argument("--weight-layout", choices=case_lib.WEIGHT_LAYOUTS, default="nmajor",
                   help="grouped_gemm b: (E,K,N) N-major, or kmajor = w.transpose(-2,-1) "
                        "of an (E,N,K) tensor")
    p.add_argument("--quick", action="store_true",
                   help=f"T {','.join(map(str, case_lib.QUICK_T))}, uniform routing, "
                        f"{' and '.join(case_lib.QUICK_MODELS)} (explicit filters win)")
    p.add_argument("--graphs", action="store_true",
                   help="time CUDA-graph replays (GPU time only) for cases with T <= --graph-max-t")
    p.add_argument("--graph-max-t", type=int, default=1024)
    p.add_argument("--no-roofs", action="store_true", help="skip measuring HBM and GEMM roofs")
    p.add_argument("--target-ms", type=float,
                   help=f"timed work per backend per case (5 to 200 calls); default 100, "
                        f"{CPU_TARGET_MS:g} on the CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="default: cuda when torch sees a GPU, else cpu (the smoke "
                                    "suite, unless --models or --T are given)")
    p.add_argument("--input-budget-gb", type=float, default=36.0,
                   help="memory for a case's rotated input copies")
    p.add_argument("--out-dir", type=Path, default=report.RESULTS_DIR)
    p.add_argument("--results-md", type=Path, default=report.RESULTS_MD)
    p.add_argument("--no-save", action="store_true", help="no JSON, markdown or plot")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--list", action="store_true", help="print the cases and backends, run nothing")
    return p


def build_report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench report",
                                description="Rebuild the RESULTS.md section and the plot of a run.")
    p.add_argument("json", type=Path)
    p.add_argument("--results-md", type=Path, default=report.RESULTS_MD)
    p.add_argument("--no-plots", action="store_true")
    return p


def _pick(names, known, what: str, parser) -> list[str]:
    """Each name exactly, or as the unique prefix of one known name."""
    out = []
    for name in names:
        low = name.lower()
        hits = [k for k in known if k == low] or [k for k in known if k.startswith(low)]
        if len(hits) != 1:
            parser.error(f"{what} {name!r} matches {hits or 'nothing'}; known: {', '.join(known)}")
        out.append(hits[0])
    return out


def resolve(args, parser) -> dict:
    """The run's selection from the arguments: explicit filters, else --quick's, else all;
    on the CPU, the smoke suite's models and token counts unless named."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device (use --device cpu)")
    cpu = torch.device(args.device).type == "cpu"
    suite = SUITES[args.suite]
    layer = args.suite == "moe_layer"
    full_t = case_lib.LAYER_T if layer else case_lib.GEMM_T
    if cpu:
        default_models, default_t = list(case_lib.SMOKE_MODELS), list(case_lib.SMOKE_T)
    elif args.quick:
        default_models, default_t = list(case_lib.QUICK_MODELS), list(case_lib.QUICK_T)
    else:
        default_models, default_t = list(case_lib.MODELS), list(full_t)
    known_models = [*case_lib.MODELS, *case_lib.SMOKE_MODELS]
    sel = {
        "suite": suite,
        "models": _pick(args.models or default_models, known_models, "model", parser),
        "T": args.T or default_t,
        "routing": _pick(args.routing or (case_lib.QUICK_ROUTINGS if args.quick
                                          else case_lib.ROUTINGS),
                         list(case_lib.ROUTINGS), "routing", parser),
        "gemms": _pick(args.gemms or case_lib.GEMMS, list(case_lib.GEMMS), "gemm", parser),
        "backends": args.backends or list(suite.default_backends),
    }
    if any(t < 1 for t in sel["T"]):
        parser.error("every T must be >= 1")
    known = suite.backends()
    try:
        bad = [b for b in sel["backends"] if b not in known]
    except ValueError as exc:  # a malformed ts_moe:... variant
        parser.error(str(exc))
    if bad:
        parser.error(f"unknown {args.suite} backends {bad}; known: {', '.join(known)}")
    return sel


def make_cases(args, sel) -> list:
    if args.suite == "moe_layer":
        return case_lib.layer_cases(sel["models"], sel["T"], sel["routing"], args.seed)
    return case_lib.gemm_cases(sel["models"], sel["T"], sel["gemms"], sel["routing"],
                               args.seed, args.weight_layout)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run(argv) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sel = resolve(args, parser)
    cases = make_cases(args, sel)
    if torch.device(args.device).type == "cpu" and not args.list:
        big = [m for m in sel["models"] if m in case_lib.MODELS]
        print("python -m bench: no CUDA device" if not torch.cuda.is_available()
              else "python -m bench: --device cpu", end="", file=sys.stderr)
        print(f"; running {len(cases)} cases of {', '.join(sel['models'])} at T="
              f"{','.join(map(str, sel['T']))} on the CPU. CPU times are of the plain-torch "
              f"reference path, not of the kernels"
              + (f"; {', '.join(big)} {'is' if len(big) == 1 else 'are'} sized for an H200 and "
                 f"will take long here." if big else "."), file=sys.stderr, flush=True)
        if args.target_ms is None:
            args.target_ms = CPU_TARGET_MS
    if args.target_ms is None:
        args.target_ms = 100.0
    if args.list:
        print(f"backends: {', '.join(sel['backends'])}")
        for case in cases:
            print(case.describe())
        return 0
    device = torch.device(args.device)
    roofs = None
    if not args.no_roofs and device.type == "cuda":
        roofs = measure_roofs(device)
        print(f"roofs: {roofs['hbm_read_tbps']:.2f} TB/s HBM read, "
              f"{roofs['bf16_dense_tflops']:.0f} TFLOP/s bf16", file=sys.stderr)
    settings = Settings(device, target_ms=args.target_ms, graphs=args.graphs,
                        graph_max_t=args.graph_max_t,
                        input_budget_bytes=int(args.input_budget_gb * (1 << 30)))
    records = run_suite(sel["suite"], cases, sel["backends"], settings, roofs,
                        progress=sys.stderr)
    report.add_ratios(records)
    result = {
        "suite": args.suite,
        "device": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "roofs": roofs,
        "command": shlex.join(["python", "-m", "bench", *argv]),
        "settings": {"target_ms": args.target_ms, "graphs": args.graphs,
                     "graph_max_t": args.graph_max_t, "seed": args.seed, "tolerance": TOLERANCE,
                     "input_budget_gb": args.input_budget_gb},
        "cases": records,
    }
    print(report.render_text(records))
    if not args.no_save:
        json_path = report.write_json(result, args.out_dir)
        md_path = report.update_results_md(json_path, args.results_md)
        print(f"wrote {json_path} and its section of {md_path}", file=sys.stderr)
        if not args.no_plots:
            png = report.plot(result, args.out_dir)
            if png:
                print(f"wrote {png}", file=sys.stderr)
    return 1 if any(r["status"] == "wrong" for r in records) else 0


def report_command(argv) -> int:
    args = build_report_parser().parse_args(argv)
    result = report.load_json(args.json)
    md_path = report.update_results_md(args.json, args.results_md)
    print(report.render_markdown(result))
    print(f"updated {md_path}", file=sys.stderr)
    if not args.no_plots:
        png = report.plot(result, args.json.parent)
        if png:
            print(f"wrote {png}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        return report_command(argv[1:])
    if argv[:1] == ["targets"]:
        from . import targets

        return targets.main(argv[1:])
    if argv[:1] == ["overhead"]:
        from . import overhead

        return overhead.main(argv[1:])
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
