"""GPU (sm_90): the FP8 ops and layer on CUDA against float64 on the same quantized inputs,
each CUDA path, CUDA-graph capture, torch.compile, the decode graphs, and validation that
matches the CPU's.  Written for the H200 run; none of it has run on a GPU yet."""

import pytest
import torch

import ts_moe
from ts_moe import decode_graphs
from ts_moe.ops import Op, paths
from ts_moe.ops import scaled as scaled_ops
from ts_moe.ops.backend import first_taker
from ts_moe.ops.paths import Path
from ts_moe.fp8.recipes import Pair, Recipe
from ts_moe.fp8.reference import quantize_reference


@pytest.fixture(autouse=True)
def fp8_kernels():
    """The op's sm_90 FP8 kernel path (``ts_moe.settings.fp8_kernels``, on by default),
    whatever the process's settings; restored after each test."""
    with ts_moe.settings.override(fp8_kernels=True):
        yield

from .fp8_accumulation_model import LAYER_ROW_TOL, LAYER_TOL
from .helpers import rel_err
from .test_fp8_layer import fp8_layer, reference64
from .test_fp8_ops import BAD, PAIRS, _call, _outcome, assert_rows_close, ref64

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
# (M, K, N, E): decode, a ragged mid size, Qwen3-30B-A3B's down, DeepSeek-V3's gate_up
# (4 of its 256 experts, so that the float64 reference stays small)
SHAPES = [(8, 2048, 1536, 8), (1000, 1024, 512, 16), (4096, 768, 2048, 128),
          (512, 7168, 4096, 4)]


def poison_allocator(nbytes=1 << 30):
    """Fill free memory of the caching allocator with NaN bytes, so that an output the op
    allocates and fails to write shows up as NaN."""
    torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(0xFF)
    torch.cuda.synchronize()


def cuda_problem(m, k, n, e, pair, seed=0, skew=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(e, n, k, generator=g) * k**-0.5
    a, sa = ts_moe.quantize_fp8(x, pair[0])
    b, sb = ts_moe.quantize_fp8(w, pair[1])
    weights = torch.arange(1, e + 1, dtype=torch.float).pow(-1.0 if skew else 0.0)
    counts = torch.bincount(torch.multinomial(weights, m - 3, replacement=True, generator=g),
                            minlength=e)
    counts[e // 2] = 0  # an empty expert
    offs = counts.cumsum(0).to(torch.int32)  # unaligned, 3 tail rows (+ the emptied ones)
    return [t.cuda() for t in (a, b, sa, sb, offs)]


def _cpu(*ts):
    return [t.cpu() for t in ts]


@pytest.mark.parametrize("shape", SHAPES, ids=["decode", "mid", "qwen3_down", "dsv3_gate_up"])
@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_kernel_matches_float64(shape, pair):
    m, k, n, e = shape
    a, b, sa, sb, offs = cuda_problem(m, k, n, e, pair)
    out = torch.empty(m, n, dtype=BF16, device="cuda")
    taken, _ = first_taker(paths.backends(Op.SCALED_GROUPED_GEMM, paths.device_capability(a)),
                           a, b.mT, sa, sb, offs, out, None, Pair.of(*map(Recipe, pair)))
    assert taken is paths.TABLE[Path.KERNEL_SM90][Op.SCALED_GROUPED_GEMM]
    poison_allocator()
    out = ts_moe.scaled_grouped_gemm(a, b.mT, sa, pair[0], sb, pair[1], offs)
    ref = ref64(*_cpu(a, b, sa), pair[0], sb.cpu(), pair[1], offs.cpu())
    assert_rows_close(out.cpu(), ref)
    assert (out[int(offs[-1]):] == 0).all()


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_kernel_a_index_invalid_offs_and_swiglu(pair):
    a, b, sa, sb, _ = cuda_problem(300, 1024, 512, 8, pair)
    a_index = torch.randint(-5, 305, (600,), dtype=torch.int32)
    a_index[:4] = torch.tensor([-(2**31), 2**31 - 1, 7, 7])
    for offs in (torch.tensor([50, 50, 170, 171, 400, 500, 590, 597], dtype=torch.int32),
                 torch.tensor([90, 40, 700, -3, 0, 600, 2, 9], dtype=torch.int32)):
        a_index_c, offs_c = a_index.cuda(), offs.cuda()
        poison_allocator()
        out = ts_moe.scaled_grouped_gemm(a, b.mT, sa, pair[0], sb, pair[1], offs_c,
                                         a_index=a_index_c)
        ref = ref64(*_cpu(a, b, sa), pair[0], sb.cpu(), pair[1], offs, a_index)
        assert_rows_close(out.cpu(), ref)
        h = scaled_ops.scaled_grouped_gemm_swiglu(a, b, sa, pair[0], sb, pair[1], offs_c,
                                                  a_index=a_index_c)
        assert_rows_close(h.cpu(), torch.nn.functional.silu(ref[:, :256]) * ref[:, 256:])


@pytest.mark.parametrize("path", [Path.TORCH_SCALED, Path.DEQUANTIZE])
def test_fallback_paths_on_cuda(path):
    pair = PAIRS[1] if path is Path.TORCH_SCALED else PAIRS[0]
    a, b, sa, sb, offs = cuda_problem(700, 1024, 512, 8, pair)
    a_index = torch.randint(-1, 701, (900,), dtype=torch.int32).cuda()
    offs = (offs.long() * 900 // 700).to(torch.int32)
    out = scaled_ops.run_gemm((paths.TABLE[path][Op.SCALED_GROUPED_GEMM],), a, b.mT, sa, sb,
                              offs, BF16, Pair.of(*map(Recipe, pair)), a_index)
    ref = ref64(*_cpu(a, b, sa), pair[0], sb.cpu(), pair[1], offs.cpu(), a_index.cpu())
    assert_rows_close(out.cpu(), ref)


@pytest.mark.parametrize("recipe", ["blockwise_1x128", "rowwise", "tensorwise"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_quantize_kernel_matches_the_reference(recipe, dtype):
    """Bit for bit: the kernel's scales and elements are IEEE divisions (div.rn.f32), as
    torch's tensor divisions on the CPU are; the tensorwise scale is the one the kernel
    wrote and divided by."""
    x = (torch.randn(777, 2048) * torch.rand(777, 1) * 30).to(dtype)
    x[5] = 0
    q, s = ts_moe.quantize_fp8(x.cuda(), recipe)
    rq, rs = quantize_reference(x, recipe)
    assert s.stride() == ts_moe.quantize_fp8(x, recipe)[1].stride()
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("recipe", ["blockwise_1x128", "rowwise", "tensorwise",
                                    "blockwise_128x128"])
def test_reference_quantizer_on_cuda_is_the_cpus(recipe):
    """The plain-torch quantizer (the fallback's, the weights') on CUDA: bit for bit the
    CPU's, its divisions true ones there too."""
    x = torch.randn(3, 300, 1000) * torch.rand(3, 300, 1) * 30
    if recipe in ("blockwise_1x128", "rowwise"):
        x = x[0]
    q, s = quantize_reference(x.cuda(), recipe)
    rq, rs = quantize_reference(x, recipe)
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))


def test_graph_capture_replays_new_inputs():
    """quantize + GEMM (gathered rows) captured once, replayed on new tokens and new offs:
    the eager result for those inputs (no host sync inside the ops)."""
    pair = PAIRS[0]
    _, b, _, sb, offs = cuda_problem(256, 2048, 1024, 8, pair)
    x = torch.randn(64, 2048, device="cuda", dtype=BF16)
    a_index = torch.randint(0, 64, (256,), dtype=torch.int32, device="cuda")

    def step():
        xq, sx = ts_moe.quantize_fp8(x, pair[0])
        return ts_moe.scaled_grouped_gemm(xq, b.mT, sx, pair[0], sb, pair[1], offs,
                                          a_index=a_index)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        a_index.copy_(torch.randint(0, 64, (256,), dtype=torch.int32))
        offs.copy_(torch.sort(torch.randint(0, 257, (8,), dtype=torch.int32)).values)
        graph.replay()
        assert torch.equal(out, step())


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_compile_fullgraph_on_cuda(pair):
    a, b, sa, sb, offs = cuda_problem(512, 1024, 512, 8, pair)
    x = torch.randn(512, 1024, device="cuda", dtype=BF16)

    def fn(x):
        xq, sx = ts_moe.quantize_fp8(x, pair[0])
        return ts_moe.scaled_grouped_gemm(xq, b.mT, sx, pair[0], sb, pair[1], offs)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, fullgraph=True)(x), fn(x))


@pytest.mark.parametrize("case", list(BAD))
def test_errors_on_cuda_are_the_cpus(case):
    kw, exc, name = BAD[case]
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    assert _outcome(_call, **cuda) == ("error", exc, name)


@pytest.mark.parametrize("recipe", ["blockwise_128x128", "rowwise", "tensorwise"])
def test_layer_on_cuda_and_its_decode_graph(recipe):
    x, router, gq, gs, dq, ds = fp8_layer(recipe, T=16, H=1024, I=512, E=8)
    ref = reference64(x, router, gq, gs, dq, ds, 2, recipe)
    cuda = [t.cuda() for t in (router, gq, gs, dq, ds)]
    decode_graphs.graphs.clear()
    with torch.no_grad():
        eager = ts_moe.moe_forward(x.cuda(), cuda[0], cuda[1], cuda[3], 2, gate_up_scale=cuda[2],
                                   down_scale=cuda[4], scale_recipe=recipe, decode_graphs=False)
        # the reference re-quantizes an intermediate that the WGMMA's 14-bit accumulation
        # moves (tests/fp8_accumulation_model.py, which also derives these tolerances)
        assert_rows_close(eager.cpu(), ref, LAYER_ROW_TOL)
        assert rel_err(eager.cpu(), ref) <= LAYER_TOL
        for _ in range(3):
            got = ts_moe.moe_forward(x.cuda(), cuda[0], cuda[1], cuda[3], 2,
                                     gate_up_scale=cuda[2], down_scale=cuda[4],
                                     scale_recipe=recipe)
            assert torch.equal(got, eager)
    assert decode_graphs.graphs.captures == 1
    decode_graphs.graphs.clear()


def test_decode_graphs_key_on_the_fp8_switch():
    """Switching the FP8 kernels off gives the next decode call a graph of its own, on
    the path it switched to (the old graph would replay the kernels)."""
    x, router, gq, gs, dq, ds = fp8_layer("blockwise_128x128", T=4, H=1024, I=512, E=8)
    x, router, gq, gs, dq, ds = (t.cuda() for t in (x, router, gq, gs, dq, ds))

    def layer(**kw):
        return ts_moe.moe_forward(x, router, gq, dq, 2, gate_up_scale=gs, down_scale=ds,
                                  scale_recipe="blockwise_128x128", **kw)

    decode_graphs.graphs.clear()
    with torch.no_grad():
        for _ in range(3):
            layer()
        assert decode_graphs.graphs.captures == 1
        with ts_moe.settings.override(fp8_kernels=False):
            eager = layer(decode_graphs=False)  # the dequantize path
            for _ in range(3):
                assert torch.equal(layer(), eager)
        assert decode_graphs.graphs.captures == 2
    decode_graphs.graphs.clear()


def test_fp8_roof_and_suite_on_the_gpu():
    """The dense FP8 roof is measured, and the fp8 suite's backends pass their checks on
    a decode and a prefill case (F.scaled_grouped_mm: timed, or unavailable with
    torch's reason)."""
    from bench import fp8 as suite, runner
    from bench.roofs import measure_roofs

    device = torch.device("cuda")
    roofs = measure_roofs(device)
    assert 1.2 * roofs["bf16_dense_tflops"] < roofs["fp8_dense_tflops"] < 5000
    case_list = suite.fp8_cases(["qwen3-30b-a3b"], [16, 4096], ["down"], ["uniform"])
    records = runner.run_suite(runner.SUITES["fp8"], case_list, list(suite.DEFAULT_BACKENDS),
                               runner.Settings(device, target_ms=5), roofs)
    for r in records:
        if r["backend"] == "F_scaled_grouped_mm" and r["status"] == "unavailable":
            assert "refuses blockwise" in r["reason"]
            continue
        assert r["status"] == "ok" and r["max_rel_err"] <= 1e-2, r
        assert r["roof_frac"] is not None and r["flop_roof"] == "fp8_dense_tflops"
