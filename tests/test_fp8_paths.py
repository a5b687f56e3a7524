"""The FP8 ops' paths on the CPU: the path table, and each CUDA path's dispatch run on
CPU tensors with stand-ins for what needs a GPU (the sm_90 kernel modules, as their
API in csrc_free_kernels/*_fp8_sm90_launch.py promises it; torch._scaled_grouped_mm,
as its sm_90 kernel behaves).  The dequantize-then-grouped_gemm path runs for real."""

import types

import pytest
import torch

import ts_moe
from ts_moe.fp8 import paths, quantize, scaled_ops
from ts_moe.fp8.paths import Fp8Path, choose_fp8_path
from ts_moe.fp8.recipes import PAIRS as RECIPE_PAIRS
from ts_moe.fp8.reference import quantize_reference, scaled_grouped_gemm_reference
from ts_moe.ops import kernels

from .test_fp8_ops import PAIRS, assert_rows_close, problem, ref64

BF16 = torch.bfloat16
RECIPES_OF = {kernel: pair for pair, kernel in RECIPE_PAIRS.items()}


@pytest.mark.parametrize("capability, pair, k, n, out_dtype, experts, kernels, path", [
    (None, "blockwise", 256, 256, BF16, 8, True, Fp8Path.REFERENCE),          # CPU
    ((9, 0), "blockwise", 256, 256, BF16, 8, True, Fp8Path.KERNEL_SM90),      # H100/H200
    ((9, 0), "tensorwise", 48, 40, torch.float32, 8, True, Fp8Path.KERNEL_SM90),
    ((9, 0), "rowwise", 40, 256, BF16, 8, True, Fp8Path.DEQUANTIZE),          # K % 16
    ((9, 0), "rowwise", 256, 256, BF16, 8, False, Fp8Path.TORCH_SCALED),      # no kernels
    ((9, 0), "rowwise", 256, 256, torch.float32, 8, False, Fp8Path.DEQUANTIZE),
    ((9, 0), "rowwise", 256, 200, BF16, 8, False, Fp8Path.DEQUANTIZE),        # N % 16
    ((9, 0), "rowwise", 256, 256, BF16, 1024, False, Fp8Path.DEQUANTIZE),     # groups
    ((9, 0), "blockwise", 256, 256, BF16, 8, False, Fp8Path.DEQUANTIZE),
    ((10, 0), "rowwise", 256, 256, BF16, 8, True, Fp8Path.DEQUANTIZE),        # B200
    ((10, 3), "blockwise", 256, 256, BF16, 8, True, Fp8Path.DEQUANTIZE),      # B300
    ((8, 9), "tensorwise", 256, 256, BF16, 8, True, Fp8Path.DEQUANTIZE),      # L40S
    ((9, 0), "blockwise", 256, 256, BF16, 600, True, Fp8Path.DEQUANTIZE),    # > 512 experts
    ((9, 0), "rowwise", 256, 256, BF16, 600, True, Fp8Path.TORCH_SCALED),
])
def test_path_per_device(capability, pair, k, n, out_dtype, experts, kernels, path):
    assert choose_fp8_path(capability, pair, k, n, out_dtype, experts,
                           kernels_available=kernels) is path


class StandInKernels:
    """csrc_free_kernels.grouped_gemm_fp8_sm90_launch's API on the CPU: checks the layouts
    it is promised, records the call, computes with the reference into ``out``."""

    MAX_EXPERTS = 512

    def __init__(self, swiglu_ok=True):
        self.calls, self.swiglu_ok = [], swiglu_ok

    def _record(self, kind, a, b, scale_a, scale_b, offs, recipe, out_dtype, a_index, out):
        assert a.dtype == b.dtype == torch.float8_e4m3fn and recipe in RECIPES_OF
        assert a.stride(-1) == 1 and (a.shape[0] <= 1 or a.stride(0) % 16 == 0)
        assert b.stride(1) == 1 and b.stride(2) % 16 == 0  # K-major
        assert out is not None and out.dtype == out_dtype and out.stride(-1) == 1
        assert (out.stride(0) * out.element_size()) % 16 == 0
        self.calls.append(dict(kind=kind, a=a, b=b, recipe=recipe, a_index=a_index, out=out,
                               out_dtype=out_dtype))
        return RECIPES_OF[recipe]

    def scaled_grouped_gemm(self, a, b, scale_a, scale_b, offs, *, recipe,
                            out_dtype=BF16, a_index=None, out=None):
        ra, rb = self._record("gemm", a, b, scale_a, scale_b, offs, recipe, out_dtype, a_index,
                              out)
        return out.copy_(scaled_grouped_gemm_reference(a, b, scale_a, ra, scale_b, rb, offs,
                                                       out_dtype, a_index))

    def scaled_grouped_gemm_swiglu(self, a, b, scale_a, scale_b, offs, *, recipe,
                                   out_dtype=BF16, a_index=None, out=None):
        ra, rb = self._record("swiglu", a, b, scale_a, scale_b, offs, recipe, out_dtype,
                              a_index, out)
        h = scaled_grouped_gemm_reference(a, b, scale_a, ra, scale_b, rb, offs, torch.float32,
                                          a_index)
        inter = h.shape[1] // 2
        return out.copy_(torch.nn.functional.silu(h[:, :inter]) * h[:, inter:])

    def swiglu_supported(self, two_i, recipe):
        return self.swiglu_ok


@pytest.fixture
def h200(monkeypatch):
    """CPU tensors take the paths of an H200 with the FP8 kernels: a stand-in for them."""
    kernels = StandInKernels()
    monkeypatch.setattr(paths, "device_capability", lambda t: (9, 0))
    monkeypatch.setattr(paths, "gemm_kernels", lambda: kernels)
    monkeypatch.setattr(scaled_ops, "gemm_kernels", lambda: kernels)
    monkeypatch.setattr(paths, "quantize_kernels", lambda: None)  # the reference quantizes
    return kernels


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_sm90_kernel_path_passes_the_api_its_layouts(h200, pair):
    a, w, sa, sw, offs = problem(pair=pair)
    a_index = torch.randint(-1, 46, (50,), dtype=torch.int32)
    offs = torch.tensor([10, 10, 30, 47], dtype=torch.int32)
    out = ts_moe.scaled_grouped_gemm(a, w.mT, sa, pair[0], sw, pair[1], offs, a_index=a_index)
    call = h200.calls[-1]
    assert call["kind"] == "gemm" and call["recipe"] == RECIPE_PAIRS[pair]
    assert call["a_index"] is a_index and call["a"] is a and call["b"].data_ptr() == w.data_ptr()
    assert out.data_ptr() == call["out"].data_ptr() and out.shape == (50, 200)
    assert_rows_close(out, ref64(a, w, sa, pair[0], sw, pair[1], offs, a_index))
    # an N-major b is copied to K-major once per call (the documented slow layout)
    ts_moe.scaled_grouped_gemm(a, w.mT.contiguous(), sa, pair[0], sw, pair[1], offs)
    assert h200.calls[-1]["b"].stride(1) == 1
    assert torch.equal(h200.calls[-1]["b"].view(torch.uint8), w.mT.view(torch.uint8))


def test_sm90_swiglu_fused_or_apart(h200):
    a, gate_up, sa, sw, offs = problem(n=256)
    pair = PAIRS[0]
    fused = scaled_ops.scaled_grouped_gemm_swiglu(a, gate_up, sa, pair[0], sw, pair[1], offs)
    assert h200.calls[-1]["kind"] == "swiglu" and h200.calls[-1]["b"].shape == (4, 256, 256)
    h200.swiglu_ok = False  # I the fused kernel does not take: the GEMM to fp32, then apart
    apart = scaled_ops.scaled_grouped_gemm_swiglu(a, gate_up, sa, pair[0], sw, pair[1], offs)
    assert h200.calls[-1]["kind"] == "gemm" and h200.calls[-1]["out_dtype"] == torch.float32
    assert torch.equal(fused, apart)


def test_validation_runs_before_any_kernel(h200):
    a, w, sa, sw, offs = problem()
    with pytest.raises(ValueError, match="^scale_a must have shape"):
        ts_moe.scaled_grouped_gemm(a, w.mT, sa[:, :1], *PAIRS[0][:1], sw, PAIRS[0][1], offs)
    with pytest.raises(TypeError, match="^a_index must be int32"):
        ts_moe.scaled_grouped_gemm(a, w.mT, sa, *PAIRS[0][:1], sw, PAIRS[0][1], offs,
                                   a_index=torch.arange(3))
    assert h200.calls == []


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
        out = scaled_ops.run_gemm(Fp8Path.TORCH_SCALED, "rowwise", a, w.mT, sa, "rowwise", sw,
                                  "rowwise", offs, BF16, a_index)
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
    out = scaled_ops.run_gemm(Fp8Path.DEQUANTIZE, RECIPE_PAIRS[pair], a, w.mT, sa, pair[0], sw,
                              pair[1], offs, out_dtype, a_index)
    assert out.dtype == out_dtype and out.shape == (30, 200)
    assert_rows_close(out, ref64(a, w, sa, pair[0], sw, pair[1], offs, a_index))
    h = scaled_ops.run_swiglu(Fp8Path.DEQUANTIZE, RECIPE_PAIRS[pair], a, w, sa, pair[0], sw,
                              pair[1], offs, out_dtype, a_index)
    ref = ref64(a, w, sa, pair[0], sw, pair[1], offs, a_index)
    assert_rows_close(h, torch.nn.functional.silu(ref[:, :100]) * ref[:, 100:])


class StandInQuantize:
    """csrc_free_kernels.quantize_fp8_sm90_launch's API: the reference's values, its
    scales contiguous (the op must put a 1x128 scale into the fast layout)."""

    def __init__(self):
        self.calls = []

    def quantize(self, x, recipe):
        assert x.dim() == 2 and x.stride(-1) == 1
        self.calls.append(recipe)
        return quantize_reference(x, recipe)


def test_quantize_kernel_where_it_applies(monkeypatch):
    kernels = StandInQuantize()
    monkeypatch.setattr(paths, "device_capability", lambda t: (9, 0))
    monkeypatch.setattr(paths, "quantize_kernels", lambda: kernels)
    x = torch.randn(37, 256).bfloat16()
    q, s = ts_moe.quantize_fp8(x.t().contiguous().t(), "blockwise_1x128")  # copied to rows
    assert kernels.calls == ["blockwise_1x128"] and s.stride() == (1, 40)
    rq, rs = quantize_reference(x, "blockwise_1x128")
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    ts_moe.quantize_fp8(x, "rowwise")
    ts_moe.quantize_fp8(x, "tensorwise")
    assert kernels.calls[1:] == ["rowwise", "tensorwise"]
    ts_moe.quantize_fp8(x[:, :200], "blockwise_1x128")  # K % 128: the reference
    ts_moe.quantize_fp8(x[:, :200], "rowwise")  # K % 16 == 8: the reference
    ts_moe.quantize_fp8(x.view(1, 37, 256), "rowwise")  # not 2-D
    ts_moe.quantize_fp8(x, "blockwise_128x128")  # a weight recipe
    ts_moe.quantize_fp8(x.double(), "rowwise")
    assert len(kernels.calls) == 3
    monkeypatch.setattr(paths, "device_capability", lambda t: (10, 0))
    ts_moe.quantize_fp8(x, "rowwise")
    assert len(kernels.calls) == 3


def test_reference_switch_read_at_each_call(monkeypatch):
    """TS_MOE_REFERENCE (ts_moe.settings.reference) is read at each call: a CUDA
    tensor's capability is None (the reference path) while it is on."""
    on_cuda = types.SimpleNamespace(device=torch.device("cuda", 0), get_device=lambda: 0)
    monkeypatch.setattr(paths, "_capability", lambda index: (9, 0))
    monkeypatch.delenv("TS_MOE_REFERENCE", raising=False)
    assert paths.device_capability(on_cuda) == (9, 0)
    monkeypatch.setenv("TS_MOE_REFERENCE", "1")
    assert paths.device_capability(on_cuda) is None
    monkeypatch.setenv("TS_MOE_REFERENCE", "0")
    assert paths.device_capability(on_cuda) == (9, 0)
    with ts_moe.settings.override(reference=True):  # code outranks the variable
        assert paths.device_capability(on_cuda) is None
    monkeypatch.setenv("TS_MOE_REFERENCE", "true")
    with pytest.raises(ValueError, match="TS_MOE_REFERENCE='true'"):
        paths.device_capability(on_cuda)
    monkeypatch.delenv("TS_MOE_REFERENCE")
    assert quantize.quantize_kernel_for(torch.ones(4, 128), "rowwise") is None  # CPU tensor


def test_stand_ins_speak_the_kernel_modules_api():
    """What the op layer calls on the sm_90 kernel modules exists there, as the stand-ins
    above take it (positional operands, then keywords)."""
    import inspect

    gemm = pytest.importorskip("csrc_free_kernels.grouped_gemm_fp8_sm90_launch")
    quant = pytest.importorskip("csrc_free_kernels.quantize_fp8_sm90_launch")
    for name in ("scaled_grouped_gemm", "scaled_grouped_gemm_swiglu"):
        params = inspect.signature(getattr(gemm, name)).parameters
        kinds = [p.kind for p in params.values()]
        assert kinds[:5] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 5
        for keyword in ("recipe", "out_dtype", "a_index", "out"):
            assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(gemm.swiglu_supported).parameters)[:2] == ["two_i", "recipe"]
    assert gemm.MAX_EXPERTS == StandInKernels.MAX_EXPERTS
    assert list(inspect.signature(quant.quantize).parameters) == ["x", "recipe"]
    assert set(kernels.sm90_fp8.__all__) >= {
        "scaled_grouped_gemm", "scaled_grouped_gemm_swiglu", "swiglu_supported"}


def test_the_fp8_kernels_are_opt_in():
    """Until they pass on a GPU, sm_90 FP8 calls take the kernels only after
    ts_moe.use_fp8_kernels() (bench/notes/2026-12-05-fp8-kernel-first-gpu-run.md)."""
    ts_moe.use_fp8_kernels(False)  # the default
    assert not paths.fp8_kernels_enabled()
    assert paths.gemm_kernels() is None and paths.quantize_kernels() is None
    ts_moe.use_fp8_kernels()
    try:
        assert paths.gemm_kernels() is kernels.sm90_fp8
        assert paths.quantize_kernels() is kernels.quantize_fp8_sm90
    finally:
        ts_moe.use_fp8_kernels(False)
    assert paths.gemm_kernels() is None
