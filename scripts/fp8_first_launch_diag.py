"""The FP8 kernels' first launches on a GPU, each in a process of its own, with the
control that tells the scale-box fault apart from any other.

    python scripts/fp8_first_launch_diag.py [--jobs 8] [--out fp8_diag.json] [--commit SHA]

The blockwise build that ran on the H200 stopped with an illegal instruction; the CPU
read of its PTX points at the activation-scale TMA box starting at rows that are not a
multiple of 4 (``bench/notes/2026-12-05-fp8-scale-box-alignment.md``).  So every job runs
twice: with every expert starting on a multiple of 4 rows (counts ``(100, 0, 152, 28)``)
and with unaligned starts (``(100, 0, 150, 30)``); and the blockwise recipe runs with the
fixed layout and the old one (:class:`OldScaleBox`, rebuilt here from the fixed kernel's
hooks: box at ``row0``, ``rows`` rows, no shift).  Expected if the diagnosis is right: the
old layout faults on unaligned starts only, the fixed one passes both.

Jobs: the default FP8 op path (``ts_moe.scaled_grouped_gemm``) per recipe; the activation
quantizer per recipe; each kernel configuration x recipe x layout x counts, checked
against float64.  A fault (a sticky CUDA error) ends only its own process.  The first
faulting kernel job is rerun under ``compute-sanitizer`` (memcheck), whose report names
the instruction.  One JSON with every job's status and error, and the provenance.
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parent.parent
ALIGNED, UNALIGNED = (100, 0, 152, 28), (100, 0, 150, 30)
RECIPES = ("blockwise", "rowwise", "tensorwise")

CHILD = r'''
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
import ts_moe
from tests.helpers import rel_err
from tests.test_fp8_ops import PAIRS, problem, ref64

mode, name, recipe, layout, counts = sys.argv[2:7]
counts = tuple(json.loads(counts))
pair = dict(zip(("blockwise", "rowwise", "tensorwise"), PAIRS))[recipe]
res = {"mode": mode, "config": name, "recipe": recipe, "layout": layout, "counts": counts}
try:
    m = sum(counts) + 4  # and rows past offs[-1]
    xq, wq, sx, sw, offs = problem(m=m, k=512, n=256, counts=counts, pair=pair)
    ref = ref64(xq, wq, sx, pair[0], sw, pair[1], offs).float()
    cuda = [t.cuda() for t in (xq, wq, sx, sw, offs)]
    if mode == "default":
        out = ts_moe.scaled_grouped_gemm(cuda[0], cuda[1].transpose(-2, -1), cuda[2], pair[0],
                                         cuda[3], pair[1], cuda[4])
    elif mode == "quantize":
        from ts_moe.ops import Op, paths
        from ts_moe.ops.backend import run_first
        x = torch.randn(257, 1024, device="cuda", dtype=torch.bfloat16)
        q, s = run_first((paths.TABLE[paths.Path.KERNEL_SM90][Op.QUANTIZE_FP8],), x, pair[0])
        torch.cuda.synchronize()
        qr, sr = ts_moe.quantize_fp8(x.cpu(), pair[0])
        res["scale_rel_err"] = rel_err(s.cpu().float().reshape(-1), sr.float().reshape(-1))
        res["values_equal"] = (q.cpu().float() == qr.float()).float().mean().item()
        out = None
    else:
        sys.path.insert(0, sys.argv[1] + "/scripts")
        from fp8_first_launch_diag import launch
        out = launch(name, recipe, layout, *cuda)
    torch.cuda.synchronize()
    if out is not None:
        res["rel_err"] = rel_err(out.cpu().float(), ref)
        res["ok"] = res["rel_err"] <= 1e-2
    res["status"] = "ok"
except Exception as e:  # the fault, or anything else: reported, not raised
    res["status"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
print("RESULT " + json.dumps(res), flush=True)
'''


def old_scale_box_class():
    """The blockwise layout that ran on the H200, rebuilt from the fixed kernel's hooks:
    the scale box at the tile's first row, ``rows`` rows, read unshifted, a stage's column
    ``max(tile_m, 32)`` words (its PTX is that build's, but for the kernel's name)."""
    from csrc_free_kernels.fp8.grouped_gemm_fp8_sm90 import GroupedGemmFp8Sm90

    class OldScaleBox(GroupedGemmFp8Sm90):
        sfa_box_rows = property(lambda self: self.cfg.rows)
        sfa_stage_words = property(lambda self: max(self.cfg.tile_m, 32))
        sfa_box_start = staticmethod(lambda row0: row0)
        sfa_row_shift = staticmethod(lambda row0: 0)

    return OldScaleBox


def launch(config_name, recipe, layout, a, w, sa, sw, offs):
    """One FP8 kernel launch: the shipped backend (``layout == "fixed"``; the sm_90 entry
    of the path table, ``ts_moe.ops.paths``) in the named configuration, or the old scale
    box (``"old"``, blockwise only) compiled here."""
    import cutlass
    import torch

    from csrc_free_kernels.common import compile as kcompile
    from csrc_free_kernels.common.family import Build
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_launch as glue
    from csrc_free_kernels.fp8.grouped_gemm_fp8_sm90_config import CONFIGS
    from csrc_free_kernels.fp8.quantize_fp8_sm90_launch import one_row_view
    from ts_moe.ops import Op, paths

    cfg = CONFIGS[config_name]
    out = a.new_empty(a.shape[0], w.shape[1], dtype=torch.bfloat16)
    if layout == "fixed":
        backend = paths.TABLE[paths.Path.KERNEL_SM90][Op.SCALED_GROUPED_GEMM]
        return backend.run(a, w.transpose(-2, -1), sa, sw, offs, out, cfg, recipe)
    old = old_scale_box_class()
    # the old layout breaks the pre-flight's tma-coordinate rule, so it is compiled past
    # the run-time gate (compile_build), as the diagnosis needs it to reach the GPU
    fn = kcompile.compile_build(Build("diag_old_scale_box", ("diag_old_scale_box", cfg, recipe),
                                      lambda: (old(cfg, recipe), (
                                          *glue.fake_args(recipe, cutlass.BFloat16),
                                          cutlass.Int32(1), kcompile.fake_stream()))))
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    fn(one_row_view(a), w.transpose(-2, -1), one_row_view(out), offs, glue.fast_scale_a(sa),
       sw.contiguous(), sms // cfg.cluster_m * cfg.cluster_m)
    return out


def jobs() -> list:
    from csrc_free_kernels.fp8.grouped_gemm_fp8_sm90_config import CONFIGS as FP8_CONFIGS

    found = [("default", "-", r, "-", c) for r in RECIPES for c in (ALIGNED, UNALIGNED)]
    found += [("quantize", "-", r, "-", ALIGNED) for r in RECIPES]
    for name in FP8_CONFIGS:
        for r in RECIPES:
            for layout in (("fixed", "old") if r == "blockwise" else ("fixed",)):
                found += [("kernel", name, r, layout, c) for c in (ALIGNED, UNALIGNED)]
    return found


def run(job, prefix=(), timeout=300) -> dict:
    mode, name, recipe, layout, counts = job
    cmd = [*prefix, sys.executable, "-c", CHILD, str(ROOT), mode, name, recipe, layout,
           json.dumps(counts)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + "\nTIMEOUT"
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(lines[-1][7:]) if lines else {
        "mode": mode, "config": name, "recipe": recipe, "layout": layout,
        "counts": list(counts), "status": "no result"}
    res["tail"] = out[-3000:] if res.get("status") != "ok" or prefix else ""
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--out", default="fp8_diag.json")
    p.add_argument("--commit", help="the commit, where the checkout has no .git")
    p.add_argument("--sanitizer-timeout", type=float, default=240)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from bench import provenance

    todo = jobs()
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run, todo))
    for r in results:
        print(f"{r['mode']:8s} {r['config']:18s} {r['recipe']:10s} {r['layout']:5s} "
              f"{'aligned' if tuple(r['counts']) == ALIGNED else 'unaligned':9s} "
              f"{r['status'][:60]:60s} {r.get('rel_err', '')}", flush=True)
    import torch

    prov = provenance.collect(torch.device("cuda") if torch.cuda.is_available() else None,
                              given_commit=args.commit)

    def write():  # before the sanitizer too: a run cut short still leaves its results
        pathlib.Path(args.out).write_text(json.dumps({"provenance": prov, "jobs": results},
                                                     indent=1))

    write()
    faults = [j for j, r in zip(todo, results) if j[0] == "kernel" and r["status"] != "ok"]
    sanitizer = shutil.which("compute-sanitizer")
    if faults and sanitizer:
        print(f"compute-sanitizer on {faults[0]}", flush=True)
        report = run(faults[0], prefix=(sanitizer, "--tool", "memcheck", "--show-backtrace",
                                        "device"), timeout=args.sanitizer_timeout)
        results.append({"sanitizer": list(faults[0]), **report})
        print(report.get("tail", "")[-1500:], flush=True)
        write()
    bad = [r for r in results if r.get("status") != "ok" or r.get("ok") is False]
    print(f"{len(results) - len(bad)} of {len(results)} ok; {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
