"""CPU: the two scripts the next GPU run starts with are ready: ``scripts/gpu_check.py``
(the GPU suite, each file in its own process, one JSON) and
``scripts/fp8_first_launch_diag.py`` (the FP8 kernels' first launches with the aligned
and unaligned controls, and the old scale-box layout rebuilt exactly)."""

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

from .ptxas import ROOT, run_for_arch

SCRIPTS = pathlib.Path(ROOT) / "scripts"
DATA = pathlib.Path(__file__).parent / "data"


def _run(args, tmp_path, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("PYTEST_ADDOPTS", None)  # this session's options (CI's --keep-ptx) are not the child's
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_gpu_check_runs_each_file_and_writes_one_summary(tmp_path):
    out = tmp_path / "check.json"
    proc = _run([str(SCRIPTS / "gpu_check.py"), "--no-warm", "--out", str(out), "--commit",
                 "abc123", str(pathlib.Path(ROOT) / "tests/test_swiglu_elementwise_gpu.py"),
                 str(pathlib.Path(ROOT) / "tests/test_fp8_gpu.py")], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(out.read_text())
    assert [f["file"] for f in found["files"]] == ["test_swiglu_elementwise_gpu.py",
                                                   "test_fp8_gpu.py"]
    for f in found["files"]:
        assert f["kernels"] == {"compiled": 0, "loaded": 0, "compile_s": 0.0, "load_s": 0.0}
        assert f["counts"]["skipped"] > 0  # no sm_90 GPU here: every gpu test skips
    assert found["provenance"]["commit"] == "abc123"  # the given commit wins
    log = out.with_suffix(".log").read_text()  # each file's whole output, in order
    assert log.index("===== test_swiglu_elementwise_gpu.py (rc 0") < log.index(
        "===== test_fp8_gpu.py (rc 0") and log.count(" skipped") >= 2
    assert "output" not in found["files"][0]
    assert re.fullmatch(r"GPU check: 0 passed, 0 failed, 0 errors, \d+ skipped in 2 files "
                        r"\(0 not run\), \d+ s; kernels compiled in the files 0 s",
                        found["summary"])
    assert found["summary"] in proc.stdout


def test_gpu_check_budget_and_file_order(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPTS))
    files = [p.name for p in gpu_check.gpu_test_files()]
    assert files[0].startswith("test_fp8") and "test_grouped_gemm_gpu.py" in files
    assert all("pytest.mark.gpu" in (pathlib.Path(ROOT) / "tests" / f).read_text() for f in files)
    assert "test_gpu_scripts.py" not in files  # it names the marker, in a string
    out = tmp_path / "check.json"
    proc = _run([str(SCRIPTS / "gpu_check.py"), "--no-warm", "--budget", "0", "--out",
                 str(out), str(pathlib.Path(ROOT) / "tests/test_fp8_gpu.py")], tmp_path)
    assert proc.returncode == 1  # a file not run is not a clean pass
    assert json.loads(out.read_text())["not_run"] == ["test_fp8_gpu.py"]


def test_diag_jobs_have_the_discriminating_controls():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import fp8_first_launch_diag as diag
    finally:
        sys.path.remove(str(SCRIPTS))
    starts = lambda counts: [sum(counts[:i]) for i in range(len(counts))]  # noqa: E731
    assert all(s % 4 == 0 for s in starts(diag.ALIGNED))
    assert any(s % 4 for s in starts(diag.UNALIGNED))
    kernel = [j for j in diag.jobs() if j[0] == "kernel"]
    for layout in ("fixed", "old"):
        for counts in (diag.ALIGNED, diag.UNALIGNED):
            assert ("kernel", "fp8_decode16", "blockwise", layout, counts) in kernel
    assert not [j for j in kernel if j[3] == "old" and j[2] != "blockwise"]


def test_diag_old_layout_is_the_build_that_faulted():
    """The diag's old scale box, rebuilt from the fixed kernel's hooks, compiles to the
    PTX of the build that ran on the H200 (kernel names aside), so the A/B on the GPU
    compares exactly that build with the fix."""
    code = (
        "import os, sys, cutlass, cutlass.cute as cute\n"
        f"sys.path.insert(0, {str(SCRIPTS)!r})\n"
        "from fp8_first_launch_diag import old_scale_box_class\n"
        "from csrc_free_kernels.preflight import trace as preflight_trace\n"
        "from csrc_free_kernels.fp8.grouped_gemm_fp8_sm90_config import CONFIGS\n"
        "from csrc_free_kernels.fp8.grouped_gemm_fp8_sm90_launch import fake_args\n"
        "k = old_scale_box_class()(CONFIGS['fp8_decode16'], 'blockwise')\n"
        "with preflight_trace.recording() as facts:\n"
        "    cute.compile(k, *fake_args('blockwise', cutlass.BFloat16), cutlass.Int32(1),\n"
        "                 cute.runtime.make_fake_stream())\n"
        "print(preflight_trace.collect(os.environ['CUTE_DSL_DUMP_DIR'], facts))\n")
    with tempfile.TemporaryDirectory() as dump:
        ptx = run_for_arch("sm_90a", ["-c", code],
                           extra_env={"CUTE_DSL_KEEP": "ptx,cubin", "CUTE_DSL_DUMP_DIR": dump})

    def norm(text):
        return re.sub(r"kernel_cutlass_kernel_\w+", "KERNEL", text).strip()

    old = (DATA / "fp8_decode16_blockwise_b40e1e3.ptx").read_text()
    assert norm(ptx) == norm(old)
