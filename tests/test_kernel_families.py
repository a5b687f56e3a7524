"""Kernel families: each imported under its own guard (a family that fails to import is
off, with one warning naming it, and every other family stays on), each with its
status declared once (ts_moe.ops.kernel_status), and ``python -m ts_moe info``
printing that status beside whether it imported and the path this machine gets."""

import json
import pathlib
import subprocess
import sys

import pytest

import ts_moe
from ts_moe import info_cli
from ts_moe.ops import kernel_status as ks
from ts_moe.ops import kernels

ROOT = pathlib.Path(__file__).resolve().parent.parent

# a process in which importing one kernel module fails, then what ts_moe made of it
BROKEN = """
import importlib.abc, json, sys, warnings

BROKEN, HOW = sys.argv[1], sys.argv[2]
if HOW == "missing":
    sys.modules[BROKEN] = None  # import -> ImportError
else:
    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == BROKEN:
                raise RuntimeError("a bug at import")
    sys.meta_path.insert(0, Refuse())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch, ts_moe
from ts_moe.ops import backend, kernels, paths
from ts_moe.fp8 import paths as fp8_paths
from ts_moe import info_cli

torch.cuda.get_device_capability = lambda index=None: (9, 0)  # an H200, as the paths see it
ts_moe.use_fp8_kernels()
ts_moe.use_router_kernel()
rows = {line.split()[0]: line for line in info_cli.lines("H200", (9, 0))[3:12]}
print(json.dumps({
    "warnings": [str(w.message) for w in caught if w.category is kernels.KernelImportWarning],
    "available": sorted(kernels.AVAILABLE),
    "failed": kernels.FAILED,
    "bf16_path": paths.cuda_path(0, torch.bfloat16)[0].name,
    "gemm_k": type(paths.PATH_BACKENDS[paths.Path.KERNEL_SM90].gemm_k).__name__,
    "device": [type(b).__module__ + "." + type(b).__name__ for b in paths.SM90_DEVICE],
    "fp8_kernels": not isinstance(fp8_paths.KERNEL_SM90.gemm, backend.NoKernel),
    "quantize_kernels": not isinstance(fp8_paths.KERNEL_SM90.quantize, backend.NoKernel),
    "info": rows,
}))
"""


def _break(module: str, how: str) -> dict:
    done = subprocess.run([sys.executable, "-c", BROKEN, module, how], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_broken_fp8_family_leaves_the_bf16_kernels_on():
    got = _break("csrc_free_kernels.fp8.grouped_gemm_fp8_sm90_launch", "missing")
    (warning,) = got["warnings"]
    assert warning.startswith("ts_moe: the gemm_fp8_sm90 kernels (FP8 (e4m3) grouped GEMM")
    assert ("importing csrc_free_kernels.fp8.grouped_gemm_fp8_sm90_launch raised ModuleNotFoundError: "
            "import of csrc_free_kernels.fp8.grouped_gemm_fp8_sm90_launch halted") in warning
    assert list(got["failed"]) == ["gemm_fp8_sm90"]
    assert set(got["available"]) == {f.name for f in ks.STATUS if f.in_ops} - {"gemm_fp8_sm90"}
    assert got["bf16_path"] == "KERNEL_SM90" and got["gemm_k"] == "GroupedGemmKBackend"
    assert not got["fp8_kernels"] and got["quantize_kernels"]  # the quantizer imported
    assert "  no  " in got["info"]["gemm_fp8_sm90"]
    assert got["info"]["gemm_fp8_sm90"].endswith("(its import failed)")
    assert got["info"]["gemm_sm90"].endswith("its kernels")
    assert got["info"]["quantize_fp8_sm90"].endswith("its kernels")


def test_a_family_that_raises_at_import_is_off_alone():
    """Not only ImportError: any exception of a family's import turns that family off."""
    got = _break("csrc_free_kernels.routing.router_sm90_launch", "raise")
    (warning,) = got["warnings"]
    assert "the router_sm90 kernels" in warning and "RuntimeError: a bug at import" in warning
    assert got["failed"] == {"router_sm90": "RuntimeError: a bug at import"}
    assert got["bf16_path"] == "KERNEL_SM90"
    route = "csrc_free_kernels.routing.route_sm90_launch"
    assert got["device"] == [f"{route}.RouteSlotsBackend", "ts_moe.ops.backend.NoKernel",
                             f"{route}.SortSlotsBackend", f"{route}.RowSumBackend",
                             "ts_moe.ops.backend.NoKernel",
                             "csrc_free_kernels.hopper.swiglu_sm90_launch.SwigluActivationBackend"]
    assert got["fp8_kernels"] and got["info"]["route_sm90"].endswith("its kernels")
    assert got["info"]["router_sm90"].endswith(
        "F.linear and the one-CTA routing (its import failed)")


def test_a_broken_dw_family_sends_the_weight_gradient_elsewhere():
    got = _break("csrc_free_kernels.hopper.grouped_gemm_dw_sm90_launch", "missing")
    assert [w.split(" kernels")[0] for w in got["warnings"]] == ["ts_moe: the gemm_dw_sm90"]
    assert got["bf16_path"] == "KERNEL_SM90" and got["gemm_k"] == "NoKernel"
    assert got["info"]["gemm_dw_sm90"].endswith("torch._grouped_mm (its import failed)")


def test_here_every_family_imported():
    assert kernels.AVAILABLE == {f.name for f in ks.STATUS if f.in_ops} and not kernels.FAILED


def test_each_family_declares_its_status_and_unproven_ones_are_off_by_default():
    names = [f.name for f in ks.STATUS]
    assert len(set(names)) == len(names) and ks.BY_NAME.keys() == set(names)
    for f in ks.STATUS:
        assert (ROOT / "csrc_free_kernels" / f"{f.module.replace('.', '/')}.py").is_file(), f.module
        if f.proof is ks.Proof.VERIFIED:
            assert f.run is not None and len(f.run.commit) >= 7 and f.run.device
        else:  # never on by default
            assert f.setting is not None or not f.in_ops, f.name
        if f.setting:
            spec = next(s for s in ts_moe.settings.SETTINGS if s.name == f.setting)
            assert spec.default is False, f.name
    assert ks.GEMM_SM90.proof is ks.Proof.VERIFIED and ks.GEMM_SM90.run.commit == "7b4d93b"
    assert ks.GEMM_FP8_SM90.proof is ks.Proof.FAULTED and ks.GEMM_FP8_SM90.run.commit == "04b71cd"
    assert ks.GEMM_SM100.proof is ks.Proof.COMPILED
    assert {ks.ROUTER_SM90.proof, ks.STORE_WARP_SM90.proof} == {ks.Proof.AWAITING_AB}


def test_info_on_this_cpu_machine(cpu_machine, capsys):
    from ts_moe import __main__ as cli

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "device: no CUDA GPU: every call takes the plain-torch reference"
    header = out[2].split()
    assert header[:3] == ["family", "status", "imported"]
    rows = {line.split()[0]: line for line in out[3:3 + len(ks.STATUS)]}
    assert list(rows) == [f.name for f in ks.STATUS]
    for f in ks.STATUS:
        row = rows[f.name]
        assert f.proof.value in row and f.switch in row
        if f.in_ops:
            assert row.endswith("the plain-torch reference (no CUDA GPU)")
            assert f"  yes  " in row
        else:
            assert row.endswith("none: no path of the ops takes it")
    assert "      run: NVIDIA H200, 7b4d93b, 2026-12-05: 515 GPU tests passed" in out
    assert "  router_kernel = False  (default)" in out


@pytest.mark.parametrize("capability, family, path", [
    ((9, 0), ks.GEMM_SM90, "its kernels"),
    ((9, 0), ks.ROUTER_SM90, "F.linear and the one-CTA routing "
                             "(ts_moe.settings.router_kernel is off)"),
    ((9, 0), ks.GEMM_FP8_SM90, "torch._scaled_grouped_mm (rowwise, sm_90), or dequantized to "
                               "bf16, then ts_moe.grouped_gemm (ts_moe.settings.fp8_kernels is off)"),
    ((9, 0), ks.GEMM_SM100, "none: sm_100a kernels, for capability 10.0 only"),
    ((10, 0), ks.GEMM_SM100, "torch._grouped_mm (ts_moe.settings.sm100_kernel is off)"),
    ((10, 0), ks.GEMM_SM90, "none: sm_90a kernels, for capability 9.0 only"),
    ((9, 0), ks.STORE_WARP_SM90, "none: no path of the ops takes it"),
])
def test_info_gives_each_gpu_its_path(capability, family, path):
    assert info_cli.family_path(family, capability) == path


def test_info_follows_the_settings(monkeypatch):
    with ts_moe.settings.override(fp8_kernels=True, router_kernel=True, sm100_kernel=True):
        for f in (ks.GEMM_FP8_SM90, ks.QUANTIZE_FP8_SM90, ks.ROUTER_SM90):
            assert info_cli.family_path(f, (9, 0)) == "its kernels"
        assert info_cli.family_path(ks.GEMM_SM100, (10, 0)) == "its kernels"
    monkeypatch.setenv("TS_MOE_REFERENCE", "1")
    assert info_cli.family_path(ks.GEMM_SM90, (9, 0)) == \
        "the plain-torch reference (ts_moe.settings.reference is on)"
    monkeypatch.setenv("TS_MOE_REFERENCE", "on")
    assert info_cli.run() == 2


def test_every_family_has_a_path_rule():
    for capability in ((9, 0), (10, 0), (8, 0), None):
        for f in ks.STATUS:
            assert info_cli.family_path(f, capability)


def test_the_wheel_holds_no_test_kernels():
    """The installed packages (pyproject's package list) hold no test or probe module:
    the probes are tests/kernels/, which is not installed."""
    import tomllib

    from setuptools import find_packages

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(str(ROOT), include=include)
    assert set(packages) == {"ts_moe", "ts_moe.ops", "ts_moe.fp8", "ts_moe.integrations",
                             "ts_pipeline", "csrc_free_kernels",
                             *(f"csrc_free_kernels.{sub}" for sub in (
                                 "common", "hopper", "fp8", "routing", "sm100", "preflight"))}
    modules = [p.stem for pkg in packages for p in (ROOT / pkg.replace(".", "/")).glob("*.py")]
    assert not [m for m in modules if "probe" in m or m.startswith("test")]
    assert (ROOT / "tests" / "kernels" / "pipeline_probe_sm90.py").is_file()
