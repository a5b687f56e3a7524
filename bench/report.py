"""Results: the JSON file, the text and markdown tables, a run's markdown section, plots.

Everything here works from the result dict alone (what the JSON holds), so
``python -m bench report X.json`` regenerates the markdown and plots later.
Nothing is written into the checkout unless a path in it is named:
:func:`default_out_dir` is outside it.  ``bench/results/`` holds the committed
runs that ``bench/RESULTS.md`` and the README's status are generated from
(:mod:`bench.pages`).
"""

import json
import math
import os
import re
from collections import defaultdict
from pathlib import Path

from . import provenance

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"  # the committed runs
RESULTS_MD = BENCH_DIR / "RESULTS.md"  # generated from them: python -m bench report --readme


def default_out_dir() -> Path:
    """Where a GPU run's JSON and plot go unless ``--out-dir`` says:
    ``$XDG_CACHE_HOME/ts_moe/bench`` (default ``~/.cache/ts_moe/bench``), outside
    the checkout."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "ts_moe" / "bench"

COLUMNS = ("model", "gemm", "T", "routing", "backend", "ms", "TFLOP/s", "TB/s", "roof",
           "vs best peer", "status")
PEAK_COLUMN = "peak GiB"  # runs that measure memory (the training suite): after "vs best peer"
# runs that time CUDA-graph replays next to eager calls (the moe_block suite): after "ms"
GRAPH_COLUMN = "graph ms"
FLOOR_COLUMN = "floor ms"  # runs with a weight-streaming floor: after "ms" (and "graph ms")


def sanitize(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': safe in file names."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def result_stem(result: dict) -> str:
    """``<device>-<suite>``, with ``-kmajor`` for a run of K-major (nn.Linear layout)
    weights: its JSON, plot and RESULTS.md section sit beside the default layout's."""
    layouts = {r.get("weight_layout") for r in result.get("cases", [])}
    suffix = "-kmajor" if layouts == {"kmajor"} else ""
    return f"{sanitize(result['device'])}-{result['suite']}{suffix}"


def case_groups(records):
    """Records grouped by case (model, gemm, T, routing, and the training suite's
    step), in first-seen order."""
    groups = defaultdict(list)
    for r in records:
        groups[(r["model"], r["gemm"], r["T"], r["routing"], r.get("step"))].append(r)
    return groups


def gemm_label(r: dict) -> str:
    """The gemm column: ``gate_up``, or with the training suite's step ``gate_up dW``."""
    return r["gemm"] if r.get("step") is None else f"{r['gemm']} {r['step']}"


def has_memory(records) -> bool:
    """Whether the run measured peak memory (its records carry ``peak_mem_bytes``)."""
    return any("peak_mem_bytes" in r for r in records)


def has_graph(records) -> bool:
    """Whether the run timed CUDA-graph replays next to eager calls (``graph_ms``)."""
    return any("graph_ms" in r for r in records)


def has_floor(records) -> bool:
    """Whether the run's cases have a weight-streaming floor (``floor_ms``)."""
    return any("floor_ms" in r for r in records)


def columns(records) -> tuple[str, ...]:
    heads = list(COLUMNS)
    extra = [c for c, there in ((GRAPH_COLUMN, has_graph(records)),
                                (FLOOR_COLUMN, has_floor(records))) if there]
    i = heads.index("ms") + 1
    heads[i:i] = extra
    if has_memory(records):
        i = heads.index("vs best peer") + 1
        heads[i:i] = [PEAK_COLUMN]
    return tuple(heads)


def graph_failed(r: dict) -> bool:
    """Whether a timed record's CUDA-graph capture or replay was tried and failed
    (not: skipped off CUDA or over --graph-max-t)."""
    return r["status"] == "ok" and (r.get("graph_status") == "oom" or str(
        r.get("graph_reason") or "").startswith("capture"))


def family(backend: str) -> str:
    """ts_moe's variants (``ts_moe_unfused``, ``ts_moe_stages``, ``ts_moe_hf``,
    ``ts_moe:...``) are one family: not each other's peers."""
    return "ts_moe" if backend.startswith("ts_moe") else backend


def add_ratios(records) -> None:
    """Per record: ``speedup_vs`` {backend: its ms / this ms} against every other
    timed backend of its case, and ``vs_best_peer`` against the fastest of
    another :func:`family` (> 1: faster than every peer)."""
    for group in case_groups(records).values():
        timed = {r["backend"]: r["ms"] for r in group if r["status"] == "ok"}
        for r in group:
            if r["status"] != "ok":
                r["speedup_vs"], r["vs_best_peer"] = {}, None
                continue
            others = {b: ms / r["ms"] for b, ms in timed.items() if b != r["backend"]}
            r["speedup_vs"] = others
            peers = [v for b, v in others.items() if family(b) != family(r["backend"])]
            r["vs_best_peer"] = min(peers) if peers else None


def _num(x, fmt: str) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table_rows(records) -> list[list[str]]:
    rows = []
    heads = columns(records)
    for r in records:
        status = r["status"]
        if status == "wrong":
            # an infinite error (NaN output, wrong shape) is stored as null
            status = f"wrong (err {_num(r['max_rel_err'], '.2g') or 'inf'})"
        elif status in ("unavailable", "error", "oom") and r.get("reason"):
            status = f"{status}: {r['reason']}"
        if graph_failed(r):
            status = f"{status}; graph {r['graph_status']}: {r['graph_reason']}"
        roof = ""
        if r.get("roof_frac") is not None:
            roof = f"{100 * r['roof_frac']:.0f}% {r['bound']}"
        graph = _num(r.get("graph_ms"), ".4f")
        if not graph and r["status"] == "ok" and r.get("graph_status"):
            graph = r["graph_status"]
        peak = r.get("peak_mem_bytes")
        cells = {"model": r["model"], "gemm": gemm_label(r), "T": str(r["T"]),
                 "routing": r["routing"], "backend": r["backend"], "ms": _num(r["ms"], ".4f"),
                 GRAPH_COLUMN: graph, FLOOR_COLUMN: _num(r.get("floor_ms"), ".4f"),
                 "TFLOP/s": _num(r["tflops"], ".1f"), "TB/s": _num(r["tbps"], ".2f"),
                 "roof": roof, "vs best peer": _num(r.get("vs_best_peer"), ".2f"),
                 PEAK_COLUMN: "" if peak is None else f"{peak / (1 << 30):.2f}",
                 "status": status}
        rows.append([cells[h] for h in heads])
    return rows


def render_text(records) -> str:
    """Fixed-width table for the terminal (long reasons cut to fit)."""
    rows = [[c if len(c) <= 60 else c[:57] + "..." for c in row] for row in table_rows(records)]
    heads = columns(records)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(result: dict) -> str:
    """A markdown section: heading, run facts, the results table."""
    roofs = result.get("roofs")
    roof_text = "not measured"
    if roofs:
        roof_text = (f"HBM read {roofs['hbm_read_tbps']:.2f} TB/s, "
                     f"bf16 dense {roofs['bf16_dense_tflops']:.0f} TFLOP/s")
    lines = [
        f"## {result['suite']} on {result['device']}",
        "",
        f"- date: {result['date']}",
        f"- {provenance.describe(result)}",
        f"- roofs (measured in the run): {roof_text}",
        f"- command: `{result['command']}`",
        "",
        "roof: the time the bounding roof (hbm or flop) allows over the measured time; "
        "vs best peer: the fastest other backend's time over this one's, ts_moe's own "
        "variants not counted as each other's peers (> 1: fastest).",
        "",
    ]
    heads = columns(result["cases"])
    if GRAPH_COLUMN in heads or FLOOR_COLUMN in heads:
        lines[-1:-1] = [
            "", "The whole MoE block (router GEMM, top-k, experts; routing the router's own). "
            "ms: eager, per call, an event pair around each call (a host-bound call counts "
            "its host time); graph ms: per call of a CUDA-graph replay (GPU time only; "
            "unavailable: not captured); floor ms: the touched experts' and the router's "
            "bytes at the measured HBM read roof; TFLOP/s, TB/s, roof and vs best peer "
            "are of the eager time."]
    if PEAK_COLUMN in heads:
        lines[-1:-1] = [
            "", "Steps: a GEMM's fwd, dA (`grouped_mm(dy, w^T)`), dW (k-grouped "
            "`grouped_mm(x.t(), dy)`); the layer's fwd+bwd (routing given). peak GiB: "
            "`torch.cuda.max_memory_allocated` over one call less what was allocated before "
            "it (what the call returns counts)."]
    lines += ["| " + " | ".join(heads) + " |", "|" + "|".join("---" for _ in heads) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |"
              for row in table_rows(result["cases"])]
    return "\n".join(lines) + "\n"


def write_json(result: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result_stem(result)}.json"
    path.write_text(json.dumps(sanitize_floats(result), indent=1, allow_nan=False) + "\n")
    return path


def sanitize_floats(x):
    """inf/NaN (a backend's infinite error) as None: strict JSON has neither."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: sanitize_floats(v) for k, v in x.items()}
    if isinstance(x, list):
        return [sanitize_floats(v) for v in x]
    return x


def load_json(path) -> dict:
    return json.loads(Path(path).read_text())


def update_results_md(json_path, md_path) -> Path:
    """Write the run's section into the markdown file ``md_path``, replacing the
    section of an earlier run of the same GPU and suite, or appending it."""
    result = load_json(json_path)
    stem = result_stem(result)
    begin, end = f"<!-- bench:{stem} begin -->", f"<!-- bench:{stem} end -->"
    section = f"{begin}\n{render_markdown(result)}{end}\n"
    md_path = Path(md_path)
    text = md_path.read_text() if md_path.exists() else ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:
        text = text + ("\n" if text and not text.endswith("\n\n") else "") + section
    md_path.write_text(text)
    return md_path


def plot(result: dict, out_dir: Path) -> Path | None:
    """One PNG per suite: a row per (model, gemm), per routing a TFLOP/s and
    a TB/s panel, T on the x axis, a line per backend.  None if nothing was timed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["cases"] if r["status"] == "ok"]
    if not ok:
        return None
    metrics = (("tflops", "TFLOP/s"), ("tbps", "TB/s"))
    latency = has_graph(ok)  # eager and graph ms per call, log scale
    if latency:
        metrics = (("ms", "eager ms per call"), ("graph_ms", "graph ms per call"))
    rows = list(dict.fromkeys((r["model"], gemm_label(r)) for r in ok))
    routings = list(dict.fromkeys(r["routing"] for r in ok))
    backends = list(dict.fromkeys(r["backend"] for r in ok))
    Ts = sorted({r["T"] for r in ok})
    colors = {b: f"C{i % 10}" for i, b in enumerate(backends)}
    ncols = len(routings) * len(metrics)
    fig, axes = plt.subplots(len(rows), ncols, figsize=(4.2 * ncols, 3.2 * len(rows)),
                             squeeze=False)
    for i, (model, gemm) in enumerate(rows):
        for j, routing in enumerate(routings):
            for k, (key, label) in enumerate(metrics):
                ax = axes[i][j * len(metrics) + k]
                for b in backends:
                    panel = (model, gemm, routing)
                    pts = sorted((r["T"], r[key]) for r in ok if r["backend"] == b
                                 and (r["model"], gemm_label(r), r["routing"]) == panel
                                 and r.get(key) is not None)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", color=colors[b], label=b)
                if latency and key == "ms":  # the floor under the eager panel
                    floor = sorted({(r["T"], r["floor_ms"]) for r in ok
                                    if (r["model"], gemm_label(r), r["routing"]) == panel
                                    and r.get("floor_ms") is not None})
                    if floor:
                        ax.plot(*zip(*floor), color="k", linestyle=":", label="floor")
                ax.set_xscale("log", base=2)
                if latency:
                    ax.set_yscale("log")
                ax.set_xticks(Ts, [str(t) for t in Ts])
                ax.minorticks_off()
                ax.set_title(f"{model} {gemm} {routing}", fontsize=9)
                ax.set_xlabel("T (tokens)")
                ax.set_ylabel(label)
                ax.grid(True, alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[b], marker="o", label=b) for b in backends]
    if latency and any(r.get("floor_ms") is not None for r in ok):
        handles.append(plt.Line2D([], [], color="k", linestyle=":", label="weight floor"))
    fig.suptitle(f"{result['suite']} on {result['device']} ({result['date']})")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result_stem(result)}.png"
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    _compact_png(path)
    return path


def _compact_png(path) -> None:
    """The plot with a 256-colour palette, no dithering: the same picture (a plot has a
    few colours) in a third of the bytes.  Result files travel with the tree to the GPU
    machine, whose carry is tight."""
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT,
                                           dither=Image.Dither.NONE)
    small.save(path, optimize=True)
