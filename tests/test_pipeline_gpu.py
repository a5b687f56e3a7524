"""The P-warp TMA ring on the GPU: random data through 1024 stages per CTA on
every SM, P = 1..4 producer warps, 2..6 stages, bit-exact, bounded in time."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.gpu
def test_p_warp_ring_moves_every_byte_without_hanging():
    # a subprocess, so that a hung barrier is killed by the timeout instead of
    # hanging the test session; it gets the memory this process cached
    torch.cuda.empty_cache()
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.pipeline_probe_sm90"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    print(proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("P=")]
    assert len(lines) == 4 * 5
    assert all(ln.endswith("bit-exact=True") for ln in lines)
    assert proc.returncode == 0
