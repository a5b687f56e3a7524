"""pytest plugin of ``scripts/gpu_check.py``: at the end of a file's run, how many kernels
the process compiled or loaded from the kernel cache, and the seconds each took
(``csrc_free_kernels.common.compile.stats``), written to ``--gpu-check-stats``."""

import json
import pathlib
import sys


def pytest_addoption(parser):
    parser.addoption("--gpu-check-stats", default=None,
                     help="write the kernels compiled and loaded here (JSON)")


def pytest_sessionfinish(session):
    path = session.config.getoption("--gpu-check-stats")
    compile_module = sys.modules.get("csrc_free_kernels.common.compile")
    if not path:
        return
    stats = compile_module.stats if compile_module is not None else []
    found = {"compiled": 0, "loaded": 0, "compile_s": 0.0, "load_s": 0.0}
    for _, seconds, how in stats:
        found[how] += 1
        found["compile_s" if how == "compiled" else "load_s"] += seconds
    found["compile_s"], found["load_s"] = round(found["compile_s"], 1), round(found["load_s"], 2)
    pathlib.Path(path).write_text(json.dumps(found))
