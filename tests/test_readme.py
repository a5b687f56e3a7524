"""The README's Python blocks run as written (on the CPU in CI; on the GPU where
there is one), one after the other in one namespace, in a scratch directory."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_a_complete_example():
    blocks = python_blocks()
    assert len(blocks) >= 2
    assert "ts_moe.grouped_gemm(" in blocks[0] and "offs" in blocks[0]


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(python_blocks()):
        if "transformers" in block:
            pytest.importorskip("transformers")
        exec(compile(block, f"README.md python block {i}", "exec"), namespace)  # noqa: S102
    assert namespace["out"].shape == (namespace["T"], namespace["H"])
    assert namespace["logits"].shape[-1] == 256
