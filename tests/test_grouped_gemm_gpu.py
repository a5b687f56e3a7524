"""The sm_90 CuTeDSL grouped GEMM against fp32 references and F.grouped_mm."""

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import torch

import ts_moe
from ts_moe.reference import grouped_gemm_reference, segment_ends

from .helpers import counts_to_offs, random_counts, rel_err

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {  # E, H, I, top-k
    "mixtral": (8, 4096, 14336, 2),
    "qwen3": (128, 2048, 768, 8),
    "deepseek": (256, 7168, 2048, 8),
}


def gg():
    from . import kernel_calls
    return kernel_calls


def ggc():
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config
    return grouped_gemm_sm90_config


def make(m, k, n, e, counts=None, kmajor=False, dtype=torch.bfloat16):
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    if kmajor:  # nn.Linear / Hugging Face (E, N, K) weights, passed transposed
        b = (torch.randn(e, n, k, device="cuda", dtype=dtype) * k**-0.5).transpose(-2, -1)
    else:
        b = torch.randn(e, k, n, device="cuda", dtype=dtype) * k**-0.5
    offs = counts_to_offs(random_counts(m, e) if counts is None else counts)
    return a, b, offs


def reference(a, b, offs):
    """fp32 per expert on the GPU (fast enough for the largest cases)."""
    return grouped_gemm_reference(a, b, offs, torch.float32)


def run_poisoned(a, b, offs, out_dtype=None, **kw):
    """Poison the output with NaN first; every element must then be written."""
    out = torch.full((a.shape[0], b.shape[2]), float("nan"), device="cuda",
                     dtype=out_dtype or a.dtype)
    gg().grouped_gemm(a, b, offs, out_dtype, out=out, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten (NaN) output elements"
    return out


def check(a, b, offs, tol=1e-2, **kw):
    ref = reference(a, b, offs)
    out = run_poisoned(a, b, offs, **kw)
    err = rel_err(out, ref)
    assert err < tol, f"rel err {err}"
    end = int(segment_ends(offs, a.shape[0])[-1]) if offs.numel() else 0
    assert (out[end:] == 0).all()
    return out


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("gemm", ["gate_up", "down"])
@pytest.mark.parametrize("tokens", [1, 16, 1024])
def test_model_shapes(model, gemm, tokens):
    e, h, i, topk = MODELS[model]
    n, k = (2 * i, h) if gemm == "gate_up" else (h, i)
    a, b, offs = make(tokens * topk, k, n, e, kmajor=gemm == "down")
    out = check(a, b, offs)
    if hasattr(torch, "_grouped_mm"):
        end = int(offs[-1])
        assert rel_err(out[:end], torch._grouped_mm(a, b, offs=offs)[:end]) < 1e-2


CONFIG_NAMES = ["decode16", "decode16_n64", "decode", "decode_p2", "mid", "prefill", "prefill_p2"]
# raster bands of two m-tiles, so that the small cases below span several bands
VARIANTS = {"prefill:band": dict(band_m=2),
            "prefill_p2:band": dict(band_m=2), "mid:band": dict(band_m=2)}


def config_named(name):
    """A configuration of CONFIG_NAMES, or a VARIANTS entry."""
    return dataclasses.replace(ggc().CONFIGS[name.split(":")[0]], **VARIANTS.get(name, {}))


def launch_kw(name, swiglu=False):
    """The launch keywords of a CONFIG_NAMES or VARIANTS entry: its configuration."""
    return {"config": config_named(name)}


@pytest.mark.parametrize("config", CONFIG_NAMES + list(VARIANTS))
@pytest.mark.parametrize("kmajor", [False, True])
def test_configs_and_layouts(config, kmajor):
    a, b, offs = make(1000, 256, 392, 6, counts=[0, 301, 1, 0, 500, 150], kmajor=kmajor)
    check(a, b, offs, **launch_kw(config))  # 48 tail rows, N and M not tile multiples


@pytest.mark.parametrize("config", CONFIG_NAMES + list(VARIANTS))
def test_routing_extremes(config):
    kw = launch_kw(config)
    k, n = 128, 256
    check(*make(777, k, n, 8, counts=[0, 0, 0, 777, 0, 0, 0, 0]), **kw)  # one expert
    check(*make(8, k, n, 8, counts=[1] * 8), **kw)  # one row per expert
    check(*make(1, k, n, 8, counts=[0, 0, 1, 0, 0, 0, 0, 0]), **kw)  # one row
    check(*make(64, k, n, 8, counts=[0] * 8), **kw)  # all empty: all zeros
    counts = torch.zeros(512, dtype=torch.long)
    counts[torch.randperm(512)[:5]] = torch.tensor([100, 3, 250, 1, 46])
    check(*make(400, k, n, 512, counts=counts), **kw)  # E = 512, most empty
    c = random_counts(3000, 64, skew=1.2)
    check(*make(3000, k, n, 64, counts=c), **kw)  # skewed


def test_operand_layouts_and_dtypes():
    a, b, offs = make(336, 192, 136, 4)
    wide = torch.randn(336, 256, device="cuda", dtype=torch.bfloat16)
    wide[:, :192] = a
    check(wide[:, :192], b, offs)  # row stride 256 > K
    check(a.t().contiguous().t(), b, offs)  # M-major a (copied K-major)
    a16, b16, offs16 = make(333, 192, 136, 4, dtype=torch.float16)
    check(a16, b16, offs16)
    ref = reference(a, b, offs)
    out = run_poisoned(a, b, offs, torch.float32)
    assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-2


def test_bad_offsets_are_safe():
    a, b, _ = make(300, 128, 128, 4)
    offs = torch.tensor([200, 50, 10_000, -5], dtype=torch.int32, device="cuda")
    check(a, b, offs)  # segments: [0,200), [200,200), [200,300), tail none


def test_largest_m():
    m = 1 << 20
    counts = random_counts(m, 16, skew=1.0)
    check(*make(m, 64, 64, 16, counts=counts))


KERNEL_PATH_BAD = [
    (lambda a, b, o: (a[:, :120], b, o), ValueError, "K mismatch"),
    (lambda a, b, o: (a, b, o[:-1]), ValueError, "one entry per expert"),
    (lambda a, b, o: (a, b, o.cpu()), ValueError, "one device"),
    (lambda a, b, o: (a, b[:, ::2], o), ValueError, "K mismatch"),
    (lambda a, b, o: (a, torch.empty(*b.shape[:2], 260, device="cuda", dtype=b.dtype)
                      [:, :, :b.shape[2]].copy_(b), o), ValueError, "b: stride 260 of dim 1"),
    (lambda a, b, o: (torch.empty(a.numel() + 1, device="cuda", dtype=a.dtype)[1:].view(a.shape),
                      b, o), ValueError, "data pointer is not 16-byte aligned"),
    (lambda a, b, o: (a, b.transpose(0, 1), o), ValueError, "K mismatch|one entry"),
    (lambda a, b, o: (a, b.float(), o), TypeError, "must have a's dtype"),
]


@pytest.mark.parametrize("corrupt, exc, msg", KERNEL_PATH_BAD)
def test_validation_on_the_kernel_path(corrupt, exc, msg):
    a, b, offs = make(64, 128, 256, 4)
    with pytest.raises(exc, match=msg):
        ts_moe.grouped_gemm(*corrupt(a, b, offs))
    # a stride that is neither unit nor 16-byte aligned: only the kernel sees it
    wide = torch.randn(64, 132, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="stride 132 of dim 0"):
        ts_moe.grouped_gemm(wide[:, :128], b, offs)


def test_op_dispatches_to_kernel_and_no_sync(monkeypatch):
    """This call of each op runs its sm_90 kernel once, with the configuration
    the heuristic gives its shapes (recorded at the backends' ``run``), without
    a host sync, and its result is right overall and per row."""
    from csrc_free_kernels.hopper import grouped_gemm_sm90_launch as launch
    from ts_moe.reference import grouped_gemm_swiglu_reference

    calls = []
    for name in ("GROUPED_GEMM", "GROUPED_GEMM_SWIGLU"):
        backend = getattr(launch, name)

        def run(*args, _run=backend.run, _name=name, **kwargs):
            calls.append((_name, args[4]))  # (backend, config)
            return _run(*args, **kwargs)

        monkeypatch.setattr(backend, "run", run)
    a, b, offs = make(512, 256, 512, 8)
    gate_up = b.transpose(-2, -1)  # (E, 2I, H) = (8, 512, 256): I = 256
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ts_moe.grouped_gemm(a, b, offs)
        h = ts_moe.grouped_gemm_swiglu(a, gate_up, offs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert calls == [("GROUPED_GEMM", launch.choose_config(8, 512, 256, 512)),
                     ("GROUPED_GEMM_SWIGLU", launch.swiglu_config(8, 512, 256, 512))]
    assert calls[1][1] is not None  # the fused kernel, not the GEMM and the activation apart
    for got, want in ((out, reference(a, b, offs)),
                      (h, grouped_gemm_swiglu_reference(a.float(), gate_up.float(), offs))):
        assert rel_err(got, want) < 1e-2
        end = int(offs[-1])
        per_row = (got[:end].double() - want[:end].double()).norm(dim=1) / \
            want[:end].double().norm(dim=1).clamp_min(1e-6)
        assert per_row.max() < 2e-2
        assert (got[end:] == 0).all()


def test_cuda_graph_and_compile():
    a, b, offs = make(64, 512, 1024, 8)
    fn = torch.compile(lambda a, b, o: ts_moe.grouped_gemm(a, b, o) * 2, fullgraph=True)
    assert rel_err(fn(a, b, offs), 2 * reference(a, b, offs)) < 1e-2
    static_out = ts_moe.grouped_gemm(a, b, offs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ts_moe.grouped_gemm(a, b, offs)
    for _ in range(3):  # new data and new routing, same buffers
        a.copy_(torch.randn_like(a))
        offs.copy_(counts_to_offs(random_counts(64, 8)))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(static_out, reference(a, b, offs)) < 1e-2


def test_current_stream():
    a, b, offs = make(256, 256, 256, 4)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(10_000_000)  # the kernel must queue behind this
        out = ts_moe.grouped_gemm(a, b, offs)
    s.synchronize()
    assert rel_err(out, reference(a, b, offs)) < 1e-2


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer(tool):
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(exe):
        pytest.skip("compute-sanitizer not installed")
    torch.cuda.empty_cache()  # leave the child the memory this process cached
    proc = subprocess.run(
        # API errors off: cuda-python probes driver entry points with
        # cuGetProcAddress while a kernel compiles, and memcheck counts each
        # probe that fails as an error; device-side errors are what this checks
        [exe, f"--tool={tool}", "--report-api-errors=no", "--error-exitcode=3",
         sys.executable, "-m",
         "tests.gpu_small_check"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0
    # memcheck ends "ERROR SUMMARY: 0 errors", racecheck "RACECHECK SUMMARY: 0 hazards
    # displayed (0 errors, 0 warnings)"
    summary = {"memcheck": "ERROR SUMMARY: 0 errors",
               "racecheck": "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"}
    assert summary[tool] in proc.stdout + proc.stderr
    # every configuration ran and matched the reference under the tool
    from .gpu_small_check import configs
    assert proc.stdout.count("rel err") == len(configs())
    assert "route kernels ok" in proc.stdout  # the decode block's small kernels too


@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_swiglu_configs(config):
    """The fused gate/up + SwiGLU kernel in every configuration, ragged, poisoned output."""
    from ts_moe.reference import grouped_gemm_swiglu_reference

    e, h, inter = 6, 256, 384  # I a multiple of every config's tile_n / 2
    a = torch.randn(1000, h, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * h**-0.5
    offs = counts_to_offs([0, 301, 1, 0, 500, 150])  # 48 rows past the last expert
    out = torch.full((1000, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    gg().grouped_gemm_swiglu(a, gate_up, offs, out=out, **launch_kw(config, swiglu=True))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten (NaN) output elements"
    ref = grouped_gemm_swiglu_reference(a.float(), gate_up.float(), offs)
    assert rel_err(out, ref) < 1e-2
    assert (out[952:] == 0).all()


@pytest.mark.parametrize("config", ["prefill"])
def test_long_walks(config):
    """Many tiles per CTA, each with many more k-tiles than the ring has stages."""
    kw = launch_kw(config)
    check(*make(4096, 2048, 4096, 8), **kw)
    check(*make(4096, 2048, 4096, 8, counts=[1000, 0, 37, 2000, 0, 900, 159, 0]), **kw)


@pytest.mark.parametrize("config", ["decode16", "decode16_n64", "decode", "mid", "prefill",
                                    "swiglu:decode16", "swiglu:decode16_n64"])
def test_prefetch_weights_behind_a_pdl_kernel(config):
    """``prefetch_weights``: the weights stream while the kernel ahead (here a long
    GEMM writing this one's tokens, itself launched with PDL) still runs; the
    tokens must still be read after it: they are NaN until it writes them, at
    every step, with fresh data each time."""
    swiglu = config.startswith("swiglu:")
    cfg = ggc().CONFIGS[config.split(":")[-1]]
    e, m, k1, k = 8, 256, 4096, 512
    n = 2 * 384 if swiglu else 384
    offs = counts_to_offs([0, 40, 1, 100, 0, 64, 3, 48])
    x = torch.empty(m, k1, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(e, k1, k, device="cuda", dtype=torch.bfloat16) * k1**-0.5
    w2 = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16) * k**-0.5
    gate_up = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5  # HF layout
    h = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    for step in range(4):
        x.normal_()
        h.fill_(float("nan"))
        gg().grouped_gemm(x, w1, offs, out=h)  # ~30 MB of weights ahead of ours
        if swiglu:
            out = gg().grouped_gemm_swiglu(h, gate_up, offs, config=cfg,
                                           prefetch_weights=True)
        else:
            out = gg().grouped_gemm(h, w2, offs, config=cfg, prefetch_weights=True)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"step {step}: tokens read before they were written"
        if swiglu:
            from ts_moe.reference import grouped_gemm_swiglu_reference
            ref = grouped_gemm_swiglu_reference(h.float(), gate_up.float(), offs)
        else:
            ref = reference(h, w2, offs)
        assert rel_err(out, ref) < 1e-2
        diff, ref64 = (out.double() - ref.double()), ref.double()  # every row is routed
        assert (diff.norm(dim=1) / ref64.norm(dim=1)).max() < 1e-2


def test_prefetch_weights_op_argument():
    a, b, offs = make(64, 256, 384, 4)
    plain = ts_moe.grouped_gemm(a, b, offs)
    assert torch.equal(ts_moe.grouped_gemm(a, b, offs, prefetch_weights=True), plain)
    with pytest.raises(TypeError, match="prefetch_weights must be a bool"):
        ts_moe.grouped_gemm(a, b, offs, prefetch_weights=1)
