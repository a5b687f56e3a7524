"""H200 diagnosis of the FP8 kernels (bench/notes/2026-12-05-fp8-kernel-first-gpu-run.md): (1) the default FP8 op path on CUDA against float64; (2) each FP8 kernel build in its own process (a fault poisons only that process); (3) the quantize kernel. Run from the repository root: python scripts/fp8_first_launch_diag.py"""
import os, subprocess, sys, json
sys.path.insert(0, os.getcwd())

CHILD = r'''
import sys, os, json, torch
sys.path.insert(0, os.getcwd())
import ts_moe
from tests.test_fp8_ops import problem, ref64, PAIRS
from tests.helpers import rel_err
from csrc_free_kernels import grouped_gemm_fp8_sm90_launch as f8, grouped_gemm_fp8_sm90_config as cf
mode, name, recipe, swiglu = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
res = {"mode": mode, "config": name, "recipe": recipe, "swiglu": swiglu}
try:
    pair = {"blockwise": PAIRS[0], "rowwise": PAIRS[1], "tensorwise": PAIRS[2]}[recipe]
    if mode == "kernel":
        xq, wq, sx, sw, offs = problem(m=300, k=512, n=256, counts=(100, 0, 150, 30), pair=pair)
        ref = ref64(xq, wq, sx, pair[0], sw, pair[1], offs).float()
        d = lambda t: t.cuda()
        sxa = d(sx)
        if recipe == "blockwise":
            sxa = f8.fast_scale_a(sxa)
        out = f8.scaled_grouped_gemm(d(xq), d(wq).transpose(-2, -1), sxa, d(sw), d(offs),
                                     recipe=recipe, config=cf.CONFIGS[name])
        torch.cuda.synchronize()
        res["rel_err"] = rel_err(out.cpu().float(), ref)
    elif mode == "quantize":
        from csrc_free_kernels import quantize_fp8_sm90_launch as q8
        x = torch.randn(257, 1024, device="cuda", dtype=torch.bfloat16)
        r = {"blockwise": "blockwise_1x128", "rowwise": "rowwise", "tensorwise": "tensorwise"}[recipe]
        q, s = q8.quantize(x, r)
        torch.cuda.synchronize()
        qr, sr = ts_moe.quantize_fp8(x.cpu(), r)
        res["scale_rel_err"] = rel_err(s.cpu().float().reshape(-1), sr.float().reshape(-1))
        res["values_equal_frac"] = (q.cpu().float() == qr.float()).float().mean().item()
    elif mode == "default":
        xq, wq, sx, sw, offs = problem(m=300, k=512, n=256, counts=(100, 0, 150, 30), pair=pair)
        ref = ref64(xq, wq, sx, pair[0], sw, pair[1], offs).float()
        out = ts_moe.scaled_grouped_gemm(xq.cuda(), wq.cuda().transpose(-2, -1), sx.cuda(), pair[0],
                                         sw.cuda(), pair[1], offs.cuda())
        torch.cuda.synchronize()
        res["rel_err"] = rel_err(out.cpu().float(), ref)
        from ts_moe.fp8 import paths
        res["path"] = paths.scaled_path(xq.cuda(), recipe, 512, 256, torch.bfloat16, 4).value
    res["status"] = "ok"
except Exception as e:
    res["status"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
print("RESULT " + json.dumps(res), flush=True)
'''
jobs = [("default", "-", r, "0") for r in ("blockwise", "rowwise", "tensorwise")]
jobs += [("quantize", "-", r, "0") for r in ("blockwise", "rowwise", "tensorwise")]
for name in ("fp8_decode16", "fp8_decode", "fp8_mid", "fp8_prefill"):
    for r in ("blockwise", "rowwise", "tensorwise"):
        jobs.append(("kernel", name, r, "0"))
procs = [subprocess.Popen([sys.executable, "-c", CHILD, *j], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) for j in jobs]
for j, p in zip(jobs, procs):
    try:
        out, _ = p.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        p.kill(); out = "RESULT " + json.dumps({"job": j, "status": "timeout"})
    line = [l for l in out.splitlines() if l.startswith("RESULT ")]
    print(line[-1] if line else f"NO RESULT {j}: {out[-400:]}", flush=True)
