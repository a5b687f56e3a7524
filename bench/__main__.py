"""``python -m bench``: run a benchmark suite, and the subcommands around it.

    python -m bench                                  # full grouped_gemm suite
    python -m bench --quick                          # ~2 minute subset
    python -m bench --models qwen3 --T 16,1024 --backends ts_moe,torch_grouped_mm
    python -m bench --suite moe_layer --list         # show cases and backends only
    python -m bench --suite training                 # fwd, dA, dW and layer fwd+bwd (~3 min)
    python -m bench --suite moe_block                # router + top-k + experts: eager
                                                     # (host + GPU) and CUDA-graph ms
    python -m bench --suite moe_block --quick --models qwen3 --backends ts_moe,hf_grouped_mm
    python -m bench --out-dir bench/results          # a run to commit (see below)
    python -m bench --suite fp8                      # FP8 GEMMs: blockwise and rowwise
    python -m bench --suite moe_block --backends ts_moe,ts_moe_fp8_rowwise,ts_moe_fp8_blockwise
    python -m bench report bench/results/nvidia-h200-grouped_gemm.json   # its tables
    python -m bench report --readme                  # RESULTS.md, the README's generated parts
    python -m bench overhead                         # host time of one op call
    python -m bench targets bench/results/nvidia-h200-grouped_gemm.json  # prefill targets
    python -m bench targets bench/results/nvidia-h200-training.json      # training targets
    python -m bench targets bench/results/nvidia-h200-moe_block.json     # decode block targets

The moe_block suite times the whole MoE block (router GEMM, top-k, experts;
routing is the router's own) twice in one run: eagerly, an event pair around
each call, so a host-bound call counts its host time (``ms``), and as CUDA-graph
replays (``graph_ms``; ``unavailable`` for a block that cannot be captured);
``floor ms`` is the weight-streaming floor (touched experts + router over the
measured HBM roof).  ts_moe's per-stage NVTX ranges (route, permute, gate_up,
down, combine) show in its eager calls under Nsight Systems.

A run prints one progress line per case on stderr and the results table on
stdout, then writes <out-dir>/<gpu>-<suite>.json (with the run's provenance:
commit, tree state, host, GPU, driver, package versions; :mod:`bench.provenance`)
and its plot <gpu>-<suite>.png; ``--results-md FILE`` also writes its markdown
section into FILE.  The default out-dir is outside the checkout
(:func:`bench.report.default_out_dir`); a run meant to become the committed
numbers names ``--out-dir bench/results``, and ``python -m bench report
--readme`` then regenerates ``bench/RESULTS.md`` and the README's status from
the committed JSON.  Exit status 1 if any backend computed a wrong result.

The suites are sized for an H200.  On a machine without CUDA (or with
``--device cpu``) the run says so at once and runs the CPU smoke suite instead
(:data:`bench.cases.SMOKE_MODELS` at :data:`bench.cases.SMOKE_T`; named
``--models`` or ``--T`` win): it checks the harness end to end in well under
two minutes, but its times are of the plain-torch reference path, not of any
kernel, so a CPU run saves nothing unless ``--out-dir`` or ``--results-md``
says where.
"""

import argparse
import datetime
import shlex
import sys
from pathlib import Path

import torch

from . import cases as case_lib
from . import fp8, fp8_fallback, moe_block, pages, provenance, report
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
    "report": "python -m bench report RESULT.json: a run's tables (and plot, --plot-dir); "
              "--readme: bench/RESULTS.md and the README's status from bench/results/",
    "targets": "python -m bench targets RESULT.json: a grouped_gemm, training or moe_block "
               "run's targets, met or not",
    "overhead": "python -m bench overhead: host time of one op call (needs CUDA)",
}
CPU_TARGET_MS = 10.0  # timed work per backend and case in the CPU smoke suite


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="MoE grouped-GEMM benchmarks, backends side by side, sized for an H200.\n"
                    "Without CUDA (or with --device cpu): a CPU smoke suite of small models "
                    "that\nchecks the harness in seconds; its times are of the plain-torch "
                    "reference path.",
        epilog="subcommands (each takes --help):\n"
               + "\n".join(f"  {name:9s} {text}" for name, text in SUBCOMMANDS.items()))
    p.add_argument("--suite", choices=sorted(SUITES), default="grouped_gemm")
    p.add_argument("--models", type=_csv(str),
                   help=f"models (unique prefixes work); all: {','.join(case_lib.MODELS)}; "
                        f"CPU smoke: {','.join(case_lib.SMOKE_MODELS)}")
    p.add_argument("--T", type=_csv(int), help="token counts; default "
                   f"{','.join(map(str, case_lib.GEMM_T))} (moe_layer: also 1; training: "
                   f"{','.join(map(str, case_lib.TRAIN_T))}; moe_block: "
                   f"{','.join(map(str, case_lib.BLOCK_T))})")
    p.add_argument("--gemms", type=_csv(str), help="grouped_gemm: gate_up,down (default both); "
                   "training: also layer (default all three)")
    p.add_argument("--steps", type=_csv(str),
                   help=f"training: the GEMMs' steps, {','.join(case_lib.GEMM_STEPS)} (default "
                        f"all; the layer's step is always {case_lib.LAYER_STEP})")
    p.add_argument("--routing", type=_csv(str), help="uniform,skewed (default both; "
                   f"moe_block: {case_lib.BLOCK_ROUTING}, the router's own)")
    p.add_argument("--backends", type=_csv(str), help="default: the suite's usual ones")
    p.add_argument("--weight-layout", choices=case_lib.WEIGHT_LAYOUTS, default="nmajor",
                   help="grouped_gemm b: (E,K,N) N-major, or kmajor = w.transpose(-2,-1) "
                        "of an (E,N,K) tensor")
    p.add_argument("--quick", action="store_true",
                   help=f"T {','.join(map(str, case_lib.QUICK_T))} (training: "
                        f"{','.join(map(str, case_lib.TRAIN_QUICK_T))}; moe_block: "
                        f"{','.join(map(str, case_lib.BLOCK_QUICK_T))}), uniform routing, "
                        f"{' and '.join(case_lib.QUICK_MODELS)} (explicit filters win; on the "
                        f"CPU: the smoke suite, uniform routing)")
    p.add_argument("--graphs", action="store_true",
                   help="time CUDA-graph replays (GPU time only) for cases with T <= --graph-max-t "
                        "(moe_block: always, next to the eager time)")
    p.add_argument("--graph-max-t", type=int,
                   help=f"default {SUITES['grouped_gemm'].graph_max_t} (moe_block: "
                        f"{SUITES['moe_block'].graph_max_t})")
    p.add_argument("--no-roofs", action="store_true", help="skip measuring HBM and GEMM roofs")
    p.add_argument("--target-ms", type=float,
                   help=f"timed work per backend per case (5 to 200 calls); default 100 "
                        f"(training: {SUITES['training'].default_target_ms:g}), "
                        f"{CPU_TARGET_MS:g} on the CPU")
    p.add_argument("--rounds", type=int, default=2,
                   help="timing passes per backend and case, interleaved (each pass times "
                        "every backend once; the order alternates and rotates), the "
                        "median over all; --target-ms is shared among them. Default 2 "
                        "(in order, then reversed); an A/B of a few per cent wants 8 or more")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="default: cuda when torch sees a GPU, else cpu; on the cpu, "
                                    "the smoke suite's models and T where --models, --T do not "
                                    f"name them ({','.join(case_lib.SMOKE_MODELS)}; T "
                                    f"{','.join(map(str, case_lib.SMOKE_T))})")
    p.add_argument("--input-budget-gb", type=float, default=36.0,
                   help="memory for a case's rotated input copies")
    p.add_argument("--out-dir", type=Path,
                   help=f"where the JSON and the plot go (default {report.default_out_dir()}, "
                        "outside the checkout; bench/results for a run to commit; on the CPU "
                        "nothing is saved unless this or --results-md is given)")
    p.add_argument("--results-md", type=Path,
                   help="also write the run's markdown section into this file (on the CPU "
                        "without --out-dir: the JSON goes next to it)")
    p.add_argument("--no-save", action="store_true", help="no JSON, markdown or plot")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--list", action="store_true", help="print the cases and backends, run nothing")
    p.add_argument("--commit", help="the commit, where the checkout has no .git")
    return p


def build_report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench report",
        description="A run's markdown section (its facts, provenance and table) on stdout; "
                    "writes only what is named. With --readme: regenerate bench/RESULTS.md "
                    "and the README's status section from the committed runs in bench/results/, "
                    "and its path, kernel-family and settings tables from ts_moe's "
                    "declarations.")
    p.add_argument("json", type=Path, nargs="?", help="a run's JSON")
    p.add_argument("--results-md", type=Path,
                   help="write the run's section into this markdown file (replacing an "
                        "earlier section of the same GPU and suite)")
    p.add_argument("--plot-dir", type=Path, help="write the run's plot into this directory")
    p.add_argument("--no-plots", action="store_true", help="(no plot is written without "
                                                           "--plot-dir anyway)")
    p.add_argument("--readme", action="store_true",
                   help=f"write {report.RESULTS_MD.name} and the README's status section from "
                        f"{report.RESULTS_DIR.parent.name}/{report.RESULTS_DIR.name}/*.json, "
                        f"and its generated tables")
    p.add_argument("--check", action="store_true",
                   help="with --readme: write nothing; exit 1 if either file differs from "
                        "what --readme writes")
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
    on the CPU, the smoke suite's models and token counts where they are not named."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"--device {args.device!r}: {exc}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device!r}: the harness runs on cuda or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device (use --device cpu)")
    cpu = device.type == "cpu"
    suite = SUITES[args.suite]
    training, block = args.suite == "training", args.suite == "moe_block"
    if args.graph_max_t is None:
        args.graph_max_t = suite.graph_max_t
    full_t = {"moe_layer": case_lib.LAYER_T, "training": case_lib.TRAIN_T,
              "moe_block": case_lib.BLOCK_T, "fp8": case_lib.LAYER_T}.get(args.suite,
                                                                         case_lib.GEMM_T)
    quick_t = {"training": case_lib.TRAIN_QUICK_T,
               "moe_block": case_lib.BLOCK_QUICK_T}.get(args.suite, case_lib.QUICK_T)
    routings = (case_lib.BLOCK_ROUTING,) if block else case_lib.ROUTINGS
    quick_routings = routings if block else case_lib.QUICK_ROUTINGS
    if cpu:
        default_models, default_t = list(case_lib.SMOKE_MODELS), list(case_lib.SMOKE_T)
    elif args.quick:
        default_models = list(case_lib.QUICK_MODELS)
        default_t = list(quick_t)
    else:
        default_models, default_t = list(case_lib.MODELS), list(full_t)
    known_models = [*case_lib.MODELS, *case_lib.SMOKE_MODELS]
    sel = {
        "suite": suite,
        "models": _pick(args.models or default_models, known_models, "model", parser),
        "T": args.T or default_t,
        "routing": _pick(args.routing or (quick_routings if args.quick else routings),
                         list(routings), "routing", parser),
        "gemms": _pick(args.gemms or (case_lib.TRAIN_GEMMS if training else case_lib.GEMMS),
                       list(case_lib.TRAIN_GEMMS if training else case_lib.GEMMS), "gemm",
                       parser),
        "steps": _pick(args.steps or case_lib.GEMM_STEPS, [s.lower() for s in
                                                           case_lib.GEMM_STEPS], "step", parser),
        "backends": args.backends or list(suite.default_backends),
        # on the CPU, what the smoke suite filled in because the user did not name it
        "smoke": [what for what, given in (("models", args.models), ("token counts", args.T))
                  if cpu and not given],
    }
    if any(t < 1 for t in sel["T"]):
        parser.error("every T must be >= 1")
    if not 1 <= args.rounds <= 50:
        parser.error(f"--rounds {args.rounds}: must be 1 to 50")
    known = suite.backends()
    try:
        bad = [b for b in sel["backends"] if b not in known]
    except ValueError as exc:  # a malformed ts_moe:... variant
        parser.error(str(exc))
    if bad:
        parser.error(f"unknown {args.suite} backends {bad}; known: {', '.join(known)}")
    return sel


def _why_cpu(args) -> str:
    return "no CUDA device" if not torch.cuda.is_available() else f"--device {args.device}"


def cpu_notice(args, sel, n_cases: int) -> str:
    """The line said before a CPU run starts: why the CPU, what runs instead of the
    H200-sized suite, what its times mean, and whether they are saved."""
    text = (f"python -m bench: {_why_cpu(args)}; running {n_cases} cases of "
            f"{', '.join(sel['models'])} at T={','.join(map(str, sel['T']))} on the CPU")
    if len(sel["smoke"]) == 2:
        text += " (the CPU smoke suite instead of the H200-sized cases; --models and --T " \
                "name others)"
    elif sel["smoke"]:
        text += f" (the CPU smoke suite's {sel['smoke'][0]})"
    text += ". CPU times are of the plain-torch reference path, not of the kernels"
    big = [m for m in sel["models"] if m in case_lib.MODELS]
    if big:
        text += (f"; {', '.join(big)} {'is' if len(big) == 1 else 'are'} sized for an H200 and "
                 f"will take long here (the CPU smoke models: {', '.join(case_lib.SMOKE_MODELS)})")
    if not args.no_save and args.out_dir is None and args.results_md is None:
        text += "; not saved (--out-dir or --results-md to save)"
    return text + "."


def make_cases(args, sel) -> list:
    if args.suite == "moe_layer":
        return case_lib.layer_cases(sel["models"], sel["T"], sel["routing"], args.seed)
    if args.suite == "moe_block":
        return moe_block.block_cases(sel["models"], sel["T"], args.seed)
    if args.suite == "fp8":
        return fp8.fp8_cases(sel["models"], sel["T"], sel["gemms"], sel["routing"], args.seed)
    if args.suite == "training":
        steps = [s for s in case_lib.GEMM_STEPS if s.lower() in sel["steps"]]
        return case_lib.training_cases(sel["models"], sel["T"], sel["gemms"], sel["routing"],
                                       steps, args.seed, args.weight_layout)
    return case_lib.gemm_cases(sel["models"], sel["T"], sel["gemms"], sel["routing"],
                               args.seed, args.weight_layout)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run(argv) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sel = resolve(args, parser)
    cases = make_cases(args, sel)
    cpu = torch.device(args.device).type == "cpu"
    if args.list:  # runs nothing: say only where the smoke suite stands in for the named one
        if sel["smoke"]:
            print(f"python -m bench: {_why_cpu(args)}; the CPU smoke suite's "
                  f"{' and '.join(sel['smoke'])} (--models, --T name others)", file=sys.stderr)
        print(f"backends: {', '.join(sel['backends'])}")
        for case in cases:
            print(case.describe())
        return 0
    if cpu:
        print(cpu_notice(args, sel, len(cases)), file=sys.stderr, flush=True)
    if args.target_ms is None:
        args.target_ms = CPU_TARGET_MS if cpu else sel["suite"].default_target_ms
    # where results go: a GPU run's to --out-dir (default outside the checkout); a CPU
    # run's times (of the reference path) only where the user says
    save = not args.no_save
    if cpu:
        save = save and (args.out_dir is not None or args.results_md is not None)
        if save and args.out_dir is None:  # the JSON goes next to the named markdown
            args.out_dir = args.results_md.parent
    else:
        args.out_dir = args.out_dir or report.default_out_dir()
    device = torch.device(args.device)
    prov = provenance.collect(device, given_commit=args.commit)  # before the run: the code it starts from
    roofs = None
    if not args.no_roofs and device.type == "cuda":
        roofs = measure_roofs(device)
        print(f"roofs: {roofs['hbm_read_tbps']:.2f} TB/s HBM read, "
              f"{roofs['bf16_dense_tflops']:.0f} TFLOP/s bf16", file=sys.stderr)
    settings = Settings(device, target_ms=args.target_ms, graphs=args.graphs,
                        graph_max_t=args.graph_max_t,
                        input_budget_bytes=int(args.input_budget_gb * (1 << 30)),
                        rounds=args.rounds)
    records = run_suite(sel["suite"], cases, sel["backends"], settings, roofs,
                        progress=sys.stderr)
    report.add_ratios(records)
    result = {
        "suite": args.suite,
        "device": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "provenance": prov,
        "roofs": roofs,
        "command": shlex.join(["python", "-m", "bench", *argv]),
        "settings": {"target_ms": args.target_ms, "graphs": args.graphs,
                     "graph_max_t": args.graph_max_t, "seed": args.seed, "tolerance": TOLERANCE,
                     "input_budget_gb": args.input_budget_gb, "rounds": args.rounds},
        "cases": records,
    }
    print(report.render_text(records))
    if args.suite == "fp8" and fp8_fallback.table(records):
        print(fp8_fallback.table(records))
    if save:
        json_path = report.write_json(result, args.out_dir)
        print(f"wrote {json_path}", file=sys.stderr)
        if args.results_md is not None:
            md_path = report.update_results_md(json_path, args.results_md)
            print(f"wrote its section of {md_path}", file=sys.stderr)
        if not args.no_plots:
            png = report.plot(result, args.out_dir)
            if png:
                print(f"wrote {png}", file=sys.stderr)
    return 1 if any(r["status"] == "wrong" for r in records) else 0


def load_run(path: Path, parser: argparse.ArgumentParser) -> dict:
    """A run's JSON, or a usage error that says what is wrong with the file."""
    if not path.is_file():
        parser.error(f"no such file: {path}")
    try:
        result = report.load_json(path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        parser.error(f"{path} is not a run's JSON: {exc}")
    if not isinstance(result, dict) or not {"suite", "device", "cases"} <= set(result):
        parser.error(f"{path} is not a run's JSON (no suite, device and cases)")
    return result


def readme_command(check: bool) -> int:
    """``report --readme``: write (or, with ``check``, compare) bench/RESULTS.md and the
    README's status section, generated from the committed runs."""
    try:
        written = pages.pages()
    except ValueError as exc:  # the README lost its status markers
        print(f"python -m bench report --readme: {exc}", file=sys.stderr)
        return 2
    stale = pages.stale_pages(written)
    current, _ = pages.load_runs()
    for path, result in current:
        warning = provenance.staleness(result)
        if warning:
            print(f"{path.name}: {warning}", file=sys.stderr)
    if check:
        for path in stale:
            print(f"{path} differs from what `python -m bench report --readme` writes",
                  file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(written[path])
        print(f"wrote {path}", file=sys.stderr)
    if not stale:
        print("bench/RESULTS.md and the README's generated sections are up to date",
              file=sys.stderr)
    return 0


def report_command(argv) -> int:
    parser = build_report_parser()
    args = parser.parse_args(argv)
    if args.readme:
        if args.json or args.results_md or args.plot_dir:
            parser.error("--readme takes no run and no --results-md or --plot-dir")
        return readme_command(args.check)
    if args.check:
        parser.error("--check goes with --readme")
    if args.json is None:
        parser.error("name a run's JSON (or --readme)")
    result = load_run(args.json, parser)
    print(report.render_markdown(result))
    warning = provenance.staleness(result)
    if warning:
        print(warning, file=sys.stderr)
    if args.results_md is not None:
        print(f"wrote its section of {report.update_results_md(args.json, args.results_md)}",
              file=sys.stderr)
    if args.plot_dir is not None and not args.no_plots:
        png = report.plot(result, args.plot_dir)
        if png:
            print(f"wrote {png}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS:
        # the suite takes no positional argument: a word first is a mistyped subcommand
        build_parser().error(f"no subcommand {argv[0]!r}; the subcommands are "
                             f"{', '.join(SUBCOMMANDS)} (each takes --help)")
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
