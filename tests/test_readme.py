"""The README as a new user meets it: the quick start on the first screen, every Python
block running alone as copied (in a fresh process and a scratch directory, on the CPU in
CI, on the GPU where there is one), and nothing it points to outside the repository."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
FIRST_SCREEN = 40  # lines


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_quick_start_is_on_the_first_screen():
    lines = README.read_text().splitlines()
    start = lines.index("## Quick start")
    block = lines.index("```bash", start)
    commands = lines[block + 1:lines.index("```", block + 1)]
    assert block < FIRST_SCREEN - len(commands) - 1
    assert [c.split(" && ")[1] for c in commands] == ["python -m ts_moe demo",
                                                      "python -m pytest -q"]
    assert not any(line.startswith("## ") for line in lines[1:start])  # one paragraph first
    quick = "\n".join(lines[start:lines.index("## Use")])
    # the time each command takes, as CI measured it
    assert re.search(r"the tests about \d+ minutes", quick) and "H200" in quick
    assert "CPU-only build" in quick


def test_readme_shows_the_public_ops_and_has_its_sections():
    text = README.read_text()
    blocks = python_blocks()
    assert len(blocks) >= 5
    ops = next(b for b in blocks if "ts_moe.grouped_gemm(" in b)
    for name in ("route", "permute", "grouped_gemm_swiglu", "grouped_gemm", "combine"):
        assert f"ts_moe.{name}(" in ops
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert headings[:2] == ["Quick start", "Use"]
    assert {"Features", "Which path a call takes", "Kernel cache", "Status",
            "Benchmarks"} <= set(headings)
    assert headings.index("Features") < headings.index("Which path a call takes") \
        < headings.index("Status")


def test_readme_points_only_inside_the_repository():
    text = README.read_text()
    assert not re.search(r"\bissues? \d+\b", text, flags=re.I)
    for path in re.findall(r"`((?:bench|ts_moe|csrc_free_kernels|ts_pipeline|tests|scripts)"
                           r"/[\w./-]*\w)`", text):
        if "*" not in path:
            assert (REPO / path).exists(), path


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_each_python_block_runs_alone(index, tmp_path):
    block = python_blocks()[index]
    if "transformers" in block and importlib.util.find_spec("transformers") is None:
        pytest.skip("the hf extra (transformers) is not installed")
    script = tmp_path / "block.py"
    script.write_text(block)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"README python block {index}:\n{block}\n{proc.stderr}"
