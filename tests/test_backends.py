"""The op layer's map, checked: every backend of an op family offers the
family's entry points with the family's signatures (ts_moe.ops.backend), each
path's backends are the ones its docstring names, data flows down through
static imports (no module looked up by name), and no module of ts_moe
outgrows one job."""

import inspect
import pathlib
import re

import pytest

from ts_moe.fp8 import backends as fp8_backends
from ts_moe.fp8 import paths as fp8_paths
from ts_moe.ops import backend, kernel_status, kernels, paths, reference_backend, torch_backend

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _all_backends():
    """(family, backend object, where) of every backend the paths can choose."""
    found = []
    for gemms in paths.PATH_BACKENDS.values():
        found += zip((backend.GroupedGemm, backend.GroupedGemmK, backend.GroupedGemmSwiglu),
                     gemms)
    for device in (paths.REFERENCE_DEVICE, paths.SM90_DEVICE):
        found += zip((backend.RouteSlots, backend.RouteTopK, backend.SortSlots, backend.RowSum,
                      backend.RouterLogits, backend.SwigluActivation), device)
    for fp8 in fp8_paths.PATH_BACKENDS.values():
        found += zip((backend.ScaledGroupedGemm, backend.ScaledGroupedGemmSwiglu,
                      backend.QuantizeFp8), fp8[1:])
    unique = {id(b): (family, b) for family, b in found}  # a reference serves several paths
    return [(family, b) for family, b in unique.values() if not isinstance(b, backend.NoKernel)]


BACKENDS = _all_backends()


def _methods(family):
    return [name for name, member in vars(family).items()
            if inspect.isfunction(member) and not name.startswith("_")]


def test_the_kernels_are_available_here():
    """cutlass is installed here: every family the ops take imported and every kernel
    path has its backends (a family that fails is None in kernels.py, and the
    paths take the next backend: test_kernel_families.py)."""
    assert kernels.AVAILABLE == {f.name for f in kernel_status.STATUS if f.in_ops}
    assert not kernels.FAILED
    assert set(paths.PATH_BACKENDS) == set(paths.Path)
    assert set(fp8_paths.PATH_BACKENDS) == set(fp8_paths.Fp8Path)
    # bf16: 3 GEMMs per path (sm_100 has no k-grouped one), 6 small kernels twice;
    # FP8: a GEMM and a SwiGLU GEMM per path, the kernel's quantizer and the reference's
    assert len(BACKENDS) == 3 * 4 - 1 + 2 * 6 + 2 * 4 + 2


@pytest.mark.parametrize("family, impl", BACKENDS,
                         ids=[f"{f.__name__}-{type(b).__module__}" for f, b in BACKENDS])
def test_every_backend_has_its_familys_signatures(family, impl):
    def shape(fn):  # names, kinds and defaults (the implementations leave out the types)
        return [(n, p.kind, p.default) for n, p in inspect.signature(fn).parameters.items()]

    for name in _methods(family):
        got, want = getattr(type(impl), name), getattr(family, name)
        assert shape(got) == shape(want), \
            f"{type(impl).__module__}.{type(impl).__name__}.{name}: {shape(got)} != {shape(want)}"
    if "gathers" in family.__annotations__:
        assert isinstance(impl.gathers, bool)


def test_each_path_runs_the_backends_it_names():
    from csrc_free_kernels.hopper import grouped_gemm_dw_sm90_launch, grouped_gemm_sm90_launch, swiglu_sm90_launch
    from csrc_free_kernels.routing import route_sm90_launch, router_sm90_launch
    from csrc_free_kernels.sm100 import grouped_gemm_sm100_launch

    p = paths.PATH_BACKENDS
    assert p[paths.Path.KERNEL_SM90] == (grouped_gemm_sm90_launch.GROUPED_GEMM,
                                         grouped_gemm_dw_sm90_launch.GROUPED_GEMM_K,
                                         grouped_gemm_sm90_launch.GROUPED_GEMM_SWIGLU)
    assert p[paths.Path.KERNEL_SM100].gemm is grouped_gemm_sm100_launch.GROUPED_GEMM
    assert p[paths.Path.KERNEL_SM100].swiglu is grouped_gemm_sm100_launch.GROUPED_GEMM_SWIGLU
    assert p[paths.Path.TORCH_GROUPED_MM].gemm is torch_backend.GROUPED_GEMM
    assert p[paths.Path.REFERENCE].gemm is reference_backend.GROUPED_GEMM
    assert paths.SM90_DEVICE == (route_sm90_launch.ROUTE_SLOTS, router_sm90_launch.ROUTE_TOPK,
                                 route_sm90_launch.SORT_SLOTS, route_sm90_launch.ROW_SUM,
                                 router_sm90_launch.ROUTER_LOGITS,
                                 swiglu_sm90_launch.SWIGLU_ACTIVATION)


def test_each_fp8_path_runs_the_backends_it_names():
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_launch, quantize_fp8_sm90_launch

    p = fp8_paths.PATH_BACKENDS
    assert p[fp8_paths.Fp8Path.KERNEL_SM90][1:] == (
        grouped_gemm_fp8_sm90_launch.GROUPED_GEMM, grouped_gemm_fp8_sm90_launch.GROUPED_GEMM_SWIGLU,
        quantize_fp8_sm90_launch.QUANTIZE)
    assert p[fp8_paths.Fp8Path.TORCH_SCALED][1:] == (
        fp8_backends.TORCH_SCALED_GEMM, fp8_backends.TORCH_SCALED_SWIGLU,
        fp8_backends.REFERENCE_QUANTIZE)
    assert p[fp8_paths.Fp8Path.DEQUANTIZE].gemm is fp8_backends.DEQUANTIZE_GEMM
    assert p[fp8_paths.Fp8Path.REFERENCE].swiglu is fp8_backends.REFERENCE_SWIGLU
    for family in (backend.ScaledGroupedGemm, backend.ScaledGroupedGemmSwiglu,
                   backend.QuantizeFp8):
        assert family in backend.FAMILIES


def test_the_kernels_choose_from_shapes_the_references_take_everything():
    """choose_config runs without a GPU: a kernel declines what its tiles cannot
    take (the op then takes the next backend); a reference never declines."""
    import torch

    from csrc_free_kernels.hopper import grouped_gemm_dw_sm90_launch, grouped_gemm_sm90_launch

    bf16 = torch.bfloat16
    a, offs = torch.empty(64, 256, dtype=bf16), torch.empty(8, dtype=torch.int32)
    gate_up, out = torch.empty(8, 2 * 48, 256, dtype=bf16), torch.empty(64, 48, dtype=bf16)
    assert grouped_gemm_sm90_launch.GROUPED_GEMM_SWIGLU.choose_config(
        a, gate_up, offs, out, None) is None  # I = 48: not whole tiles
    k_a, k_b = torch.empty(60, 64, dtype=bf16).t().t(), torch.empty(64, 32, dtype=bf16)
    assert grouped_gemm_dw_sm90_launch.GROUPED_GEMM_K.choose_config(
        k_a, k_b, offs, torch.empty(8, 60, 32, dtype=bf16)) is None  # K = 60
    for impl in (reference_backend.GROUPED_GEMM_SWIGLU, torch_backend.GROUPED_GEMM_SWIGLU):
        assert impl.choose_config(a, gate_up, offs, out, None) is not None
    # FP8: a decline is falsy and says why; the fallbacks take every call
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_launch as fp8

    from ts_moe.fp8.recipes import Pair

    e4m3 = torch.float8_e4m3fn
    a8, w8 = torch.empty(64, 256, dtype=e4m3), torch.empty(600, 256, 256, dtype=e4m3)
    sa, sb = torch.empty(64), torch.empty(600, 256)
    offs8, out8 = torch.empty(600, dtype=torch.int32), torch.empty(64, 256, dtype=bf16)
    call = (a8, w8.mT, sa, sb, offs8, out8, None, Pair.ROWWISE)
    declined = fp8.GROUPED_GEMM.choose_config(*call)
    assert not declined and isinstance(declined, kernels.Declined)
    assert "600 experts" in declined.reason
    assert fp8.GROUPED_GEMM.choose_config(a8, w8[:8].mT, sa, sb[:8], offs8[:8], out8, None,
                                          Pair.ROWWISE)
    for impl in (fp8_backends.DEQUANTIZE_GEMM, fp8_backends.REFERENCE_GEMM):
        assert impl.choose_config(*call)


def test_ops_import_their_backends_statically():
    """No module looked up by a string anywhere in ts_moe; the ops import
    csrc_free_kernels in one place (ts_moe/ops/kernels.py; the command line
    imports its PTX tool and the kernel cache's rules, ts_moe/settings.py the
    kernels' settings), and nothing below ts_moe imports it back."""
    sources = {p: p.read_text() for p in (ROOT / "ts_moe").rglob("*.py")}
    for path, text in sources.items():
        assert not re.search(r"import_module|__import__", text), path
    importers = {p.relative_to(ROOT).as_posix() for p, text in sources.items()
                 if re.search(r"^\s*(from|import) csrc_free_kernels", text, re.M)}
    assert importers - {"ts_moe/__main__.py", "ts_moe/cache_cli.py", "ts_moe/settings.py"} == {
        "ts_moe/ops/kernels.py"}
    for path in list((ROOT / "csrc_free_kernels").rglob("*.py")) + \
            list((ROOT / "ts_pipeline").rglob("*.py")):
        assert not re.search(r"^\s*(from|import) ts_moe", path.read_text(), re.M), path


def test_the_layer_forward_lives_below_the_decode_graphs():
    """decode_graphs captures the functions of ts_moe.block, which the layer hands
    it; neither module imports the layer (ts_moe.moe)."""
    for name in ("decode_graphs.py", "block.py"):
        text = (ROOT / "ts_moe" / name).read_text()
        assert not re.search(r"^\s*from \.(moe|\.moe) import|^\s*from \. import .*\bmoe\b",
                             text, re.M), name


def test_no_module_of_ts_moe_outgrows_one_job():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
             for p in (ROOT / "ts_moe").rglob("*.py")}
    assert max(sizes.values()) <= 500, {p: n for p, n in sizes.items() if n > 500}


def test_without_cutlass_the_kernel_paths_are_unavailable():
    """In a process where ``import cutlass`` fails, ts_moe imports, no path offers
    the kernels (an H200 takes torch's grouped_mm), and the ops run."""
    import subprocess
    import sys

    code = (
        "import sys, warnings\n"
        "sys.modules['cutlass'] = None  # import cutlass -> ImportError\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import torch, ts_moe\n"
        "from ts_moe.ops import backend, kernels, paths\n"
        "said = [str(w.message) for w in caught if w.category is kernels.KernelImportWarning]\n"
        "assert len(said) == 1 and 'nvidia-cutlass-dsl' in said[0], said\n"
        "assert not kernels.AVAILABLE and kernels.sm90 is None and kernels.sm90_fp8 is None\n"
        "assert set(paths.PATH_BACKENDS) == {paths.Path.TORCH_GROUPED_MM, paths.Path.REFERENCE}\n"
        "assert all(isinstance(b, backend.NoKernel) for b in paths.SM90_DEVICE)\n"
        "assert not paths.KERNEL_MAX_EXPERTS\n"
        "torch.cuda.get_device_capability = lambda index=None: (9, 0)\n"
        "assert paths.cuda_path(0, torch.bfloat16)[0] is paths.Path.TORCH_GROUPED_MM\n"
        "assert paths.cuda_path(0, torch.float16)[0] is paths.Path.REFERENCE\n"
        "a, b = torch.randn(6, 8), torch.randn(2, 8, 4)\n"
        "out = ts_moe.grouped_gemm(a, b, torch.tensor([2, 5], dtype=torch.int32))\n"
        "assert torch.allclose(out[:2], a[:2] @ b[0]) and (out[5:] == 0).all()\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.strip() == "ok", done.stderr
