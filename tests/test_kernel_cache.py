"""The disk kernel cache holds native code: it loads only objects that this uid
alone can have written, intact, compiled for this code-generation environment,
and a cache it may not or cannot use costs one warning, never an error.

Most tests drive ``compile.get_compiled`` with a stand-in for the DSL's compile,
export and load (an "object" is bytes; loading it returns them), so they plant
files, symlinks and directories of another uid as an attacker would; one test
round-trips a real CuTeDSL object."""

import hashlib
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import cutlass
import cutlass.cute as cute
import pytest

from csrc_free_kernels import ptx_dump
from csrc_free_kernels.common import compile as kcompile
from csrc_free_kernels.common.family import Build
from csrc_free_kernels.common import kernel_cache
from ts_moe import __main__ as ts_moe_main

REPO = Path(__file__).resolve().parents[1]
OTHER_UID = 12345
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting another uid's files needs root")
PLANTED = b"\x7fELF planted by another user"


class FakeDSL:
    """``cute.compile`` / ``export_to_c`` / ``cute.runtime.load_module`` on bytes."""

    def __init__(self):
        self.compiled, self.loaded = [], []
        self.exported = []           # (the path given, the file it named then)
        self.export_error = None
        self.during_export = None    # called before the object is written
        self.runtime = types.SimpleNamespace(load_module=self.load_module)

    def compile(self, payload, *args, options=""):
        self.compiled.append(payload)
        dsl = self

        class Compiled:
            def export_to_c(self, object_file_path, function_name):
                dsl.exported.append((object_file_path, os.path.realpath(object_file_path)))
                if dsl.export_error:
                    raise dsl.export_error
                if dsl.during_export:
                    dsl.during_export()
                with open(object_file_path, "wb") as f:
                    f.write(payload)

        return Compiled()

    def load_module(self, path, enable_tvm_ffi=False):
        with open(path, "rb") as f:
            data = f.read()
        self.loaded.append(data)
        return _Module(data)


class _Module(dict):
    """Any function name: the loaded bytes."""

    def __init__(self, data):
        super().__init__()
        self.data = data

    def __missing__(self, name):
        return ("loaded", self.data)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A fresh process's caches and warnings, ``TS_MOE_CACHE_DIR=tmp/cache``."""
    monkeypatch.setattr(kcompile, "_memory", {})
    monkeypatch.setattr(kcompile, "stats", [])
    monkeypatch.setattr(kernel_cache, "_warned", set())
    monkeypatch.setattr(kernel_cache, "_unwritable", set())
    monkeypatch.delenv("TS_MOE_NO_DISK_CACHE", raising=False)
    monkeypatch.setenv("TS_MOE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def dsl(fresh, monkeypatch):
    """The stand-in DSL, in a fresh process."""
    fake = FakeDSL()
    monkeypatch.setattr(kcompile, "cute", fake)
    # a stand-in compiles no PTX: the pre-flight's gate is tests/test_preflight_gate.py's
    monkeypatch.setattr(kcompile, "_compile_checked", lambda b: kcompile._compile(*b.make()))
    return fake


def get(payload=b"\x7fELF good", key="k0"):
    """The kernel for ``key`` (built from ``payload``) and how it was obtained:
    "compiled", "loaded" (from disk) or "memory"."""
    seen = len(kcompile.stats)
    fn = kcompile.get_compiled(Build("test", ("TestKernel", key), lambda: (payload, ())))
    return fn, kcompile.stats[-1][2] if len(kcompile.stats) > seen else "memory"


def new_process():
    kcompile._memory.clear()


def cache_warnings(recwarn) -> list:
    return [str(w.message) for w in recwarn if issubclass(w.category, kernel_cache.KernelCacheWarning)]


def seed(tmp_path, key="k0"):
    """One kernel stored under ``tmp/cache``: (its fingerprint directory, its object)."""
    before = set((tmp_path / "cache").glob("*/k_*.o"))
    get(key=key)
    (obj,) = set((tmp_path / "cache").glob("*/k_*.o")) - before
    new_process()
    return obj.parent, obj


def plant(obj: Path, data: bytes = PLANTED) -> Path:
    """``data`` in place of the object ``obj``, under the name its sha256 gives
    (``k_<key>.<sha256>.o``, as a write of it would name it): its path."""
    obj.unlink()
    planted = obj.parent / f"{obj.name.split('.')[0]}.{hashlib.sha256(data).hexdigest()}.o"
    planted.write_bytes(data)
    return planted


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ---------------------------------------------------------------- 1. ownership

def test_directories_it_creates_are_private(dsl, tmp_path, monkeypatch):
    root = tmp_path / "a" / "b" / "cache"
    monkeypatch.setenv("TS_MOE_CACHE_DIR", str(root))
    get()
    (obj,) = root.glob("*/k_*.o")
    for d in (tmp_path / "a", tmp_path / "a" / "b", root, obj.parent):
        assert mode(d) == 0o700, d
    assert mode(obj) == 0o600


@needs_root
@pytest.mark.parametrize("where, owner, perms, reason", [
    ("root", OTHER_UID, 0o777, "owned by uid 12345"),   # the reproduced attack
    ("root", OTHER_UID, 0o700, "owned by uid 12345"),
    ("root", None, 0o777, "writable by its group or others"),
    ("root", None, 0o770, "writable by its group or others"),
    ("build", OTHER_UID, 0o700, "owned by uid 12345"),
    ("build", None, 0o702, "writable by its group or others"),
])
def test_a_directory_another_user_can_write_is_not_used(dsl, tmp_path, recwarn, where, owner,
                                                        perms, reason):
    build, obj = seed(tmp_path)
    obj = plant(obj)
    target = tmp_path / "cache" if where == "root" else build
    os.chmod(target, perms)
    if owner is not None:
        os.chown(target, owner, owner)
    before = sorted(os.listdir(build))

    fn, how = get()
    assert how == "compiled" and fn is not None and dsl.loaded == []
    assert obj.read_bytes() == PLANTED and sorted(os.listdir(build)) == before  # nothing written
    (message,) = cache_warnings(recwarn)
    assert str(target) in message and reason in message and "memory" in message
    _, how = get(key="k1")          # memory only from then on, said once
    assert how == "compiled" and len(cache_warnings(recwarn)) == 1


@needs_root
def test_an_object_of_another_uid_is_not_loaded(dsl, tmp_path, recwarn):
    _, obj = seed(tmp_path)
    obj = plant(obj)
    os.chown(obj, OTHER_UID, OTHER_UID)
    _, how = get()
    assert how == "compiled" and dsl.loaded == []
    assert any(str(obj) in m for m in cache_warnings(recwarn))


def test_a_relative_cache_dir_is_refused(dsl, tmp_path, monkeypatch, recwarn):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TS_MOE_CACHE_DIR", "relcache")
    assert get()[1] == "compiled" and get(key="k1")[1] == "compiled"
    assert not (tmp_path / "relcache").exists()
    (message,) = cache_warnings(recwarn)
    assert "'relcache'" in message and "relative" in message


def test_a_symlinked_object_is_not_followed(dsl, tmp_path, recwarn):
    _, obj = seed(tmp_path)
    elsewhere = tmp_path / "elsewhere.o"
    obj = plant(obj)                 # named by the planted bytes' sha256
    obj.rename(elsewhere)
    obj.symlink_to(elsewhere)
    _, how = get()
    assert how == "compiled" and dsl.loaded == []
    assert elsewhere.read_bytes() == PLANTED and obj.is_symlink()  # left alone, not followed
    (written,) = set(obj.parent.glob("k_*.o")) - {obj}
    assert not written.is_symlink() and written.read_bytes() == b"\x7fELF good"
    assert any("symlink" in m for m in cache_warnings(recwarn))


# ---------------------------------------------------------------- 2. temporary files

def test_the_temporary_file_never_follows_a_planted_symlink(dsl, tmp_path):
    build, obj = seed(tmp_path)
    obj.unlink()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    # the names a writer could predict: the object's name with the pid
    for name in (f"{obj.stem}.{os.getpid()}.tmp", f".{obj.name}.tmp", f"{obj.name}.tmp"):
        (build / name).symlink_to(victim)
    _, how = get()
    assert how == "compiled"
    assert victim.read_bytes() == b"precious"
    assert obj.is_file() and not obj.is_symlink() and obj.read_bytes() == b"\x7fELF good"


def test_each_write_has_its_own_temporary_file(dsl, tmp_path):
    """Two containers sharing the cache both run as pid 1: a name from the pid collides."""
    build, obj = seed(tmp_path)
    obj.unlink()
    get()
    (_, first), (_, second) = dsl.exported
    assert first != second
    assert Path(first).parent == Path(second).parent == build
    assert not [p for p in os.listdir(build) if "tmp" in p]


# ---------------------------------------------------------------- 3. integrity and keys

@pytest.mark.parametrize("damage", ["flip a byte", "torn"])
def test_a_damaged_object_is_a_miss(dsl, tmp_path, recwarn, damage):
    build, obj = seed(tmp_path)
    _, obj1 = seed(tmp_path, key="k1")
    for o in (obj, obj1):
        data = bytearray(o.read_bytes())
        if damage == "flip a byte":
            data[2] ^= 0x01
        else:
            del data[len(data) // 2:]
        o.write_bytes(bytes(data))
    _, how = get()
    assert how == "compiled" and dsl.loaded == []
    assert get(key="k1")[1] == "compiled"
    (message,) = cache_warnings(recwarn)             # said once
    assert "sha256" in message and str(obj) in message
    new_process()                                    # rewritten whole: loaded next time
    assert get()[1] == "loaded" and dsl.loaded == [b"\x7fELF good"]


def test_the_code_generation_environment_is_in_the_key(dsl, tmp_path, monkeypatch):
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    monkeypatch.setattr(envar, "arch", "sm_100a")
    get(payload=b"\x7fELF sm_100a")
    new_process()
    monkeypatch.setattr(envar, "arch", "sm_90a")
    fn, how = get(payload=b"\x7fELF sm_90a")
    assert how == "compiled" and dsl.loaded == []
    assert len(list((tmp_path / "cache").glob("*/k_*.o"))) == 2
    new_process()
    assert get()[0] == ("loaded", b"\x7fELF sm_90a")


_ARCH_SCRIPT = textwrap.dedent("""
    import os, types
    from csrc_free_kernels.common import compile as kcompile
    from csrc_free_kernels.common.family import Build

    class Compiled:
        def __init__(self, payload):
            self.payload = payload

        def export_to_c(self, object_file_path, function_name):
            open(object_file_path, "wb").write(self.payload)

    def load_module(path, enable_tvm_ffi=False):
        data = open(path, "rb").read()
        return type("Module", (), {"__getitem__": lambda self, name: Compiled(data)})()

    kcompile.cute = types.SimpleNamespace(
        compile=lambda payload, *args, options="": Compiled(payload),
        runtime=types.SimpleNamespace(load_module=load_module))
    kcompile._compile_checked = lambda b: kcompile._compile(*b.make())
    fn = kcompile.get_compiled(Build("test", ("TestKernel",),
                                     lambda: (os.environ["CUTE_DSL_ARCH"].encode(), ())))
    print(kcompile.stats[-1][2], fn.payload.decode())
""")


def test_cute_dsl_arch_selects_its_own_objects(tmp_path):
    """Two processes, one cache, CUTE_DSL_ARCH sm_100a then sm_90a: the second compiles."""
    def run(arch):
        env = dict(os.environ, CUTE_DSL_ARCH=arch, TS_MOE_CACHE_DIR=str(tmp_path / "cache"),
                   PYTHONPATH=str(REPO))
        env.pop("TS_MOE_NO_DISK_CACHE", None)
        proc = subprocess.run([sys.executable, "-c", _ARCH_SCRIPT], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split()

    assert run("sm_100a") == ["compiled", "sm_100a"]
    assert run("sm_90a") == ["compiled", "sm_90a"]
    assert run("sm_100a") == ["loaded", "sm_100a"]


# ---------------------------------------------------------------- 4. cannot be written

@pytest.mark.parametrize("where", ["under a regular file", "/proc/self"])
def test_a_cache_that_cannot_be_written_runs_in_memory(dsl, tmp_path, monkeypatch, recwarn, where):
    if where == "/proc/self":
        root = "/proc/self"          # ours, read-only: nothing can be created in it
    else:
        (tmp_path / "file").write_text("")
        root = str(tmp_path / "file" / "cache")
    monkeypatch.setenv("TS_MOE_CACHE_DIR", root)
    assert get()[1] == "compiled" and get(key="k1")[1] == "compiled"
    assert get()[1] == "memory" and len(dsl.compiled) == 2
    (message,) = cache_warnings(recwarn)
    assert root in message and "memory" in message


def test_a_failed_write_runs_in_memory(dsl, tmp_path, recwarn):
    dsl.export_error = OSError(28, "No space left on device")
    assert get()[1] == "compiled" and get(key="k1")[1] == "compiled"
    assert len(dsl.exported) == 1    # no further writes there
    (message,) = cache_warnings(recwarn)
    assert "No space left" in message and "memory" in message
    (build,) = (tmp_path / "cache").iterdir()
    assert os.listdir(build) == []   # no temporary file left


# ---------------------------------------------------------------- a real object

class Fill:
    """The smallest kernel: one CTA writes ones."""

    @cute.kernel
    def kernel(self, x: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < x.shape[0]:
            x[tidx] = cutlass.Float32(1.0)

    @cute.jit
    def __call__(self, x: cute.Tensor, stream):
        self.kernel(x).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)


def test_a_real_object_round_trips_and_a_tampered_one_is_refused(fresh, tmp_path, recwarn):
    import tvm_ffi

    def build():
        x = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),),
                                                  assumed_align=4)
        return Fill(), (x, kcompile.fake_stream())

    def obtain():
        kcompile._memory.clear()
        fn = kcompile.get_compiled(Build("fill", ("TestFill",), build))
        return fn, kcompile.stats[-1][2]

    assert obtain()[1] == "compiled"
    (obj,) = (tmp_path / "cache").glob("*/k_*.o")
    data = obj.read_bytes()
    assert data[:4] == b"\x7fELF"
    assert obj.name.split(".")[1] == hashlib.sha256(data).hexdigest()
    fn, how = obtain()
    assert how == "loaded" and isinstance(fn, tvm_ffi.Function)

    tampered = bytearray(data)
    tampered[len(data) // 2] ^= 0xFF
    obj.write_bytes(bytes(tampered))
    assert obtain()[1] == "compiled"
    assert any("sha256" in m for m in cache_warnings(recwarn))
    assert obj.read_bytes() != bytes(tampered)


# ---------------------------------------------------------------- 5. the CLI

def test_cache_command_shows_and_clears_only_its_own_files(dsl, tmp_path, capsys):
    build, _ = seed(tmp_path)
    seed(tmp_path, key="k1")
    root = tmp_path / "cache"
    (root / "notes.txt").write_text("mine")
    (build / "keep.me").write_text("mine too")
    capsys.readouterr()

    assert ts_moe_main.main(["cache"]) == 0
    out = capsys.readouterr().out
    assert str(root) in out and f"this build ({build.name}): 2 kernel objects" in out

    assert ts_moe_main.main(["cache", "--clear"]) == 0
    assert "removed 2 files" in capsys.readouterr().out
    assert sorted(p.name for p in root.rglob("*")) == [build.name, "keep.me", "notes.txt"]
    assert ts_moe_main.main(["cache"]) == 0
    assert f"this build ({build.name}): 0 kernel objects" in capsys.readouterr().out


def test_cache_command_says_why_it_runs_in_memory(dsl, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TS_MOE_CACHE_DIR", "relcache")
    assert ts_moe_main.main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "memory only" in out and "'relcache' is a relative path" in out
    assert ts_moe_main.main(["cache", "--clear"]) == 1
    assert not (tmp_path / "relcache").exists()


@needs_root
def test_cache_command_leaves_another_users_directory_alone(dsl, tmp_path, monkeypatch, capsys):
    root = tmp_path / "theirs"
    root.mkdir()
    (root / "keep").write_text("")
    os.chown(root, OTHER_UID, OTHER_UID)
    monkeypatch.setenv("TS_MOE_CACHE_DIR", str(root))
    assert ts_moe_main.main(["cache", "--clear"]) == 1
    out = capsys.readouterr().out
    assert "memory only" in out and f"{root} is owned by uid {OTHER_UID}" in out
    assert os.listdir(root) == ["keep"]


def test_python_m_ts_moe_cache(tmp_path):
    env = dict(os.environ, TS_MOE_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    env.pop("TS_MOE_NO_DISK_CACHE", None)
    proc = subprocess.run([sys.executable, "-m", "ts_moe", "cache"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"kernel cache: {tmp_path / 'cache'}" in proc.stdout
    assert "0 kernel objects" in proc.stdout and not (tmp_path / "cache").exists()


# ---------------------------------------------------------------- ptx_dump

@pytest.mark.parametrize("returncode", [0, 1])
def test_ptx_dump_leaves_no_scratch_directory(monkeypatch, tmp_path, returncode):
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))
    seen = []

    def fake_run(cmd, env, **kw):
        seen.append(Path(env["CUTE_DSL_DUMP_DIR"]).is_dir())
        return subprocess.CompletedProcess(cmd, returncode, "", "")

    monkeypatch.setattr(ptx_dump.subprocess, "run", fake_run)
    out = tmp_path / "out"
    out.mkdir()
    if returncode:
        with pytest.raises(RuntimeError, match="PTX build"):
            ptx_dump.dump("sm_90a", ["gemm_decode"], str(out))
    else:
        assert ptx_dump.dump("sm_90a", ["gemm_decode"], str(out)) == {}
    assert seen == [True] and os.listdir(scratch_root) == []
