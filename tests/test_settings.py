"""``ts_moe.settings``: one object owns every switch and environment variable, reads
them when they are used, refuses bad values by name, and is the only reader of the
environment in the package; the README's table of settings is generated from it."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import ts_moe
from csrc_free_kernels.common import kernel_cache, pdl
from csrc_free_kernels.common import settings as kernel_settings
from ts_moe import ops
from ts_moe.decode_graphs import DecodeGraphs
from ts_moe.ops import paths
from ts_moe.settings import SETTINGS, Settings

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = [s for s in SETTINGS if s.env]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """No TS_MOE_* variable and no value set from code, before and after each test."""
    for s in ENV:
        monkeypatch.delenv(s.env, raising=False)
    ts_moe.settings.reset()
    yield
    ts_moe.settings.reset()


def test_every_switch_and_variable_is_a_setting():
    assert {s.name for s in SETTINGS} == {
        "pdl", "disk_cache", "cache_dir", "reference", "decode_graphs", "sm100_kernel",
        "router_kernel", "fp8_kernels", "vllm"}
    assert {s.env for s in ENV} == {"TS_MOE_PDL", "TS_MOE_NO_DISK_CACHE", "TS_MOE_CACHE_DIR",
                                    "TS_MOE_REFERENCE", "TS_MOE_DECODE_GRAPHS", "TS_MOE_VLLM"}
    assert isinstance(ts_moe.settings, Settings)
    assert repr(ts_moe.settings) == (
        "Settings(pdl=True, disk_cache=True, cache_dir=None, reference=False, "
        "decode_graphs=True, sm100_kernel=False, router_kernel=False, fp8_kernels=True, "
        "vllm=False)")


@pytest.mark.parametrize("spec", [s for s in ENV if s.values], ids=lambda s: s.env)
def test_each_variable_is_read_when_used(spec, monkeypatch):
    assert getattr(ts_moe.settings, spec.name) is spec.default
    for text, value in spec.values.items():
        monkeypatch.setenv(spec.env, text)
        assert getattr(ts_moe.settings, spec.name) is value
        assert ts_moe.settings.source(spec.name) == spec.env
    monkeypatch.setenv(spec.env, "")  # empty: unset
    assert getattr(ts_moe.settings, spec.name) is spec.default


@pytest.mark.parametrize("spec", [s for s in ENV if s.values], ids=lambda s: s.env)
@pytest.mark.parametrize("bad", ["yes", "true", "2", " 1"])
def test_a_bad_value_is_a_value_error_naming_the_variable(spec, bad, monkeypatch):
    monkeypatch.setenv(spec.env, bad)
    with pytest.raises(ValueError, match=rf"^{spec.env}={re.escape(repr(bad))}: "):
        getattr(ts_moe.settings, spec.name)
    with pytest.raises(ValueError, match=spec.env):
        ts_moe.settings.check_environment()


def test_a_bad_variable_fails_the_import(tmp_path):
    """On every device alike: the import reads them all."""
    done = subprocess.run([sys.executable, "-c", "import ts_moe"], cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                               "HOME": str(tmp_path), "TS_MOE_DECODE_GRAPHS": "false"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ValueError: TS_MOE_DECODE_GRAPHS='false': decode_graphs takes 0 (off), 1 (on); "
        "unset means on")


@pytest.mark.parametrize("command", ["python -m ts_moe", "ts-moe"])
def test_a_bad_variable_is_a_commands_usage_error(tmp_path, command):
    """``python -m ts_moe info`` (or the ``ts-moe`` script) with a bad variable: the
    message and exit status 2, as for a bad argument, not a traceback from the import."""
    script = tmp_path / "ts-moe"  # as pip writes the console script
    script.write_text("import sys\nfrom ts_moe.__main__ import main\nsys.exit(main())\n")
    argv = ["-m", "ts_moe"] if command == "python -m ts_moe" else [str(script)]
    done = subprocess.run([sys.executable, *argv, "info"], cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                               "HOME": str(tmp_path), "TS_MOE_PDL": "yes"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr == ("ts_moe: TS_MOE_PDL='yes': pdl takes 0 (off), 1 (on); unset "
                           "means on\n")


def test_a_long_value_is_quoted_cut_short(monkeypatch):
    """A 120 KiB value in a variable (or set from code) is quoted by its first characters
    and its length, not echoed whole."""
    long = "y" * (120 << 10)
    monkeypatch.setenv("TS_MOE_PDL", long)
    with pytest.raises(ValueError) as bad:
        ts_moe.settings.check_environment()
    assert str(bad.value) == (f"TS_MOE_PDL={'y' * kernel_settings.SHOWN!r}... (122880 "
                              f"characters): pdl takes 0 (off), 1 (on); unset means on")
    monkeypatch.delenv("TS_MOE_PDL")
    for value, error in ((long, ValueError), (long.encode(), TypeError), (list(long), TypeError)):
        with pytest.raises(error) as bad:
            ts_moe.settings.cache_dir = value
        assert len(str(bad.value)) < 300 and "characters)" in str(bad.value), str(bad.value)[:300]
    monkeypatch.setenv("TS_MOE_CACHE_DIR", long)
    root, why = kernel_cache.configured_root()
    assert root is None and len(why) < 300 and "(122880 characters)" in why


def test_code_outranks_the_variable_until_reset(monkeypatch):
    monkeypatch.setenv("TS_MOE_PDL", "0")
    assert ts_moe.settings.pdl is False
    ts_moe.settings.pdl = True
    assert ts_moe.settings.pdl is True and ts_moe.settings.source("pdl") == "code"
    del ts_moe.settings.pdl
    assert ts_moe.settings.pdl is False
    ts_moe.settings.reference = True
    ts_moe.settings.reset("reference")
    assert ts_moe.settings.reference is False and ts_moe.settings.source("reference") == "default"


def test_override_puts_back_what_was_there(monkeypatch):
    monkeypatch.setenv("TS_MOE_DECODE_GRAPHS", "0")
    ts_moe.settings.router_kernel = True
    with ts_moe.settings.override(decode_graphs=True, router_kernel=False) as s:
        assert s is ts_moe.settings and s.decode_graphs and not s.router_kernel
    assert ts_moe.settings.decode_graphs is False  # from the variable again
    assert ts_moe.settings.router_kernel is True
    with pytest.raises(AttributeError, match="no setting 'router_kernal'"):
        with ts_moe.settings.override(router_kernal=True):
            pass
    assert ts_moe.settings.router_kernel is True


def test_values_set_from_code_are_checked():
    with pytest.raises(AttributeError):
        ts_moe.settings.router_kernal = True  # a typo is no new attribute
    with pytest.raises(TypeError, match="settings.fp8_kernels takes True or False, got 1"):
        ts_moe.settings.fp8_kernels = 1
    with pytest.raises(ValueError, match="settings.cache_dir takes an absolute path"):
        ts_moe.settings.cache_dir = "relcache"
    with pytest.raises(AttributeError, match="no setting 'nope'"):
        ts_moe.settings.reset("nope")
    ts_moe.settings.cache_dir = pathlib.Path("/tmp/ts_moe_cache")
    assert ts_moe.settings.cache_dir == "/tmp/ts_moe_cache"


def test_the_kernels_read_the_same_values():
    """ts_moe.settings shares its values with csrc_free_kernels.common.settings.settings,
    which the kernels read (PDL at each build, the disk cache at each use)."""
    assert pdl.enabled() is True
    ts_moe.settings.pdl = False
    assert kernel_settings.settings.pdl is False and pdl.ENABLED is False
    kernel_settings.settings.reset("pdl")
    assert ts_moe.settings.pdl is True
    ts_moe.settings.disk_cache = False
    assert kernel_cache.configured_root() == (None, kernel_cache._DISABLED)
    ts_moe.settings.disk_cache = True
    ts_moe.settings.cache_dir = "/tmp/somewhere"
    assert kernel_cache.configured_root() == (pathlib.Path("/tmp/somewhere"), None)


def test_the_public_switches_are_setters_of_the_settings():
    assert ts_moe.use_router_kernel() is False and ts_moe.settings.router_kernel is True
    assert ops.router_kernel_enabled() is True
    assert ts_moe.use_router_kernel(False) is True and ts_moe.settings.router_kernel is False
    ts_moe.use_sm100_kernel()
    assert ts_moe.settings.sm100_kernel is True
    ts_moe.use_sm100_kernel(False)
    assert ts_moe.settings.sm100_kernel is False
    ts_moe.use_fp8_kernels()
    assert ts_moe.settings.fp8_kernels is True and ts_moe.fp8_kernels_enabled()
    ts_moe.settings.fp8_kernels = False
    assert not ts_moe.fp8_kernels_enabled()
    ts_moe.settings.reset("fp8_kernels")  # the default, for the tests after this one


def test_the_paths_read_the_settings_at_each_call(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (10, 0))
    paths._capability.cache_clear()

    class CudaTensor:  # what the paths read of a tensor on CUDA device 0
        device = torch.device("cuda", 0)

        def get_device(self):
            return 0

    cuda = CudaTensor()
    try:
        bf16 = torch.bfloat16
        first = lambda: paths.backends(paths.Op.GROUPED_GEMM, paths.device_capability(cuda),
                                       bf16)[0]
        table = paths.TABLE
        assert first() is table[paths.Path.TORCH_GROUPED_MM][paths.Op.GROUPED_GEMM]
        ts_moe.settings.sm100_kernel = True
        assert first() is table[paths.Path.KERNEL_SM100][paths.Op.GROUPED_GEMM]
        monkeypatch.setenv("TS_MOE_REFERENCE", "1")
        assert first() is table[paths.Path.REFERENCE][paths.Op.GROUPED_GEMM]
        monkeypatch.setenv("TS_MOE_REFERENCE", "0")
        assert first() is table[paths.Path.KERNEL_SM100][paths.Op.GROUPED_GEMM]
    finally:
        paths._capability.cache_clear()


def test_decode_graphs_read_the_setting_and_their_own_switch_outranks_it(monkeypatch):
    graphs = DecodeGraphs()
    assert graphs.enabled
    monkeypatch.setenv("TS_MOE_DECODE_GRAPHS", "0")
    assert not graphs.enabled
    ts_moe.settings.decode_graphs = True
    assert graphs.enabled
    graphs.disable()
    assert not graphs.enabled


def _environment_reads(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, variable)`` of each read of ``os.environ`` / ``os.getenv`` in ``path``: a
    constant key, ``*`` for a read of every variable; a copy passed to a child process
    (``dict(os.environ, ...)``) and a write are not reads."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    reads = []

    def key(arg):  # a constant key, else "*" (a key computed at run time)
        return arg.value if isinstance(arg, ast.Constant) else "*"

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "getenv":
            call = parents[node]
            reads.append((node.lineno, key(call.args[0]) if call.args else "*"))
        if not (isinstance(node, ast.Attribute) and node.attr == "environ"):
            continue
        up = parents[node]
        if isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id == "dict":
            continue  # the environment of a child process
        if isinstance(up, ast.Subscript):
            if isinstance(up.ctx, ast.Load):
                reads.append((node.lineno, key(up.slice)))
        elif isinstance(up, ast.Attribute) and up.attr in ("get", "setdefault"):
            reads.append((node.lineno, key(parents[up].args[0])))
        else:
            reads.append((node.lineno, "*"))
    return reads


def test_only_the_settings_read_the_environment():
    """Outside the two settings modules the package reads only the DSL's own
    CUTE_DSL_* variables (build tooling: the arch, the dump directory, the codegen key)
    and PYTHONPATH for a child."""
    settings_modules = {ROOT / "csrc_free_kernels" / "common" / "settings.py",
                        ROOT / "ts_moe" / "settings.py"}
    found = {}
    for package in ("ts_moe", "csrc_free_kernels", "ts_pipeline"):
        for path in sorted((ROOT / package).rglob("*.py")):
            reads = _environment_reads(path)
            if reads and path not in settings_modules:
                found[path.relative_to(ROOT).as_posix()] = reads
    others = {(p, v) for p, reads in found.items() for _, v in reads
              if not v.startswith("CUTE_DSL_") and v != "PYTHONPATH"}
    assert others == {("csrc_free_kernels/common/compile.py", "*")}, others  # codegen_environment
    assert _environment_reads(ROOT / "csrc_free_kernels" / "common" / "settings.py")


def test_the_readme_table_names_every_setting_and_variable():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- bench:settings begin -->")
    table = readme[start:readme.index("<!-- bench:settings end -->")]
    for s in SETTINGS:
        assert f"| `ts_moe.settings.{s.name}`" in table
        assert s.env is None or f"`{s.env}`" in table
    assert set(re.findall(r"TS_MOE_[A-Z_]+", readme)) == {s.env for s in ENV}


def test_a_variable_is_read_as_the_environment_is_now(monkeypatch):
    """Settings read os.environ's store directly (an op reads one at every call): what
    they see follows every change made through os.environ, as os.environ.get does."""
    from csrc_free_kernels.common.settings import _environ_get

    for value in ("1", "0", "", "é"):
        monkeypatch.setenv("TS_MOE_SETTINGS_PROBE", value)
        assert _environ_get("TS_MOE_SETTINGS_PROBE") == os.environ.get("TS_MOE_SETTINGS_PROBE")
    monkeypatch.delenv("TS_MOE_SETTINGS_PROBE")
    assert _environ_get("TS_MOE_SETTINGS_PROBE") is None
    monkeypatch.setenv("TS_MOE_REFERENCE", "1")
    assert ts_moe.settings.reference is True
    monkeypatch.setenv("TS_MOE_REFERENCE", "0")
    assert ts_moe.settings.reference is False


class _BytesPath(os.PathLike):
    def __fspath__(self):
        return b"/tmp/ts_moe_cache"


@pytest.mark.parametrize("value, error, words", [
    ("/tmp/a\0b", ValueError, "takes a path without a NUL byte, got '/tmp/a\\x00b'"),
    (_BytesPath(), TypeError, "takes a str path or None, got <"),
])
def test_a_cache_dir_no_build_can_use_is_refused_where_it_is_set(value, error, words):
    """Either would make every kernel build raise inside get_compiled (the cache's
    paths are str, and a NUL is in none): refused naming the setting, and the
    cache keeps what it had."""
    with pytest.raises(error, match=re.escape(f"settings.cache_dir {words}")):
        ts_moe.settings.cache_dir = value
    assert ts_moe.settings.cache_dir is None
    assert kernel_cache.configured_root()[1] is None  # the default directory, usable
    with pytest.raises(error, match=re.escape(f"settings.cache_dir {words}")):
        with ts_moe.settings.override(cache_dir=value):
            pass


def test_an_unknown_variable_is_named_once_with_the_known_ones(monkeypatch, recwarn):
    monkeypatch.setattr(kernel_settings, "_unknown", set())
    for name in [n for n in os.environ if n.startswith("TS_MOE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TS_MOE_FP8_KERNELS", "1")   # a setting set from code only
    monkeypatch.setenv("TS_MOE_DECODE_GRAPH", "0")  # a misspelling
    monkeypatch.setenv("TS_MOE_REFERENCE", "1")     # known: no word
    ts_moe.settings.check_environment()
    ts_moe.settings.check_environment()             # once per process
    messages = sorted(str(w.message) for w in recwarn)
    known = ", ".join(sorted(s.env for s in ENV))
    assert messages == [
        f"TS_MOE_DECODE_GRAPH is not a ts_moe setting's variable and is ignored; the "
        f"variables are {known}",
        f"TS_MOE_FP8_KERNELS is not a ts_moe setting's variable and is ignored; the "
        f"variables are {known}; fp8_kernels is set from code only "
        f"(ts_moe.use_fp8_kernels(False) or ts_moe.settings.fp8_kernels = False)"]


def test_an_unknown_variable_is_named_at_import(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import ts_moe"], cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                               "HOME": str(tmp_path), "TS_MOE_FP8_KERNELS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("TS_MOE_FP8_KERNELS is not a ts_moe setting's variable") == 1
