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
from ts_moe.ops import backend, kernels, paths, reference_backend, torch_backend
from ts_moe.ops.backend import Op

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _all_backends():
    """(protocol, backend object) of every backend the path table holds."""
    unique = {id(b): (backend.PROTOCOLS[op], b) for table in paths.TABLE.values()
              for op, b in table.items()}  # a reference serves several paths
    return list(unique.values())


BACKENDS = _all_backends()


def _methods(family):
    return [name for name, member in vars(family).items()
            if inspect.isfunction(member) and not name.startswith("_")]


def test_the_kernels_are_available_here():
    """cutlass is installed here: every family the ops take loaded, and the kernel
    paths hold every op family their families serve (a family that fails is missing,
    and the paths take the next backend: test_kernel_families.py)."""
    assert kernels.AVAILABLE == {f.name for f in kernels.FAMILIES if f.in_ops}
    assert not kernels.FAILED
    for path, kernel in paths.KERNEL_PATHS.items():
        assert set(paths.TABLE[path]) == {op for f in kernel.families for op in f.serves}
    assert set(paths.TABLE[paths.Path.REFERENCE]) == set(Op)  # it takes every op family
    # the table holds the families' backends and the modules' own, nothing else
    own = [torch_backend.GROUPED_GEMM, torch_backend.GROUPED_GEMM_K,
           torch_backend.GROUPED_GEMM_SWIGLU, fp8_backends.TORCH_SCALED_GEMM,
           fp8_backends.TORCH_SCALED_SWIGLU, fp8_backends.DEQUANTIZE_GEMM,
           fp8_backends.DEQUANTIZE_SWIGLU, fp8_backends.REFERENCE_GEMM,
           fp8_backends.REFERENCE_SWIGLU, fp8_backends.REFERENCE_QUANTIZE,
           *reference_backend.BACKENDS.values()]
    families = [b for f in kernels.FAMILIES for b in kernels.LOADED[f.name].backends.values()]
    assert {id(b) for _, b in BACKENDS} == {id(b) for b in own + families}


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


def test_each_path_holds_the_backends_of_its_families():
    """The kernel paths hold each family's own backends (what its launch module serves);
    the others, the backends their modules name."""
    for family in kernels.FAMILIES:
        for op, impl in kernels.LOADED[family.name].backends.items():
            path = paths.kernel_path(family)
            assert paths.KERNEL_PATHS[path].capability == family.capability
            assert paths.TABLE[path][op] is impl and paths.PROVIDER[path, op] is family
    t = paths.TABLE
    assert t[paths.Path.TORCH_GROUPED_MM][Op.GROUPED_GEMM] is torch_backend.GROUPED_GEMM
    assert t[paths.Path.REFERENCE][Op.GROUPED_GEMM] is reference_backend.GROUPED_GEMM
    assert t[paths.Path.TORCH_SCALED][Op.SCALED_GROUPED_GEMM] is fp8_backends.TORCH_SCALED_GEMM
    assert t[paths.Path.DEQUANTIZE][Op.SCALED_GROUPED_GEMM] is fp8_backends.DEQUANTIZE_GEMM
    assert t[paths.Path.REFERENCE][Op.QUANTIZE_FP8] is fp8_backends.REFERENCE_QUANTIZE


@pytest.mark.parametrize("capability, dtype, want", [
    (None, "bfloat16", ["REFERENCE"]),
    ((9, 0), "bfloat16", ["KERNEL_SM90", "TORCH_GROUPED_MM"]),
    ((9, 0), "float16", ["KERNEL_SM90", "REFERENCE"]),
    ((9, 0), "float32", ["TORCH_GROUPED_MM"]),
    ((10, 0), "bfloat16", ["TORCH_GROUPED_MM"]),
    ((8, 0), "bfloat16", ["REFERENCE"]),
])
def test_the_paths_of_a_grouped_gemm(capability, dtype, want):
    import torch

    got = paths.paths_for(Op.GROUPED_GEMM, capability, getattr(torch, dtype), None, 8)
    assert [p.name for p in got] == want


def test_the_paths_of_the_fp8_ops_and_the_small_kernels():
    import torch

    from ts_moe.settings import settings

    assert paths.paths_for(Op.SCALED_GROUPED_GEMM, (9, 0)) == (
        paths.Path.KERNEL_SM90, paths.Path.TORCH_SCALED, paths.Path.DEQUANTIZE,
        paths.Path.REFERENCE)
    assert paths.paths_for(Op.QUANTIZE_FP8, (9, 0)) == (
        paths.Path.KERNEL_SM90, paths.Path.REFERENCE)
    with settings.override(fp8_kernels=False):
        assert paths.paths_for(Op.SCALED_GROUPED_GEMM, (9, 0)) == (
            paths.Path.TORCH_SCALED, paths.Path.DEQUANTIZE, paths.Path.REFERENCE)
        assert paths.paths_for(Op.QUANTIZE_FP8, (9, 0)) == (paths.Path.REFERENCE,)
    assert paths.paths_for(Op.SCALED_GROUPED_GEMM, (10, 0))[0] is paths.Path.DEQUANTIZE
    assert paths.paths_for(Op.ROW_SUM, (9, 0)) == (paths.Path.KERNEL_SM90, paths.Path.REFERENCE)
    assert paths.paths_for(Op.ROW_SUM, (10, 0)) == (paths.Path.REFERENCE,)
    assert paths.paths_for(Op.ROUTER_LOGITS, (9, 0)) == (paths.Path.REFERENCE,)  # opt-in
    with settings.override(fp8_kernels=True, router_kernel=True):
        assert paths.paths_for(Op.SCALED_GROUPED_GEMM, (9, 0))[0] is paths.Path.KERNEL_SM90
        assert paths.paths_for(Op.QUANTIZE_FP8, (9, 0))[0] is paths.Path.KERNEL_SM90
        assert paths.paths_for(Op.ROUTER_LOGITS, (9, 0))[0] is paths.Path.KERNEL_SM90
        assert paths.paths_for(Op.GROUPED_GEMM, (9, 0), torch.bfloat16)[0] is \
            paths.Path.KERNEL_SM90


def test_the_kernels_choose_from_shapes_the_references_take_everything():
    """choose_config runs without a GPU: a kernel declines what its tiles cannot
    take, saying why (the op then takes the next backend); a reference never declines."""
    import torch

    table = paths.TABLE[paths.Path.KERNEL_SM90]
    bf16 = torch.bfloat16
    a, offs = torch.empty(64, 256, dtype=bf16), torch.empty(8, dtype=torch.int32)
    gate_up, out = torch.empty(8, 2 * 48, 256, dtype=bf16), torch.empty(64, 48, dtype=bf16)
    declined = table[Op.GROUPED_GEMM_SWIGLU].choose_config(a, gate_up, offs, out, None)
    assert not declined and "I = 48" in declined.reason  # not whole tiles
    k_a, k_b = torch.empty(60, 64, dtype=bf16).t().t(), torch.empty(64, 32, dtype=bf16)
    declined = table[Op.GROUPED_GEMM_K].choose_config(k_a, k_b, offs,
                                                      torch.empty(8, 60, 32, dtype=bf16))
    assert not declined and "K = 60" in declined.reason
    for impl in (reference_backend.GROUPED_GEMM_SWIGLU, torch_backend.GROUPED_GEMM_SWIGLU):
        assert impl.choose_config(a, gate_up, offs, out, None)
    # the row kernel's gather is a config of its own, never a falsy one
    rows = torch.empty(4, 64, dtype=bf16)
    assert table[Op.ROW_SUM].choose_config(rows, torch.zeros(4, dtype=torch.int64), None)
    # FP8: a decline is falsy and says why; the fallbacks take every call
    from ts_moe.fp8.recipes import Pair

    e4m3 = torch.float8_e4m3fn
    a8, w8 = torch.empty(64, 256, dtype=e4m3), torch.empty(600, 256, 256, dtype=e4m3)
    sa, sb = torch.empty(64), torch.empty(600, 256)
    offs8, out8 = torch.empty(600, dtype=torch.int32), torch.empty(64, 256, dtype=bf16)
    call = (a8, w8.mT, sa, sb, offs8, out8, None, Pair.ROWWISE)
    declined = table[Op.SCALED_GROUPED_GEMM].choose_config(*call)
    assert not declined and isinstance(declined, kernels.Declined)
    assert "600 experts" in declined.reason
    assert table[Op.SCALED_GROUPED_GEMM].choose_config(a8, w8[:8].mT, sa, sb[:8], offs8[:8],
                                                       out8, None, Pair.ROWWISE)
    for impl in (fp8_backends.DEQUANTIZE_GEMM, fp8_backends.REFERENCE_GEMM):
        assert impl.choose_config(*call)


def test_ops_import_their_backends_statically():
    """No module looked up by a string anywhere in ts_moe; the ops import the kernel
    families in one place (ts_moe/ops/kernels.py, through the records; the command line
    the families' builds, the PTX tool and the kernel cache's rules; ts_moe/settings.py
    the kernels' settings; ts_moe/toolchain.py the installed DSL flavour;
    ts_moe/publish.py the kernel cache's rules of a trusted path), and nothing below
    ts_moe imports it back."""
    sources = {p: p.read_text() for p in (ROOT / "ts_moe").rglob("*.py")}
    for path, text in sources.items():
        assert not re.search(r"import_module|__import__", text), path
    importers = {p.relative_to(ROOT).as_posix() for p, text in sources.items()
                 if re.search(r"^\s*(from|import) csrc_free_kernels", text, re.M)}
    assert importers - {"ts_moe/compile_cli.py", "ts_moe/cache_cli.py", "ts_moe/settings.py",
                         "ts_moe/toolchain.py", "ts_moe/publish.py"} == {
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
        "from ts_moe.ops import Op, kernels, paths\n"
        "said = [str(w.message) for w in caught if w.category is kernels.KernelImportWarning]\n"
        "assert len(said) == 1 and 'nvidia-cutlass-dsl' in said[0], said\n"
        "assert not kernels.AVAILABLE and not kernels.LOADED\n"
        "assert not paths.TABLE[paths.Path.KERNEL_SM90] and not paths.PROVIDER\n"
        "bf16, f16 = torch.bfloat16, torch.float16\n"
        "assert paths.paths_for(Op.GROUPED_GEMM, (9, 0), bf16)[0] is paths.Path.TORCH_GROUPED_MM\n"
        "assert paths.paths_for(Op.GROUPED_GEMM, (9, 0), f16) == (paths.Path.REFERENCE,)\n"
        "assert paths.paths_for(Op.ROW_SUM, (9, 0)) == (paths.Path.REFERENCE,)\n"
        "a, b = torch.randn(6, 8), torch.randn(2, 8, 4)\n"
        "out = ts_moe.grouped_gemm(a, b, torch.tensor([2, 5], dtype=torch.int32))\n"
        "assert torch.allclose(out[:2], a[:2] @ b[0]) and (out[5:] == 0).all()\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.strip() == "ok", done.stderr
