"""Results: the JSON file, the text and markdown tables, RESULTS.md sections, plots.

Everything here works from the result dict alone (what the JSON holds), so
``python -m bench report X.json`` regenerates the markdown and plots later.
"""

import json
import math
import re
from collections import defaultdict
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
RESULTS_MD = BENCH_DIR / "RESULTS.md"

COLUMNS = ("model", "gemm", "T", "routing", "backend", "ms", "TFLOP/s", "TB/s", "roof",
           "vs best peer", "status")
PEAK_COLUMN = "peak GiB"  # runs that measure memory (the training suite): after "vs best peer"


def sanitize(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': safe in file names."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def result_stem(result: dict) -> str:
    return f"{sanitize(result['device'])}-{result['suite']}"


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


def columns(records) -> tuple[str, ...]:
    if not has_memory(records):
        return COLUMNS
    i = COLUMNS.index("vs best peer") + 1
    return (*COLUMNS[:i], PEAK_COLUMN, *COLUMNS[i:])


def add_ratios(records) -> None:
    """Per record: ``speedup_vs`` {peer: peer_ms / ms} against every other
    timed backend of its case, and ``vs_best_peer`` (> 1: faster than every peer)."""
    for group in case_groups(records).values():
        timed = {r["backend"]: r["ms"] for r in group if r["status"] == "ok"}
        for r in group:
            if r["status"] != "ok":
                r["speedup_vs"], r["vs_best_peer"] = {}, None
                continue
            peers = {b: ms / r["ms"] for b, ms in timed.items() if b != r["backend"]}
            r["speedup_vs"] = peers
            r["vs_best_peer"] = min(peers.values()) if peers else None


def _num(x, fmt: str) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table_rows(records) -> list[list[str]]:
    rows = []
    memory = has_memory(records)
    for r in records:
        status = r["status"]
        if status == "wrong":
            # an infinite error (NaN output, wrong shape) is stored as null
            status = f"wrong (err {_num(r['max_rel_err'], '.2g') or 'inf'})"
        elif status in ("unavailable", "error", "oom") and r.get("reason"):
            status = f"{status}: {r['reason']}"
        roof = ""
        if r.get("roof_frac") is not None:
            roof = f"{100 * r['roof_frac']:.0f}% {r['bound']}"
        row = [r["model"], gemm_label(r), str(r["T"]), r["routing"], r["backend"],
               _num(r["ms"], ".4f"), _num(r["tflops"], ".1f"), _num(r["tbps"], ".2f"),
               roof, _num(r.get("vs_best_peer"), ".2f"), status]
        if memory:
            peak = r.get("peak_mem_bytes")
            row.insert(-1, "" if peak is None else f"{peak / (1 << 30):.2f}")
        rows.append(row)
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
        f"- torch {result['torch']}, CUDA {result['cuda']}",
        f"- roofs (measured in the run): {roof_text}",
        f"- command: `{result['command']}`",
        "",
        "roof: the time the bounding roof (hbm or flop) allows over the measured time; "
        "vs best peer: the fastest other backend's time over this one's (> 1: fastest).",
        "",
    ]
    heads = columns(result["cases"])
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


def update_results_md(json_path, md_path=RESULTS_MD) -> Path:
    """Write the run's section into RESULTS.md, replacing the section of an
    earlier run of the same GPU and suite, or appending it."""
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
    rows = list(dict.fromkeys((r["model"], gemm_label(r)) for r in ok))
    routings = list(dict.fromkeys(r["routing"] for r in ok))
    backends = list(dict.fromkeys(r["backend"] for r in ok))
    Ts = sorted({r["T"] for r in ok})
    colors = {b: f"C{i % 10}" for i, b in enumerate(backends)}
    metrics = (("tflops", "TFLOP/s"), ("tbps", "TB/s"))
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
                                 and (r["model"], gemm_label(r), r["routing"]) == panel)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", color=colors[b], label=b)
                ax.set_xscale("log", base=2)
                ax.set_xticks(Ts, [str(t) for t in Ts])
                ax.minorticks_off()
                ax.set_title(f"{model} {gemm} {routing}", fontsize=9)
                ax.set_xlabel("T (tokens)")
                ax.set_ylabel(label)
                ax.grid(True, alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[b], marker="o", label=b) for b in backends]
    fig.suptitle(f"{result['suite']} on {result['device']} ({result['date']})")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(backends), 6))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result_stem(result)}.png"
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path
