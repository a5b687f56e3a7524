"""TS_MOE_PDL set after import reaches the next kernel build: its PTX has the
griddepcontrol entry with the switch on and none with it off (one fresh process,
the switch flipped after every import; compiled without a GPU)."""

import json

from .ptxas import run_for_arch

SCRIPT = """
import json, os, pathlib, sys
from csrc_free_kernels import ptx_dump
from csrc_free_kernels.common import pdl
from csrc_free_kernels.common.compile import compile_build

dump_dir = pathlib.Path(os.environ["CUTE_DSL_DUMP_DIR"])
seen = {}
for value in ("0", "1", "0"):
    os.environ["TS_MOE_PDL"] = value
    compile_build(ptx_dump.BUILDS["router_logits"])
    ptx = max(dump_dir.glob("*.ptx"), key=lambda p: p.stat().st_mtime_ns).read_text()
    seen.setdefault(value, []).append(
        [pdl.ENABLED, "griddepcontrol.wait;" in ptx, "griddepcontrol.launch_dependents;" in ptx])
print(json.dumps(seen))
"""


def test_the_pdl_switch_set_after_import_reaches_the_next_build(tmp_path, monkeypatch):
    monkeypatch.delenv("TS_MOE_PDL", raising=False)
    monkeypatch.setenv("CUTE_DSL_KEEP", "ptx")
    monkeypatch.setenv("CUTE_DSL_DUMP_DIR", str(tmp_path))
    out = run_for_arch("sm_90a", ["-c", SCRIPT])
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {"0": [[False, False, False]] * 2, "1": [[True, True, True]]}, seen


def test_the_pdl_switch_is_read_at_each_use(monkeypatch):
    from csrc_free_kernels.common import pdl

    monkeypatch.setenv("TS_MOE_PDL", "0")
    assert pdl.ENABLED is False and pdl.enabled() is False
    monkeypatch.setenv("TS_MOE_PDL", "1")
    assert pdl.ENABLED is True
    monkeypatch.delenv("TS_MOE_PDL")
    assert pdl.ENABLED is True
