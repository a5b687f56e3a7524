"""The whole GPU test suite in one command, for a machine with an sm_90 GPU.

    python scripts/gpu_check.py [--budget 560] [--out gpu_check.json] [--commit SHA]
                                [--no-warm] [TEST_FILE ...]

- each test file with ``gpu`` tests runs in a process of its own (``pytest -m gpu FILE``),
  so a sticky CUDA error (an illegal instruction, a device assert) ends only its file;
- before the tests, the sm_90a builds of ``python -m ts_moe compile`` (every family's
  checked builds) are compiled in parallel into a fresh private kernel cache
  (``TS_MOE_CACHE_DIR``) that every file then loads from: compiling is CPU work, and
  the suite's processes would otherwise each compile what they use, one at a time
  (:func:`warm`);
- a time budget: a file that would start after it is listed as not run;
- per file, the pytest summary, the failed tests, and how many kernels the file
  compiled or loaded and the seconds that took (``csrc_free_kernels.common.compile.stats``,
  through the plugin :mod:`gpu_check_plugin`);
- one JSON with all of it and the run's provenance (``bench.provenance``), and one
  summary line (``GPU check: ...``) to quote;
- every file's whole pytest output, in one log beside the JSON (``--log``; the JSON
  keeps only each failing file's last lines): a failure's detail is never lost.

The compute-sanitizer runs (memcheck, racecheck) are tests of the suite
(``tests/test_grouped_gemm_gpu.py``, ``test_compute_sanitizer``).
"""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parent.parent
# the marker applied (decorator, pytestmark, a name or param marks), not named in a string
GPU_MARK = re.compile(r"(^\s*@|=\s*\[?)pytest\.mark\.gpu\b", re.M)
SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")

WARM = r'''
import sys, time
sys.path.insert(0, sys.argv[1])
from csrc_free_kernels.common.compile import get_compiled
from ts_moe import compile_cli
builds = [b for _, family in compile_cli.builds("sm_90a") for b in family]
shard, shards = int(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter()
for b in builds[shard::shards]:
    get_compiled(b)
print(f"WARM {len(builds[shard::shards])} {time.perf_counter() - t0:.1f}")
'''


def gpu_test_files() -> list:
    """The test files with ``gpu``-marked tests, FP8 kernel files first (the newest
    kernels: if they fault, the rest of the suite still runs, in other processes)."""
    files = [p for p in sorted((ROOT / "tests").glob("test_*.py"))
             if GPU_MARK.search(p.read_text())]
    return sorted(files, key=lambda p: (not p.name.startswith("test_fp8"), p.name))


def warm(env: dict, workers: int) -> dict:
    """The demo's kernel builds compiled into ``env``'s cache by ``workers`` processes."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", WARM, str(ROOT), str(i), str(workers)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=ROOT) for i in range(workers)]
    built, cpu = 0, 0.0
    for p in procs:
        out, _ = p.communicate(timeout=1200)
        m = re.search(r"WARM (\d+) ([\d.]+)", out)
        if m:
            built, cpu = built + int(m.group(1)), cpu + float(m.group(2))
        else:
            print(f"warm-up worker failed:\n{out[-2000:]}", file=sys.stderr)
    return {"kernels": built, "compile_s": round(cpu, 1),
            "wall_s": round(time.perf_counter() - t0, 1), "workers": workers}


def run_file(path: pathlib.Path, env: dict, timeout: float) -> dict:
    """``pytest -m gpu`` on one file in a fresh process: counts, failures, compile time."""
    with tempfile.TemporaryDirectory() as scratch:
        stats = pathlib.Path(scratch) / "stats.json"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "gpu_check_plugin",
               f"--gpu-check-stats={stats}", "-o", "addopts=", str(path)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=timeout)
            out, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") + "\nTIMEOUT"
            rc = "timeout"
        seconds = time.perf_counter() - t0
        compiled = json.loads(stats.read_text()) if stats.exists() else None
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
              for n, kind in SUMMARY.findall(tail)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return {"file": path.name, "rc": rc, "seconds": round(seconds, 1), "counts": counts,
            "failed": failed, "kernels": compiled, "summary": tail[:300],
            "tail": out[-4000:] if rc not in (0, 5) else "", "output": out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", help="test files (default: every file with gpu tests)")
    p.add_argument("--budget", type=float, default=560, help="seconds for the whole check")
    p.add_argument("--file-timeout", type=float, default=420)
    p.add_argument("--warm-workers", type=int, default=min(os.cpu_count() or 1, 16))
    p.add_argument("--no-warm", action="store_true")
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--log", help="every file's whole output (default: --out with .log)")
    p.add_argument("--commit", help="the commit, where the checkout has no .git")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from bench import provenance

    start = time.perf_counter()
    cache = tempfile.mkdtemp(prefix="ts_moe_gpu_check_")  # 0700, ours
    # the arch named, as the sm_90 kernels are built for it: warm-up and tests share
    # the cache keys (the DSL's code-generation settings are part of them)
    env = dict(os.environ, TS_MOE_CACHE_DIR=cache, CUTE_DSL_ARCH="sm_90a",
               PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(ROOT / "scripts"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("TS_MOE_NO_DISK_CACHE", None)
    warmed = None if args.no_warm else warm(env, args.warm_workers)
    files = [pathlib.Path(f).resolve() for f in args.files] or gpu_test_files()
    log = pathlib.Path(args.log or pathlib.Path(args.out).with_suffix(".log"))
    log.write_text("")
    results = []
    for path in files:
        left = args.budget - (time.perf_counter() - start)
        if left < 20:
            results.append({"file": path.name, "rc": "not run (budget)"})
            continue
        results.append(run_file(path, env, min(args.file_timeout, left)))
        r = results[-1]
        with log.open("a") as f:  # as it goes: a run cut short keeps what it did
            f.write(f"===== {r['file']} (rc {r['rc']}, {r['seconds']} s)\n{r.pop('output')}\n")
        print(f"{r['file']:36s} {r['seconds']:6.1f} s  {r['summary']}", flush=True)
    total = {}
    for r in results:
        for kind, n in r.get("counts", {}).items():
            total[kind] = total.get(kind, 0) + n
    compile_s = sum(r["kernels"]["compile_s"] for r in results if r.get("kernels"))
    not_run = [r["file"] for r in results if r["rc"] == "not run (budget)"]
    broken = [r["file"] for r in results if r["rc"] not in (0, 5, "not run (budget)")]
    line = (f"GPU check: {total.get('passed', 0)} passed, {total.get('failed', 0)} failed, "
            f"{total.get('error', 0)} errors, {total.get('skipped', 0)} skipped in "
            f"{len(results) - len(not_run)} files ({len(not_run)} not run), "
            f"{time.perf_counter() - start:.0f} s; kernels compiled in the files "
            f"{compile_s:.0f} s" + (f", warm-up {warmed['kernels']} kernels "
                                     f"{warmed['wall_s']} s" if warmed else ""))
    import torch

    prov = provenance.collect(torch.device("cuda") if torch.cuda.is_available() else None,
                              given_commit=args.commit)
    pathlib.Path(args.out).write_text(json.dumps(
        {"provenance": prov, "summary": line, "warm": warmed, "files": results,
         "files_with_failures": broken, "not_run": not_run}, indent=1))
    print(line)
    return 1 if broken or not_run else 0


if __name__ == "__main__":
    sys.exit(main())
