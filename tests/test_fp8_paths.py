"""The FP8 ops' paths on the CPU: which path takes a call on each device (the backends'
own choose_config, a decline carrying its reason), and each CUDA path's backends run on
CPU tensors with only what needs a GPU faked: the sm_90 kernels' compiled functions (the
real backends, launch glue and layouts around them), torch._scaled_grouped_mm (as its
sm_90 kernel behaves).  The dequantize-then-grouped_gemm path runs for real."""

import inspect
import pathlib
import types

import pytest
import torch

import ts_moe
from ts_moe.fp8.recipes import Pair, Recipe
from ts_moe.fp8.reference import quantize_reference, scaled_grouped_gemm_reference
from ts_moe.ops import Op, paths, scaled
from ts_moe.ops.backend import first_taker
from ts_moe.ops.kernels import Declined
from ts_moe.ops.paths import Path

from .test_fp8_ops import PAIRS, assert_rows_close, problem, ref64

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
L = pytest.importorskip("csrc_free_kernels.fp8.grouped_gemm_fp8_sm90_launch")
QL = pytest.importorskip("csrc_free_kernels.fp8.quantize_fp8_sm90_launch")


def _meta_call(pair, k, n, experts, out_dtype, m=64):
    """Meta tensors of a call: a (M, K), b (E, K, N), the pair's scales, offs, out."""
    a = torch.empty(m, k, dtype=E4M3, device="meta")
    b = torch.empty(experts, n, k, dtype=E4M3, device="meta").mT
    sa = torch.empty(pair.a.scale_shape((m, k)), device="meta")
    sb = torch.empty(pair.b.scale_shape((experts, n, k)), device="meta")
    offs = torch.empty(experts, dtype=torch.int32, device="meta")
    out = torch.empty(m, n, dtype=out_dtype, device="meta")
    return a, b, sa, sb, offs, out


@pytest.mark.parametrize("capability, pair, k, n, out_dtype, experts, kernels_on, path", [
    (None, Pair.BLOCKWISE, 256, 256, BF16, 8, True, Path.REFERENCE),           # CPU
    ((9, 0), Pair.BLOCKWISE, 256, 256, BF16, 8, True, Path.KERNEL_SM90),       # H100/H200
    ((9, 0), Pair.TENSORWISE, 48, 40, torch.float32, 8, True, Path.KERNEL_SM90),
    ((9, 0), Pair.ROWWISE, 40, 256, BF16, 8, True, Path.DEQUANTIZE),           # K % 16
    ((9, 0), Pair.ROWWISE, 256, 256, BF16, 8, False, Path.TORCH_SCALED),       # no kernels
    ((9, 0), Pair.ROWWISE, 256, 256, torch.float32, 8, False, Path.DEQUANTIZE),
    ((9, 0), Pair.ROWWISE, 256, 200, BF16, 8, False, Path.DEQUANTIZE),         # N % 16
    ((9, 0), Pair.ROWWISE, 256, 256, BF16, 1024, False, Path.DEQUANTIZE),      # groups
    ((9, 0), Pair.BLOCKWISE, 256, 256, BF16, 8, False, Path.DEQUANTIZE),
    ((10, 0), Pair.ROWWISE, 256, 256, BF16, 8, True, Path.DEQUANTIZE),         # B200
    ((10, 3), Pair.BLOCKWISE, 256, 256, BF16, 8, True, Path.DEQUANTIZE),       # B300
    ((8, 9), Pair.TENSORWISE, 256, 256, BF16, 8, True, Path.DEQUANTIZE),       # L40S
    ((9, 0), Pair.BLOCKWISE, 256, 256, BF16, 600, True, Path.DEQUANTIZE),      # > 512
    ((9, 0), Pair.ROWWISE, 256, 256, BF16, 600, True, Path.TORCH_SCALED),
])
def test_path_per_device(capability, pair, k, n, out_dtype, experts, kernels_on, path):
    a, b, sa, sb, offs, out = _meta_call(pair, k, n, experts, out_dtype)
    with ts_moe.settings.override(fp8_kernels=kernels_on):
        taken, config = first_taker(paths.backends(Op.SCALED_GROUPED_GEMM, capability),
                                    a, b, sa, sb, offs, out, None, pair)
    assert taken is paths.TABLE[path][Op.SCALED_GROUPED_GEMM] and config


def test_a_declined_call_says_why():
    """Each backend that does not take a call answers a falsy Declined naming the limit."""
    def why(backend, *call):
        got = backend.choose_config(*call[:6], None, call[6])
        assert isinstance(got, Declined) and not got
        return got.reason

    assert "600 experts" in why(L.GROUPED_GEMM, *_meta_call(Pair.BLOCKWISE, 256, 256, 600, BF16),
                                Pair.BLOCKWISE)
    assert "K = 40" in why(L.GROUPED_GEMM, *_meta_call(Pair.ROWWISE, 40, 256, 8, BF16),
                           Pair.ROWWISE)
    torch_scaled = paths.TABLE[Path.TORCH_SCALED][Op.SCALED_GROUPED_GEMM]
    assert "rowwise recipe only" in why(torch_scaled,
                                        *_meta_call(Pair.BLOCKWISE, 256, 256, 8, BF16),
                                        Pair.BLOCKWISE)
    assert "bf16 only" in why(torch_scaled,
                              *_meta_call(Pair.ROWWISE, 256, 256, 8, torch.float32), Pair.ROWWISE)
    a, gate_up, sa, sb, offs, out = _meta_call(Pair.BLOCKWISE, 256, 2 * 192, 8, BF16)
    reason = L.GROUPED_GEMM_SWIGLU.choose_config(a, gate_up.mT, sa, sb, offs, out[:, :192], None,
                                                 Pair.BLOCKWISE)
    assert isinstance(reason, Declined) and "I = 192" in reason.reason
    x = torch.empty(4, 200, dtype=BF16, device="meta")
    assert "K = 200" in str(QL.QUANTIZE.choose_config(x, Recipe.ROWWISE))
    assert "activation recipes" in str(QL.QUANTIZE.choose_config(x, Recipe.BLOCKWISE_128X128))


# ------------------------------------------------ the sm_90 kernels, compiled part faked
class FakeKernels:
    """What ``compiled_kernel`` of the two launch modules returns, on the CPU: each call
    checks the layouts the kernel reads, is recorded, and computes with the reference."""

    def __init__(self):
        self.calls = []

    def gemm(self, config, recipe, out_dtype, swiglu=False):
        def fn(a, b, out, offs, sfa, sfb, ctas):
            assert a.dtype == b.dtype == E4M3 and a.stride(-1) == 1
            assert a.shape[0] <= 1 or a.stride(0) % 16 == 0
            assert b.stride(1) == 1 and (b.shape[2] <= 1 or b.stride(2) % 16 == 0)  # K-major
            assert out.dtype == out_dtype and out.stride(-1) == 1
            if recipe == "blockwise":  # the fast M-major layout
                assert sfa.stride(0) == 1 and sfa.stride(1) % 4 == 0
            self.calls.append(dict(kind="swiglu" if swiglu else "gemm", recipe=recipe,
                                   config=config, a=a, b=b, out=out))
            pair = Pair(recipe)
            h = scaled_grouped_gemm_reference(a, b, sfa, pair.a, sfb, pair.b, offs,
                                              torch.float32)
            if swiglu:
                inter = h.shape[1] // 2
                h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            out.copy_(h)
        return fn

    def quantize(self, recipe, dtype):
        def fn(x, q, scale, amax, ctas):
            assert x.stride(-1) == 1 and (x.shape[0] <= 1 or x.stride(0) * x.element_size() % 16
                                          == 0)
            self.calls.append(dict(kind="quantize", recipe=recipe))
            rq, rs = quantize_reference(x, recipe)
            q.copy_(rq)
            if recipe == "tensorwise":  # the amax comes in; the scale divided by goes out
                assert torch.equal(amax, x.abs().amax().float().reshape(1))
                assert scale.shape == (1,) and scale.data_ptr() != amax.data_ptr()
            scale.copy_(rs)
        return fn


@pytest.fixture
def h200(monkeypatch):
    """CPU tensors take the paths of an H200 with the FP8 kernels on: the real sm_90
    backends and launch glue, the compiled kernels faked (:class:`FakeKernels`)."""
    fake = FakeKernels()
    monkeypatch.setattr(paths, "device_capability", lambda t: (9, 0))
    monkeypatch.setattr(L, "compiled_kernel", fake.gemm)
    monkeypatch.setattr(L, "_ctas", lambda config, index: 132)
    monkeypatch.setattr(QL, "compiled_kernel", fake.quantize)
    monkeypatch.setattr(QL, "_max_ctas", lambda index: 1056)
    monkeypatch.setattr(QL, "_unused", lambda index: torch.zeros(1))
    with ts_moe.settings.override(fp8_kernels=True):
        yield fake


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_sm90_kernel_path_gets_its_layouts(h200, pair):
    a, w, sa, sw, offs = problem(pair=pair)
    a_index = torch.randint(-1, 46, (50,), dtype=torch.int32)
    offs = torch.tensor([10, 10, 30, 47], dtype=torch.int32)
    out = ts_moe.scaled_grouped_gemm(a, w.mT, sa, pair[0], sw, pair[1], offs, a_index=a_index)
    call = h200.calls[-1]
    assert call["kind"] == "gemm" and call["recipe"] is Pair.of(*map(Recipe, pair))
    assert call["b"].data_ptr() == w.data_ptr() and out.shape == (50, 200)
    assert out.data_ptr() == call["out"].data_ptr()
    assert_rows_close(out, ref64(a, w, sa, pair[0], sw, pair[1], offs, a_index))
    # an N-major b is copied to K-major once per call (the documented slow layout)
    ts_moe.scaled_grouped_gemm(a, w.mT.contiguous(), sa, pair[0], sw, pair[1], offs)
    assert h200.calls[-1]["b"].stride(1) == 1
    assert torch.equal(h200.calls[-1]["b"].view(torch.uint8), w.mT.view(torch.uint8))


def test_sm90_swiglu_fused_or_apart(h200):
    a, gate_up, sa, sw, offs = problem(n=256)
    pair = PAIRS[0]
    fused = scaled.scaled_grouped_gemm_swiglu(a, gate_up, sa, pair[0], sw, pair[1], offs)
    assert h200.calls[-1]["kind"] == "swiglu" and h200.calls[-1]["b"].shape == (4, 256, 256)
    # I = 64 is not a multiple of 128 (blockwise): the kernel's GEMM to fp32, then apart
    a2, gate_up2, sa2, sw2, offs2 = problem(n=128)
    apart = scaled.scaled_grouped_gemm_swiglu(a2, gate_up2, sa2, pair[0], sw2, pair[1], offs2)
    assert h200.calls[-1]["kind"] == "gemm" and h200.calls[-1]["out"].dtype == torch.float32
    ref = ref64(a2, gate_up2, sa2, pair[0], sw2, pair[1], offs2)
    assert_rows_close(apart, torch.nn.functional.silu(ref[:, :64]) * ref[:, 64:])
    assert_rows_close(fused, torch.nn.functional.silu(
        ref64(a, gate_up, sa, pair[0], sw, pair[1], offs)[:, :128])
        * ref64(a, gate_up, sa, pair[0], sw, pair[1], offs)[:, 128:])


def test_validation_runs_before_any_kernel(h200):
    a, w, sa, sw, offs = problem()
    h200.calls.clear()  # the problem's quantizer calls
    with pytest.raises(ValueError, match="^scale_a must have shape"):
        ts_moe.scaled_grouped_gemm(a, w.mT, sa[:, :1], *PAIRS[0][:1], sw, PAIRS[0][1], offs)
    with pytest.raises(TypeError, match="^a_index must be int32"):
        ts_moe.scaled_grouped_gemm(a, w.mT, sa, *PAIRS[0][:1], sw, PAIRS[0][1], offs,
                                   a_index=torch.arange(3))
    with pytest.raises(ValueError, match="^scale_recipe_a 'BlockWise1x16'"):
        ts_moe.scaled_grouped_gemm(a, w.mT, sa, torch.nn.functional.ScalingType.BlockWise1x16,
                                   sw, PAIRS[0][1], offs)
    assert h200.calls == []


def test_the_kernels_get_the_parsed_recipe(h200):
    """However the call names the recipes (ScalingType members, their names, ts_moe's),
    the launch module gets the parsed value: a Pair (a str of the kernel's name), and
    the quantizer a Recipe."""
    a, w, sa, sw, offs = problem(pair=PAIRS[1])
    st = torch.nn.functional.ScalingType
    for ra, rb in ((st.RowWise, st.RowWise), ("RowWise", "rowwise"),
                   (Recipe.ROWWISE, Recipe.ROWWISE)):
        ts_moe.scaled_grouped_gemm(a, w.mT, sa, ra, sw, rb, offs)
        assert h200.calls[-1]["recipe"] is Pair.ROWWISE
    ts_moe.quantize_fp8(torch.randn(8, 128), st.BlockWise1x128)
    assert h200.calls[-1] == dict(kind="quantize", recipe=Recipe.BLOCKWISE_1X128)
    assert isinstance(h200.calls[-1]["recipe"], Recipe)


def test_quantize_kernel_where_it_applies(h200):
    x = torch.randn(37, 256).bfloat16()
    q, s = ts_moe.quantize_fp8(x.t().contiguous().t(), "blockwise_1x128")  # copied to rows
    assert [c["recipe"] for c in h200.calls] == ["blockwise_1x128"] and s.stride() == (1, 40)
    rq, rs = quantize_reference(x, "blockwise_1x128")
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    ts_moe.quantize_fp8(x, "rowwise")
    _, st = ts_moe.quantize_fp8(x, "tensorwise")
    assert [c["recipe"] for c in h200.calls[1:]] == ["rowwise", "tensorwise"]
    assert torch.equal(st, quantize_reference(x, "tensorwise")[1])
    ts_moe.quantize_fp8(x[:, :200], "blockwise_1x128")  # K % 128: the reference
    ts_moe.quantize_fp8(x[:, :200], "rowwise")  # K % 16 == 8: the reference
    ts_moe.quantize_fp8(x.view(1, 37, 256), "rowwise")  # not 2-D
    ts_moe.quantize_fp8(x, "blockwise_128x128")  # a weight recipe
    ts_moe.quantize_fp8(x.double(), "rowwise")
    assert len(h200.calls) == 3
    with ts_moe.settings.override(fp8_kernels=False):
        ts_moe.quantize_fp8(x, "rowwise")
    assert len(h200.calls) == 3


def test_launch_modules_have_one_entry_and_check_nothing():
    """The FP8 launch module's one way in is ``launch`` (the backends' run is it); it and
    the quantizer's launch module raise nothing: every check is the op layer's, every
    limit a backend's decline."""
    import csrc_free_kernels.fp8.grouped_gemm_fp8_sm90_launch as gemm
    import csrc_free_kernels.fp8.quantize_fp8_sm90_launch as quant

    for module in (gemm, quant):
        source = pathlib.Path(module.__file__).read_text()
        assert "raise " not in source, module.__name__
    public = {name for name, f in vars(gemm).items()
              if inspect.isfunction(inspect.unwrap(f)) and f.__module__ == gemm.__name__
              and not name.startswith("_")}
    assert public == {"launch", "fake_args", "compiled_kernel", "fast_scale_a", "build",
                      "builds", "checked"}
    assert not any(name.startswith("scaled_grouped_gemm") for name in vars(gemm))
    for backend in (gemm.GROUPED_GEMM, gemm.GROUPED_GEMM_SWIGLU):
        assert "launch(" in inspect.getsource(type(backend).run)
    assert "quantize(" in inspect.getsource(type(quant.QUANTIZE).run)


# ------------------------------------------------------------- torch's FP8 GEMM
def _torch_scaled_stand_in(calls):
    """torch._scaled_grouped_mm's rowwise sm_90 kernel as it behaves: row-major a,
    column-major b, contiguous scales, bf16 out; rows past offs[-1] left undefined."""
    def scaled(a, b, scale_a, scale_b, offs=None, out_dtype=None):
        assert a.stride(-1) == 1 and b.stride(1) == 1 and out_dtype == BF16
        assert scale_a.is_contiguous() and scale_b.is_contiguous() and offs.dtype == torch.int32
        calls.append(offs)
        out = torch.full((a.shape[0], b.shape[2]), 7.0)
        start = 0
        for e, end in enumerate(offs.tolist()):
            x = a[start:end].float() * scale_a[start:end, None]
            out[start:end] = x @ (b[e].float() * scale_b[e])
            start = end
        return out.to(BF16)
    return scaled


def test_torch_scaled_path_semantics(monkeypatch):
    """Without the kernels, sm_90 rowwise goes to torch._scaled_grouped_mm: gathered rows
    and their scales, offs read as segment ends, the tail zeroed."""
    calls = []
    stand_in = _torch_scaled_stand_in(calls)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", stand_in, raising=False)
    if hasattr(torch.nn.functional, "scaled_grouped_mm"):  # called with the recipes named
        rowwise = torch.nn.functional.ScalingType.RowWise

        def named(a, b, sa, ra, sb, rb, offs=None, output_dtype=None):
            assert ra == rb == rowwise
            return stand_in(a, b, sa, sb, offs=offs, out_dtype=output_dtype)

        monkeypatch.setattr(torch.nn.functional, "scaled_grouped_mm", named)
    a, w, sa, sw, _ = problem(pair=PAIRS[1], n=256)
    a_index = torch.randint(-3, 48, (40,), dtype=torch.int32)
    for offs in (torch.tensor([9, 9, 25, 31], dtype=torch.int32),
                 torch.tensor([12, 3, 90, -1], dtype=torch.int32)):
        out = scaled.run_gemm((paths.TABLE[Path.TORCH_SCALED][Op.SCALED_GROUPED_GEMM],),
                              a, w.mT, sa, sw, offs, BF16, Pair.ROWWISE, a_index)
        assert calls[-1].tolist() == torch.cummax(offs.clamp(0, 40), 0).values.tolist()
        assert_rows_close(out, ref64(a, w, sa, "rowwise", sw, "rowwise", offs, a_index))
        assert (out[int(calls[-1][-1]):] == 0).all()


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
@pytest.mark.parametrize("out_dtype", [BF16, torch.float16, torch.float32])
def test_dequantize_path_matches_float64(pair, out_dtype):
    """sm_100 and other GPUs: bf16 operands through ts_moe.grouped_gemm (run here on its
    CPU reference), the same results within bf16's rounding of the dequantized values."""
    a, w, sa, sw, _ = problem(pair=pair, n=200)
    a_index = torch.randint(-1, 46, (30,), dtype=torch.int32)
    offs = torch.tensor([5, 5, 20, 27], dtype=torch.int32)
    parsed = Pair.of(*map(Recipe, pair))
    dequantize = paths.TABLE[Path.DEQUANTIZE]
    out = scaled.run_gemm((dequantize[Op.SCALED_GROUPED_GEMM],), a, w.mT, sa, sw, offs,
                          out_dtype, parsed, a_index)
    assert out.dtype == out_dtype and out.shape == (30, 200)
    assert_rows_close(out, ref64(a, w, sa, pair[0], sw, pair[1], offs, a_index))
    h = scaled.run_swiglu(((dequantize[Op.SCALED_GROUPED_GEMM_SWIGLU],
                            dequantize[Op.SCALED_GROUPED_GEMM]),),
                          a, w, sa, sw, offs, out_dtype, parsed, a_index)
    ref = ref64(a, w, sa, pair[0], sw, pair[1], offs, a_index)
    assert_rows_close(h, torch.nn.functional.silu(ref[:, :100]) * ref[:, 100:])


def test_reference_switch_read_at_each_call(monkeypatch):
    """TS_MOE_REFERENCE (ts_moe.settings.reference) is read at each call: a CUDA
    tensor's capability is None (the reference path) while it is on."""
    on_cuda = types.SimpleNamespace(device=torch.device("cuda", 0), get_device=lambda: 0)
    monkeypatch.setattr(paths, "_capability", lambda index: (9, 0))
    monkeypatch.delenv("TS_MOE_REFERENCE", raising=False)
    assert paths.device_capability(on_cuda) == (9, 0)
    monkeypatch.setenv("TS_MOE_REFERENCE", "1")
    assert paths.device_capability(on_cuda) is None
    assert paths.paths_for(Op.SCALED_GROUPED_GEMM, None) == (Path.REFERENCE,)
    monkeypatch.setenv("TS_MOE_REFERENCE", "0")
    assert paths.device_capability(on_cuda) == (9, 0)
    with ts_moe.settings.override(reference=True):  # code outranks the variable
        assert paths.device_capability(on_cuda) is None
    monkeypatch.setenv("TS_MOE_REFERENCE", "true")
    with pytest.raises(ValueError, match="TS_MOE_REFERENCE='true'"):
        paths.device_capability(on_cuda)
    monkeypatch.delenv("TS_MOE_REFERENCE")
    assert paths.device_capability(torch.ones(4, 128)) is None  # a CPU tensor


def test_the_fp8_kernels_are_on_by_default_and_switch_off():
    """They passed the whole GPU suite (bench/notes/2026-12-06-h100-run.md): sm_90 FP8
    calls take them first; ts_moe.use_fp8_kernels(False) leaves torch's and the
    dequantize path."""
    from ts_moe.settings import FP8_KERNELS

    assert FP8_KERNELS.default is True and paths.fp8_kernels_enabled()
    for op in (Op.SCALED_GROUPED_GEMM, Op.SCALED_GROUPED_GEMM_SWIGLU, Op.QUANTIZE_FP8):
        assert paths.paths_for(op, (9, 0))[0] is Path.KERNEL_SM90
    table = paths.TABLE[Path.KERNEL_SM90]
    assert table[Op.SCALED_GROUPED_GEMM] is L.GROUPED_GEMM
    assert table[Op.SCALED_GROUPED_GEMM_SWIGLU] is L.GROUPED_GEMM_SWIGLU
    assert table[Op.QUANTIZE_FP8] is QL.QUANTIZE
    on = paths.switches()
    ts_moe.use_fp8_kernels(False)
    try:
        assert paths.switches() != on  # what the decode graphs key on follows it
        assert paths.paths_for(Op.SCALED_GROUPED_GEMM, (9, 0)) == (
            Path.TORCH_SCALED, Path.DEQUANTIZE, Path.REFERENCE)
        assert paths.paths_for(Op.QUANTIZE_FP8, (9, 0)) == (Path.REFERENCE,)
    finally:
        ts_moe.use_fp8_kernels(True)
    assert paths.paths_for(Op.SCALED_GROUPED_GEMM, (9, 0))[0] is Path.KERNEL_SM90
