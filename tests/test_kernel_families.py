"""Kernel families: each declared once, in its package's record
(``csrc_free_kernels.<package>.__init__``, listed by ``csrc_free_kernels.families``),
each loaded under its own guard (a family that fails to load is off, with one warning
naming it, and every other family stays on), and everything else derived from the
records: the path table, ``python -m ts_moe info``, ``compile``, the PTX builds."""

import json
import pathlib
import subprocess
import sys

import pytest

import ts_moe
from csrc_free_kernels.families import BY_NAME, FAMILIES
from csrc_free_kernels.common.family import Proof
from ts_moe import info_cli
from ts_moe.ops import Op, kernels, paths

from .helpers import kernel_package

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
from ts_moe.ops import Op, kernels, paths
from ts_moe import info_cli
from csrc_free_kernels.families import FAMILIES

ts_moe.use_fp8_kernels()
ts_moe.use_router_kernel()
rows = {line.split()[0]: line for line in info_cli.lines("H200", (9, 0))[3:3 + len(FAMILIES)]}
print(json.dumps({
    "warnings": [str(w.message) for w in caught if w.category is kernels.KernelImportWarning],
    "available": sorted(kernels.AVAILABLE),
    "failed": kernels.FAILED,
    "bf16": [p.name for p in paths.paths_for(Op.GROUPED_GEMM, (9, 0), torch.bfloat16)],
    "gemm_k": [p.name for p in paths.paths_for(Op.GROUPED_GEMM_K, (9, 0), torch.bfloat16)],
    "row_sum": [p.name for p in paths.paths_for(Op.ROW_SUM, (9, 0))],
    "sm90": sorted(op.value for op in paths.TABLE[paths.Path.KERNEL_SM90]),
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
    assert ("loading csrc_free_kernels.fp8 raised ModuleNotFoundError: "
            "import of csrc_free_kernels.fp8.grouped_gemm_fp8_sm90_launch halted") in warning
    assert list(got["failed"]) == ["gemm_fp8_sm90"]
    assert set(got["available"]) == {f.name for f in FAMILIES if f.in_ops} - {"gemm_fp8_sm90"}
    assert got["bf16"][0] == "KERNEL_SM90" and got["gemm_k"][0] == "KERNEL_SM90"
    assert "scaled_grouped_gemm" not in got["sm90"] and "quantize_fp8" in got["sm90"]
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
    assert got["bf16"][0] == "KERNEL_SM90"
    assert {"route_slots", "sort_slots", "row_sum", "swiglu_activation"} <= set(got["sm90"])
    assert not {"router_logits", "route_topk"} & set(got["sm90"])
    assert got["info"]["route_sm90"].endswith("its kernels")
    assert got["info"]["router_sm90"].endswith(
        f"{paths.Path.REFERENCE.value} (its import failed)")


def test_a_broken_dw_family_sends_the_weight_gradient_elsewhere():
    got = _break("csrc_free_kernels.hopper.grouped_gemm_dw_sm90_launch", "missing")
    assert [w.split(" kernels")[0] for w in got["warnings"]] == ["ts_moe: the gemm_dw_sm90"]
    assert got["bf16"][0] == "KERNEL_SM90" and got["gemm_k"] == ["TORCH_GROUPED_MM"]
    assert got["info"]["gemm_dw_sm90"].endswith("torch._grouped_mm (its import failed)")


def test_a_broken_gemm_family_leaves_the_small_kernels_on():
    """Each family's path follows its own record: without the bf16 GEMM kernels, the
    routing, combine and activation kernels still take their calls."""
    got = _break("csrc_free_kernels.hopper.grouped_gemm_sm90_launch", "missing")
    assert [w.split(" kernels")[0] for w in got["warnings"]] == ["ts_moe: the gemm_sm90"]
    assert got["bf16"] == ["TORCH_GROUPED_MM"] and got["gemm_k"][0] == "KERNEL_SM90"
    assert got["row_sum"] == ["KERNEL_SM90", "REFERENCE"]
    assert got["info"]["gemm_sm90"].endswith("torch._grouped_mm (its import failed)")
    for family in ("route_sm90", "swiglu_sm90", "combine_grad_sm90"):
        assert got["info"][family].endswith("its kernels"), family


def test_here_every_family_loaded():
    assert kernels.AVAILABLE == {f.name for f in FAMILIES if f.in_ops} and not kernels.FAILED
    assert set(kernels.LOADED) == set(BY_NAME)


def test_each_family_declares_its_status_and_unproven_ones_are_off_by_default():
    names = [f.name for f in FAMILIES]
    assert len(set(names)) == len(names) and BY_NAME.keys() == set(names)
    for f in FAMILIES:
        loaded = kernels.LOADED[f.name]
        assert set(loaded.backends) == set(f.serves), f.name  # the record says what it serves
        spec = next((s for s in ts_moe.settings.SETTINGS if s.name == f.setting), None)
        if f.proof is Proof.VERIFIED:
            assert f.run is not None and len(f.run.commit) >= 7 and f.run.device
        else:  # never on by default
            assert f.setting is not None or not f.in_ops, f.name
            assert spec.default is False, f.name
    assert BY_NAME["gemm_sm90"].proof is Proof.VERIFIED
    assert BY_NAME["gemm_sm100"].proof is Proof.COMPILED


def test_every_build_of_a_family_is_named_once_and_keyed_as_a_call_compiles_it():
    """A family's build space is the run-time compile's key space: a call's compiled
    kernel is the build of the same key."""
    seen = {}
    for f in FAMILIES:
        for b in kernels.LOADED[f.name].builds():
            assert b.name not in seen, (b.name, seen.get(b.name))
            seen[b.name] = b.key
    assert len(set(seen.values())) == len(seen)
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as c
    from csrc_free_kernels.hopper import grouped_gemm_sm90_launch as g

    import torch

    key = g.build(c.DECODE16, torch.bfloat16, None, False, prefetch_weights=True).key
    assert seen["gemm_decode16_bk_prefetch"] == key


def test_info_on_this_cpu_machine(cpu_machine, capsys):
    from ts_moe import __main__ as cli

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "device: no CUDA GPU: every call takes the plain-torch reference"
    header = out[2].split()
    assert header[:3] == ["family", "status", "imported"]
    rows = {line.split()[0]: line for line in out[3:3 + len(FAMILIES)]}
    assert list(rows) == [f.name for f in FAMILIES]
    for f in FAMILIES:
        row = rows[f.name]
        assert f.proof.value in row and info_cli.turned_on(f) in row and "  yes  " in row
        assert row.endswith(f"{paths.Path.REFERENCE.value} (no CUDA GPU)")
    assert f"      run: {BY_NAME['gemm_sm90'].run}" in out
    assert "  router_kernel = False  (default)" in out


@pytest.mark.parametrize("capability, family, path", [
    ((9, 0), "gemm_sm90", "its kernels"),
    ((9, 0), "route_sm90", "its kernels"),
    ((9, 0), "router_sm90", f"{paths.Path.REFERENCE.value} "
                            "(ts_moe.settings.router_kernel is off)"),
    ((9, 0), "gemm_fp8_sm90", "its kernels"),
    ((9, 0), "quantize_fp8_sm90", "its kernels"),
    ((9, 0), "gemm_sm100", "none: sm_100a kernels, for capability 10.0 only"),
    ((10, 0), "gemm_sm100", "torch._grouped_mm (ts_moe.settings.sm100_kernel is off)"),
    ((10, 0), "gemm_sm90", "none: sm_90a kernels, for capability 9.0 only"),
])
def test_info_gives_each_gpu_its_path(capability, family, path):
    assert info_cli.family_path(BY_NAME[family], capability) == path


def test_info_follows_the_settings(monkeypatch):
    with ts_moe.settings.override(fp8_kernels=True, router_kernel=True, sm100_kernel=True):
        for f in ("gemm_fp8_sm90", "quantize_fp8_sm90", "router_sm90"):
            assert info_cli.family_path(BY_NAME[f], (9, 0)) == "its kernels"
        assert info_cli.family_path(BY_NAME["gemm_sm100"], (10, 0)) == "its kernels"
    monkeypatch.setenv("TS_MOE_REFERENCE", "1")
    assert info_cli.family_path(BY_NAME["gemm_sm90"], (9, 0)) == \
        f"{paths.Path.REFERENCE.value} (ts_moe.settings.reference is on)"
    monkeypatch.setenv("TS_MOE_REFERENCE", "on")
    assert info_cli.run() == 2


# A throwaway family: its package (a record and a launch module, the kernel borrowed from
# the SwiGLU family) and its import line, nothing else; it serves the combine first (its
# precedence above the routing family's).
TOY_RECORD = '''
from ..common.family import Family, Op, Proof


def _load():
    from . import toy_launch
    return toy_launch.KERNELS


TOY = Family("toy_sm90", "a throwaway family", "sm_90a", Proof.COMPILED, "a test's",
             _load, serves=(Op.ROW_SUM,), precedence=1)
'''
TOY_LAUNCH = '''
import torch

from ..common.family import Build, Kernels, Op
from ..common.kernel_config import Declined
from ..hopper.swiglu_sm90_launch import build as swiglu_build


class Toy:
    def choose_config(self, src, index, weights):
        return Declined("a toy takes no call")

    def run(self, src, index, weights, config):
        raise AssertionError


def builds():
    b = swiglu_build(torch.bfloat16, False)
    yield Build("toy_fwd", ("toy", *b.key), b.make, {})


KERNELS = Kernels(backends={Op.ROW_SUM: Toy()}, builds=builds)
'''
TOY_CHECK = """
import json, sys
from csrc_free_kernels import ptx_dump
from csrc_free_kernels.families import FAMILIES
from ts_moe import compile_cli, info_cli
from ts_moe.ops import Op, kernels, paths
lines = info_cli.lines("H200", (9, 0))
print(json.dumps({
    "first": FAMILIES[0].name,
    "row_sum": type(paths.backends(Op.ROW_SUM, (9, 0))[0]).__name__,
    "info": [line for line in lines if line.startswith("toy_sm90")],
    "ptx": "toy_fwd" in ptx_dump.BUILDS,
    "compile": [b.name for f, bs in compile_cli.builds("sm_90a") if f.name == "toy_sm90"
                for b in bs],
}))
"""


def test_a_new_family_is_its_package_and_one_import_line(tmp_path):
    """Adding a family touches its own modules and ``families.py`` alone: info, compile,
    the PTX builds and the path table all see it (a copy of the kernel package, the
    toy's package added, its import line first in the list)."""
    env = kernel_package(tmp_path, {"toy": {"__init__.py": TOY_RECORD,
                                            "toy_launch.py": TOY_LAUNCH}}, [("toy", "TOY")])
    done = subprocess.run([sys.executable, "-c", TOY_CHECK], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["first"] == "toy_sm90" and got["row_sum"] == "Toy"
    assert got["info"] and "its kernels" in got["info"][0]
    assert got["ptx"] and got["compile"] == ["toy_fwd"]
    built = subprocess.run([sys.executable, "-m", "ts_moe", "compile", "--family", "toy_sm90"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "toy_sm90 (a throwaway family): 1 builds" in built.stdout


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
