"""CPU: the pre-flight gates every build that can reach a GPU.  A call's compile
(``csrc_free_kernels.common.compile.get_compiled``) puts the build through the
pre-flight and refuses one that breaks a rule, naming the build, the rule and the PTX
line, once per process: the op's call then takes the next path, with one warning, and
``ts-moe info`` lists the refusal.  CI pre-flights every build a call can reach (the
demo's compile and the PTX tests each family's checked builds, ``.ci/run`` the others)."""

import pytest
import torch

from csrc_free_kernels import preflight
from csrc_free_kernels.common import compile as kcompile
from csrc_free_kernels.families import FAMILIES


@pytest.fixture
def memory_only(monkeypatch):
    """Compiles in this process, nothing read from or written to the disk cache."""
    from csrc_free_kernels.common import settings as ksettings

    monkeypatch.setattr(ksettings.settings, "disk_cache", False)
    monkeypatch.setattr(kcompile, "_memory", {})


def _swiglu_build():
    from csrc_free_kernels.hopper import swiglu_sm90_launch as s

    return s.build(torch.bfloat16, False)


def test_a_call_compiles_through_the_preflight(memory_only, monkeypatch):
    checked = []
    real = preflight.check

    def spy(build, ptx, facts):
        checked.append((build, ".entry" in ptx, facts.registers))
        return real(build, ptx, facts)

    monkeypatch.setattr(preflight, "check", spy)
    b = _swiglu_build()
    fn = kcompile.get_compiled(b)
    assert fn is not None and kcompile.stats[-1][2] == "compiled"
    (seen,) = checked
    assert seen[0] == "swiglu_ew_fwd" and seen[1] and seen[2] > 0
    assert kcompile.get_compiled(b) is fn and len(checked) == 1  # once per build


REFUSED = """
import json
from csrc_free_kernels import preflight
from csrc_free_kernels.common import compile as kcompile
from csrc_free_kernels.hopper import grouped_gemm_sm90_config as c
from csrc_free_kernels.hopper import grouped_gemm_sm90_launch as g

real = preflight.collect
collected = []


def planted(dump, facts):  # setmaxnreg off its multiple of 8: refused by the GPU
    collected.append(dump)
    return real(dump, facts).replace("setmaxnreg.inc.sync.aligned.u32 \\t240;",
                                     "setmaxnreg.inc.sync.aligned.u32 \\t244;")


preflight.collect = planted
try:
    kcompile.get_compiled(g.build(c.DECODE16))
    said = None
except kcompile.PreflightError as exc:
    said = str(exc)
try:  # a later call: the same refusal, without compiling and checking again
    kcompile.get_compiled(g.build(c.DECODE16))
    again = None
except kcompile.PreflightError as exc:
    again = str(exc)
print(json.dumps({"said": said, "again": again, "checks": len(collected),
                  "kept": len(kcompile._memory)}))
"""


def test_a_build_that_breaks_a_rule_is_refused_before_any_launch():
    """A build whose PTX carries a setmaxnreg the GPU refuses raises, naming the
    build and the rule; nothing is kept for a later call, which raises the same error
    without compiling the build again (sm_90a, a process of its own)."""
    import json

    from .ptxas import run_for_arch

    got = json.loads(run_for_arch("sm_90a", ["-c", REFUSED]).strip().splitlines()[-1])
    assert got["kept"] == 0 and got["said"] is not None
    assert "gemm_decode16" in got["said"] and "not launched" in got["said"]
    assert "setmaxnreg" in got["said"]
    assert got["again"] == got["said"] and got["checks"] == 1


FALLS_BACK = """
import json, re, warnings
from types import SimpleNamespace

import torch

from csrc_free_kernels import preflight
from csrc_free_kernels.common import refusals
from csrc_free_kernels.hopper.grouped_gemm_sm90_config import choose_config
from ts_moe import info_cli
from ts_moe.ops import gemm, paths

real = preflight.collect
planted_in = []


def planted(dump, facts):  # the first setmaxnreg off its multiple of 8: the GPU refuses it
    text, n = re.subn(r"(setmaxnreg\\.inc\\.sync\\.aligned\\.u32\\s+)(\\d+);",
                      lambda m: f"{m[1]}{int(m[2]) + 4};", real(dump, facts), count=1)
    planted_in.append(n)
    return text


preflight.collect = planted
paths.device_capability = lambda t: (9, 0)  # CPU tensors take an H100's paths
torch.cuda.get_device_properties = lambda index: SimpleNamespace(multi_processor_count=132)
g = torch.Generator().manual_seed(0)
a = torch.randn(40, 64, generator=g).half()
b = (torch.randn(4, 64, 48, generator=g) / 8).half()
offs = torch.tensor([9, 9, 29, 37], dtype=torch.int32)
want = gemm.run(None, a, b, offs)  # the reference path
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = [gemm._cuda(a, b, offs) for _ in range(3)]
print(json.dumps({
    "build": "gemm_" + choose_config(4, 48, 64, 40).name + "_fp16",
    "paths": [p.name for p in paths.paths_for(paths.Op.GROUPED_GEMM, (9, 0), torch.float16)],
    "equal": [torch.equal(out, want) for out in got],
    "warned": [str(w.message) for w in caught if w.category is refusals.RefusedBuildWarning],
    "planted": planted_in,
    "refused": [r.build for r in refusals.refused()],
    "info": info_cli.lines("H100", (9, 0)),
}))
"""


def test_a_refused_build_sends_the_call_to_the_next_path_with_one_warning():
    """An fp16 call whose kernel build breaks a rule (a setmaxnreg planted into its PTX)
    gets the reference's result, the next path of its table, at every call; one warning
    names the build and the rule; the build is compiled and checked once; ``info``
    lists the refusal (sm_90a, a process of its own)."""
    import json

    from .ptxas import run_for_arch

    got = json.loads(run_for_arch("sm_90a", ["-c", FALLS_BACK]).strip().splitlines()[-1])
    assert got["paths"] == ["KERNEL_SM90", "REFERENCE"]
    assert got["planted"] == [1]  # one compile, one check, the rule broken
    assert got["equal"] == [True, True, True]
    (warned,) = got["warned"]
    assert f"the {got['build']} kernel build" in warned and "rule setmaxnreg" in warned
    assert "next path" in warned
    assert got["refused"] == [got["build"]]
    head = got["info"].index(next(line for line in got["info"] if "pre-flight refused" in line))
    assert got["info"][head + 1] == f"  {got['build']}: breaks setmaxnreg"


def test_ci_preflights_every_reachable_build():
    """CI pre-flights every build a call can reach: the demo's compile step the builds each
    family checks (``Kernels.checked``, which the PTX tests compile too; each family says
    why in its ``checked``), and ``.ci/run``'s ``python -m ts_moe compile --builds
    unchecked`` beside the suite every other one; the two are disjoint and together the
    build space (``ptx_dump.space``)."""
    import pathlib

    from csrc_free_kernels import ptx_dump
    from ts_moe import compile_cli

    for family in FAMILIES:
        assert family.load().checked.__doc__, family.name  # the family's reason, in words
    for arch in compile_cli.ARCHES:
        names = {which: [b.name for _, found in compile_cli.builds(arch, which=which)
                         for b in found] for which in compile_cli.WHICH}
        checked, unchecked = set(names["checked"]), set(names["unchecked"])
        assert checked and not checked & unchecked, arch
        assert checked | unchecked == set(names["reachable"]) == {
            n for n, (family, _, _) in ptx_dump.space().items() if family.arch == arch}, arch
    ci = (pathlib.Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    steps = [line for line in ci.splitlines() if not line.lstrip().startswith("#")]
    assert any("python -m ts_moe compile --builds unchecked" in line for line in steps)
    assert any("run_in_venv .venv-demo 1" in line for line in steps)  # the demo, checked
