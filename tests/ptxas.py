"""ptxas for the PTX tests: assemble a kernel's PTX on the CPU and read its report."""

import os
import re
import shutil
import subprocess
import sys

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


def run_for_arch(arch: str, args: list, timeout: float = 600) -> str:
    """``python *args`` in a fresh process that compiles for ``arch`` (CuTeDSL
    reads ``CUTE_DSL_ARCH`` once) without the disk cache; its stdout, after
    asserting that it succeeded."""
    env = dict(os.environ, CUTE_DSL_ARCH=arch, TS_MOE_NO_DISK_CACHE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
