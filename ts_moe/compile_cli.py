"""``python -m ts_moe compile``: build every kernel family for its arch without a GPU,
each build through the pre-flight of the hardware's rules (``csrc_free_kernels.preflight``).

The builds are the families' own (``csrc_free_kernels.families``): by default those each
family checks on the CPU (``Kernels.checked``, what the PTX tests compile too); with
``--builds unchecked`` every other build a call can reach (CI builds these beside the
suite, so that every reachable build is pre-flighted), ``--builds reachable`` all of them.
Each is compiled exactly as a call compiles it
(``csrc_free_kernels.common.compile.compile_build``), nothing cached.  The DSL takes its
target arch when it is imported, so each arch builds in a process of its own
(:func:`run`); a violation, or a build that fails, fails the step, naming the build.
"""

import os
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec

from csrc_free_kernels.common import scratch
from csrc_free_kernels.families import BY_NAME, FAMILIES

ARCHES = tuple(dict.fromkeys(f.arch for f in FAMILIES))  # sm_90a first
KEEP = "ptx,cubin"  # what the DSL keeps of each build for the pre-flight
WHICH = ("checked", "unchecked", "reachable")  # the builds --builds names


def add_arguments(parser) -> None:
    parser.add_argument("--arch", choices=ARCHES,
                        help="one arch (default: every family, each for its arch)")
    parser.add_argument("--family", choices=sorted(BY_NAME),
                        help="one family (on its arch)")
    parser.add_argument("--builds", choices=WHICH, default="checked",
                        help="the builds each family checks on the CPU (default), the other "
                             "builds a call can reach, or every reachable build")


def _say(text: str = "") -> None:
    print(text, flush=True)


def builds(arch: str, only: str | None = None, which: str = "checked") -> list:
    """``[(family, [Build])]`` of the families built for ``arch`` (or of the family named
    ``only``): the builds each checks, the others it can reach, or all (``which``)."""
    keep = {"checked": (True,), "unchecked": (False,), "reachable": (True, False)}[which]
    found = []
    for family in FAMILIES:
        if family.arch == arch and only in (None, family.name):
            kernels = family.load()
            found.append((family, [b for b in kernels.builds() if kernels.checked(b) in keep]))
    return found


def compile_arch(arch: str, only: str | None = None, which: str = "checked") -> int:
    """Every family of ``arch`` (or the one named ``only``) built in this process (the DSL
    imported for ``arch``, its PTX and cubin kept), a line per family, each build (of
    ``which``: :func:`builds`) through the pre-flight."""
    from csrc_free_kernels import preflight
    from csrc_free_kernels.common.compile import compile_build

    from .settings import settings

    dump_dir = os.environ["CUTE_DSL_DUMP_DIR"]
    settings.disk_cache = False  # build only: nothing written to the cache
    start = time.perf_counter()
    built = 0
    for family, family_builds in builds(arch, only, which):
        _say(f"  [{time.perf_counter() - start:5.1f} s] {family.name} ({family.title}): "
             f"{len(family_builds)} builds")
        for b in family_builds:
            try:
                with preflight.recording() as facts:
                    compile_build(b)
                found = preflight.check(b.name, preflight.collect(dump_dir, facts), facts)
            except Exception as exc:  # say which build, then fail
                print(f"{b.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                return 1
            if found:
                print("the pre-flight of the hardware's rules failed:", file=sys.stderr)
                for violation in found:
                    print(violation, file=sys.stderr)
                return 1
        built += len(family_builds)
    kind = "" if which == "checked" else f"{which} "  # the default's line as it always was
    _say(f"  [{time.perf_counter() - start:5.1f} s] {built} {kind}builds for {arch}, each "
         f"through the pre-flight ({', '.join(preflight.RULES)}): no violation")
    return 0


PACKAGES = ("ts_moe", "csrc_free_kernels", "ts_pipeline")  # what a build child imports


def import_dirs() -> list[str]:
    """The directories this process imports :data:`PACKAGES` from, in the order of its
    path, so that a child searching them in that order finds each where this process
    does (a family's package beside another checkout's included); one found by no path
    entry (an editable install's finder) after them."""
    rank = {}
    for i, entry in enumerate(sys.path):
        rank.setdefault(os.path.realpath(entry or os.curdir), i)
    dirs = {os.path.dirname(os.path.dirname(os.path.realpath(find_spec(name).origin)))
            for name in PACKAGES}
    return sorted(dirs, key=lambda d: (rank.get(d, len(sys.path)), d))


def child_env(arch: str, dump_dir: str) -> dict:
    """This environment, the DSL's arch and its PTX and cubin kept in ``dump_dir`` for
    the pre-flight (read when ``cutlass`` is imported), the directories of this
    process's packages first on the path (:func:`import_dirs`), and the child's working
    directory never on it (``PYTHONSAFEPATH``, Python 3.11+; the child also runs in
    ``dump_dir``: :func:`start`)."""
    return dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_KEEP=KEEP, CUTE_DSL_DUMP_DIR=dump_dir,
                PYTHONSAFEPATH="1",
                PYTHONPATH=os.pathsep.join([*import_dirs(),
                                            *filter(None, [os.environ.get("PYTHONPATH")])]))


def child(arch: str, family: str | None = None, which: str = "checked") -> list[str]:
    """The command of the child that builds ``arch`` (or ``family`` on it), the builds
    ``which`` names."""
    return [sys.executable, "-m", "ts_moe", "compile", "--arch", arch,
            *(("--family", family) if family else ()), "--builds", which]


def start(arch: str, dump_dir: str) -> dict:
    """How a build child starts (:func:`child_env`), in its fresh scratch folder
    ``dump_dir``: a ``torch.py`` (or ``pip/``, ``ts_moe/``) in the caller's directory is
    never imported in its place, as ``python -m`` would import it from there."""
    return {"env": child_env(arch, dump_dir), "cwd": dump_dir}


def run(arch: str | None = None, family: str | None = None, which: str = "checked") -> int:
    """Build ``arch`` (default: each arch in turn; the arch of ``family`` where one is
    named), each in a fresh process unless this one was started for it; the first
    failure's exit status, 2 for a ``family`` not built for ``arch``."""
    if family and arch and arch != BY_NAME[family].arch:
        print(f"ts_moe compile: --family {family} is built for {BY_NAME[family].arch}, not "
              f"--arch {arch} (leave --arch out, or name a family of {arch})",
              file=sys.stderr)
        return 2
    arch = BY_NAME[family].arch if family else arch
    if arch is not None and os.environ.get("CUTE_DSL_ARCH") == arch and \
            os.environ.get("CUTE_DSL_KEEP") == KEEP and os.environ.get("CUTE_DSL_DUMP_DIR"):
        return compile_arch(arch, family, which)
    for one in (arch,) if arch else ARCHES:
        with scratch.directory("ts_moe_build_") as dump_dir:
            status = subprocess.call(child(one, family, which), **start(one, dump_dir))
        if status:
            return status
    return 0


def build_in_child() -> str | None:
    """Every arch built (:func:`run`, in fresh processes), its lines shown as they come;
    None on success, else what went wrong."""
    for arch in ARCHES:
        with tempfile.TemporaryFile("w+") as stderr, \
                scratch.directory("ts_moe_build_") as dump_dir:
            # stderr a file: a full pipe would block the child
            proc = subprocess.Popen(child(arch), **start(arch, dump_dir),
                                    stdout=subprocess.PIPE, stderr=stderr, text=True)
            for line in proc.stdout:
                _say(line.rstrip("\n"))
            if proc.wait() == 0:
                continue
            stderr.seek(0)
            err = stderr.read()
        tail = "\n".join(err.strip().splitlines()[-15:])
        return f"the {arch} build failed (exit status {proc.returncode}):\n{tail}"
    return None


def build_with_ptx_stats() -> str | None:
    """``--verbose``: each family built with its PTX kept, each build through the
    pre-flight, and each build's statistics."""
    from csrc_free_kernels import ptx_dump

    start = time.perf_counter()
    for arch in ARCHES:
        for family, family_builds in builds(arch):
            names = [b.name for b in family_builds]
            _say(f"  [{time.perf_counter() - start:5.1f} s] {family.name}: {len(names)} builds, "
                 f"PTX kept")
            with tempfile.TemporaryDirectory() as d:
                try:
                    ptx = ptx_dump.dump(arch, names, d, check=True)
                except RuntimeError as exc:
                    return str(exc)
                for name in names:
                    text = ptx[name]
                    _say(f"      {name:36s} {text.count('mma_async') + text.count('tcgen05.mma'):2d}"
                         f" MMAs, {text.count('cp.async.bulk.tensor'):d} TMA loads, "
                         f"{text.count('expect_tx')} expect_tx, {len(text) // 1024} KB PTX")
    _say(f"  [{time.perf_counter() - start:5.1f} s] built for {', '.join(ARCHES)}")
    return None
