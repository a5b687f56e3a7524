"""ptxas for the PTX tests: assemble a kernel's PTX on the CPU and read its report."""

import os
import re
import shutil
import subprocess
import sys

import pytest

PTXAS = shutil.which("ptxas") or ("/usr/local/bin/ptxas" if os.path.exists("/usr/local/bin/ptxas")
                                  else None)
NO_SPILLS = "0 bytes spill stores, 0 bytes spill loads"


def assemble(ptx_text: str, arch: str, tmp_path) -> str:
    """``ptxas -v`` of ``ptx_text`` for ``arch`` (e.g. "sm_90a"); its report, after
    asserting that it assembled."""
    src = tmp_path / "kernel.ptx"
    src.write_text(ptx_text)
    proc = subprocess.run([PTXAS, f"-arch={arch}", "-v", str(src), "-o", str(tmp_path / "k")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def registers(report: str) -> int:
    return int(re.search(r"Used (\d+) registers", report).group(1))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_for_arch(arch: str, args: list, timeout: float = 600, extra_env=None) -> str:
    """``python *args`` in a fresh process that compiles for ``arch`` (CuTeDSL
    reads ``CUTE_DSL_ARCH`` once) without the disk cache, with ``extra_env``; its
    stdout, after asserting that it succeeded."""
    env = dict(os.environ, CUTE_DSL_ARCH=arch, TS_MOE_NO_DISK_CACHE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(extra_env or {}))
    proc = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# an instruction that reads or writes global memory (loads, stores, atomics,
# TMA and cp.async copies); ld.param, prefetch.tensormap and cvta do not
_GLOBAL_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld|st|atom|red|cp\.async|cp\.reduce\.async)"
                            r"[\w.:]*\.global", re.M)


def assert_pdl_entry(ptx_text: str) -> None:
    """A kernel launched with programmatic dependent launch waits for the stream
    ahead (``griddepcontrol.wait``) before any global access, and only then lets
    its dependents launch; with ``TS_MOE_PDL=0``, neither instruction."""
    from csrc_free_kernels.common import pdl

    body = ptx_text[ptx_text.index(".entry"):]
    wait = body.find("griddepcontrol.wait;")
    launch = body.find("griddepcontrol.launch_dependents;")
    if not pdl.ENABLED:
        assert wait < 0 and launch < 0
        return
    first = _GLOBAL_ACCESS.search(body)
    assert 0 <= wait < launch, "griddepcontrol.wait, then launch_dependents"
    assert first is not None and first.start() > wait, body[first.start():first.start() + 120]
    assert body.count("griddepcontrol.wait;") == 1


def assert_pdl_prefetch_entry(ptx_text: str) -> None:
    """A GEMM built with ``prefetch_weights``: before its first
    ``griddepcontrol.wait`` it reads ``offs`` from L2 only (``ld.global.cg``),
    never writes; every role waits once more before touching the tokens or
    the output, and each wait is followed by ``launch_dependents``."""
    from csrc_free_kernels.common import pdl

    body = ptx_text[ptx_text.index(".entry"):]
    waits = [m.start() for m in re.finditer(r"griddepcontrol\.wait;", body)]
    if not pdl.ENABLED:
        assert not waits and "griddepcontrol.launch_dependents;" not in body
        return
    assert len(waits) >= 3, "warp 0 and the idle warps, the weight warps, the MMA warps"
    for w in waits:  # the next griddepcontrol after each wait lets the dependents launch
        following = re.search(r"griddepcontrol\.(\w+);", body[w + 1:])
        assert following and following.group(1) == "launch_dependents"
    assert body.count("griddepcontrol.launch_dependents;") == len(waits)
    early = [body[m.start():body.index("\n", m.start())]
             for m in _GLOBAL_ACCESS.finditer(body[:waits[0]])]
    assert early and all(re.search(r"\bld\.global\.cg\.", e) for e in early), early
    assert not re.search(r"\bld\.global(?!\.cg\.)", body), "every offs read from L2"
    first_token_load = re.search(r"cp\.async\.bulk\.tensor\.2d", body).start()
    # thread stores, or (store_warp) bulk copies of staged rows to global memory
    first_store = re.search(r"\bst\.global|\bcp\.async\.bulk\.global\.", body).start()
    assert waits[0] < first_token_load and waits[0] < first_store


class PtxStore:
    """Each build of ``csrc_free_kernels.ptx_dump.BUILDS`` and of the probes
    (``tests.kernels.probe_builds.BUILDS``) compiled at most once per test session
    (the PTX tests and the pre-flight read the same compile): ``get`` compiles the
    builds it has not seen, for one arch, in one fresh process."""

    def __init__(self, directory):
        self.directory = directory
        self.ptx: dict = {}

    def get(self, arch: str, builds: list) -> dict:
        from csrc_free_kernels import ptx_dump

        from .kernels import probe_builds

        missing = [b for b in builds if (arch, b) not in self.ptx]
        if missing:
            out = self.directory / f"{arch}_{len(self.ptx)}"
            out.mkdir()
            for name, text in ptx_dump.dump(arch, missing, str(out), timeout=3600,
                                            main_module=probe_builds.MODULE).items():
                self.ptx[arch, name] = text
        return {b: self.ptx[arch, b] for b in builds if (arch, b) in self.ptx}

    def facts(self, arch: str, build: str):
        """The build's :class:`csrc_free_kernels.preflight.trace.BuildFacts`."""
        from csrc_free_kernels.preflight.trace import BuildFacts

        self.get(arch, [build])
        found = sorted(self.directory.glob(f"{arch}_*/{build}.facts.json"))
        return BuildFacts.from_json(found[0].read_text())


def ptx_fixture(arch: str, builds: list, name: str = "ptx"):
    """A module-scoped fixture ``name``: {build: PTX} of ``builds`` (names of
    ``tests.kernels.probe_builds.ALL_BUILDS``) compiled for ``arch``, from the session's
    :class:`PtxStore` (``ptx_store``, tests/conftest.py)."""
    def compiled(ptx_store):
        return ptx_store.get(arch, builds)

    return pytest.fixture(scope="module", name=name)(compiled)
