"""Compile kernel builds for one arch without a GPU and keep their PTX.

    CUTE_DSL_ARCH=sm_90a python -m csrc_free_kernels.ptx_dump OUT_DIR '["NAME", ...]'

writes ``OUT_DIR/NAME.ptx`` for each named build and beside it ``NAME.facts.json``, what
the pre-flight needs that the PTX does not say (the TMA maps, shared memory, the cubin's
registers: :mod:`.preflight`).  The builds are the families' own
(:mod:`.families`): :func:`builds` is every build a call can reach, :data:`BUILDS` those
the PTX tests and the pre-flight compile on the CPU; each compiles exactly as a call does
(:func:`.common.compile.compile_build`).  The DSL reads the arch and the keep/dump
settings once, at import, so each arch needs its own process: :func:`dump` runs one.
"""

import functools
import json
import os
import pathlib
import subprocess
import sys

from .common import scratch
from .families import FAMILIES


@functools.cache
def space() -> dict:
    """``{name: (family, Build, checked)}``: every family's whole build space, and whether
    the family checks the build on the CPU."""
    found = {}
    for family in FAMILIES:
        kernels = family.load()
        for b in kernels.builds():
            assert b.name not in found, f"two builds named {b.name}"
            found[b.name] = (family, b, kernels.checked(b))
    return found


def arch_of(name: str) -> str:
    """The arch a build of :func:`space` is compiled for."""
    return space()[name][0].arch


BUILDS = {name: b for name, (_, b, checked) in space().items() if checked}
"""The builds the PTX tests and the pre-flight compile on the CPU, by name."""


def builds_of(*families) -> list[str]:
    """The names of the builds of :data:`BUILDS` of ``families`` (their records), in
    the order of :func:`space`."""
    return [name for name, (family, _, checked) in space().items()
            if checked and family in families]


def reference_module_available() -> bool:
    try:
        from cutlass.experimental.task_scheduling import pipeline  # noqa: F401
    except ImportError:
        return False
    return True


def main(out_dir: str, names: list, extra: dict | None = None, check: bool = False) -> None:
    """Compile each of ``names`` (builds of :func:`space`, or of ``extra``: the tests'
    probes) for the arch of this process, writing ``NAME.ptx`` and ``NAME.facts.json``
    to ``out_dir``.  A build whose spec says ``plain_compile`` compiles without the
    TVM-FFI host entry (the ``ts_pipeline`` probes take an explicit stream).  With
    ``check``, each build goes through the pre-flight too, and a violation ends the run
    (exit status 1, naming the build, the rule and the PTX line)."""
    import cutlass.cute as cute

    from . import preflight
    from .common.compile import compile_build

    out = pathlib.Path(out_dir)
    dump_dir = pathlib.Path(os.environ["CUTE_DSL_DUMP_DIR"])
    for name in names:
        if name.endswith("_reference") and not reference_module_available():
            continue
        b = (extra or {}).get(name) or space()[name][1]
        with preflight.recording() as facts:
            if b.spec.get("plain_compile"):  # a probe of ts_pipeline, no host entry
                kernel, args = b.make()
                cute.compile(kernel, *args)
            else:
                compile_build(b)
        ptx = preflight.collect(dump_dir, facts)
        (out / f"{name}.ptx").write_text(ptx)
        (out / f"{name}.facts.json").write_text(facts.to_json())
        found = preflight.check(name, ptx, facts) if check else []
        if found:
            sys.exit("the pre-flight of the hardware's rules failed:\n"
                     + "\n".join(map(str, found)))


def dump(arch: str, names: list, out_dir: str, timeout: float = 600,
         main_module: str = "csrc_free_kernels.ptx_dump", check: bool = False) -> dict:
    """Compile ``names`` for ``arch`` in a fresh process (with ``check``, each through
    the pre-flight: :func:`main`); returns ``{name: ptx text}``.

    The child runs ``python -m main_module OUT_DIR NAMES``: this module, or one
    whose ``__main__`` calls :func:`main` with builds of its own (the tests' probes:
    ``tests.kernels.probe_builds``), so that this package never imports what is not
    in it."""
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    with scratch.directory("ts_moe_ptx_") as dump_dir:
        env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_KEEP="ptx,cubin",
                   CUTE_DSL_DUMP_DIR=dump_dir, TS_MOE_NO_DISK_CACHE="1")
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run([sys.executable, "-m", main_module, out_dir, json.dumps(names),
                               *(["--check"] if check else [])],
                              env=env, capture_output=True, text=True, timeout=timeout, cwd=root)
    if proc.returncode:
        raise RuntimeError(f"PTX build for {arch} failed:\n{proc.stdout}\n{proc.stderr}")
    return {p.stem: p.read_text() for p in pathlib.Path(out_dir).glob("*.ptx")}


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), check=sys.argv[3:] == ["--check"])
