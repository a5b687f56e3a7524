"""ptxas for the PTX tests: assemble a kernel's PTX on the CPU and read its report."""

import os
import re
import shutil
import subprocess

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
