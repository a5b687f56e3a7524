"""CPU: the supported DSL and TVM-FFI releases as declared once (ts_moe.toolchain) agree with
pyproject.toml, .ci/oldest.txt and the README; this process's toolchain is read as the DSL
loaded it; and the CI's two checks, scripts/compare_ptx.py (the PTX of two toolchains
against the table) and scripts/resolve_beside.py (pip beside the frameworks), judge
what they are given: the resolution itself needs the network, in CI."""

import json
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from ts_moe import toolchain

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def _script(name):
    sys.path.insert(0, str(SCRIPTS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(SCRIPTS))


def _requirements(lines) -> dict:
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            found[r.name] = r
    return found


def _floor(requirement) -> str:
    (floor,) = [s.version for s in requirement.specifier if s.operator == ">="]
    return floor


def test_the_oldest_pins_are_pyprojects_floors_in_the_frameworks_form():
    ours = _requirements(tomllib.loads((ROOT / "pyproject.toml").read_text())
                         ["project"]["dependencies"])
    oldest = _requirements((ROOT / ".ci/oldest.txt").read_text().splitlines())
    assert set(oldest) == {"nvidia-cutlass-dsl", "apache-tvm-ffi"}
    for name, pin in oldest.items():
        (exact,) = [s.version for s in pin.specifier if s.operator == "=="]
        assert exact == _floor(ours[name]), name
    assert oldest["nvidia-cutlass-dsl"].extras == {"cu13"}  # as the frameworks pin it
    assert not ours["nvidia-cutlass-dsl"].extras  # ts_moe alone keeps the cu12 flavour
    for f in toolchain.FRAMEWORKS:  # what the frameworks pin lies within our ranges
        assert f.dsl.dsl in ours["nvidia-cutlass-dsl"].specifier, f
        assert f.tvm_ffi in ours["apache-tvm-ffi"].specifier, f
        assert f.torch in ours["torch"].specifier, f


def test_the_resolver_copies_the_packages_pyproject_installs():
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["packages"]["find"]["include"]
    assert [p.rstrip("*") for p in include] == list(_script("resolve_beside").PACKAGES)


def test_every_toolchain_named_is_compared_with_the_gpu_runs_one():
    assert toolchain.COMPARED[toolchain.VERIFIED].differs == ()
    dsl_floor = _floor(_requirements(tomllib.loads((ROOT / "pyproject.toml").read_text())
                                     ["project"]["dependencies"])["nvidia-cutlass-dsl"])
    for flavor in ("cu12", "cu13"):  # the floor in both flavours: what .ci/run compiles
        assert toolchain.Toolchain(dsl_floor, flavor) in toolchain.COMPARED
    for f in toolchain.FRAMEWORKS:
        assert f.dsl in toolchain.COMPARED, f
    assert "statuses hold" in toolchain.verdict(toolchain.VERIFIED)
    assert "the statuses hold" in toolchain.verdict(toolchain.Toolchain("4.8.0", "cu13"))
    assert "not compared" in toolchain.verdict(toolchain.Toolchain("9.9.9", "cu12"))


def test_cu12_holds_by_its_own_gpu_run_and_no_other_way():
    """4.8.1 cu12's code differs from the GPU runs' in every build, so it holds only by its
    own whole-suite pass (GPU_RUNS); 4.8.0 cu12 by being byte-identical to it."""
    cu12 = toolchain.Toolchain("4.8.1", "cu12")
    assert toolchain.COMPARED[cu12].differs == toolchain.EVERY_BUILD
    run = toolchain.GPU_RUNS[cu12]
    assert "its own code on a GPU" in toolchain.verdict(cu12) and str(run) in \
        toolchain.verdict(cu12)
    assert "byte-identical to nvidia-cutlass-dsl 4.8.1 (cu12)" in toolchain.verdict(
        toolchain.Toolchain("4.8.0", "cu12"))
    without = {t: r for t, r in toolchain.GPU_RUNS.items() if t != cu12}
    with pytest.MonkeyPatch.context() as mp:  # without its run, both cu12 rows are unproven
        mp.setattr(toolchain, "GPU_RUNS", without)
        assert "every kernel unproven" in toolchain.verdict(cu12)
        assert "every kernel unproven" in toolchain.verdict(toolchain.Toolchain("4.8.0", "cu12"))


def test_each_gpu_run_is_the_noted_passing_one():
    """Each run's commit, device and summary line are those of its note, and a pass:
    nothing failed, errored, skipped or was left unrun."""
    for tc, run in toolchain.GPU_RUNS.items():
        note = (ROOT / run.evidence).read_text()
        assert run.summary in note and run.commit[:7] in note, tc
        assert "H100" in run.device and "H100" in note
        counts = dict((kind, int(n)) for n, kind in
                      re.findall(r"(\d+) (passed|failed|errors|skipped)", run.summary))
        assert counts["passed"] > 0 and counts["failed"] == counts["errors"] == \
            counts["skipped"] == 0 and "(0 not run)" in run.summary
        assert f"| {tc.flavor} |" in note


def test_this_process_toolchain_is_the_loaded_compiler():
    import cutlass
    from cutlass._mlir._mlir_libs import _cutlass_ir

    here = toolchain.current()
    assert here.dsl == cutlass.__version__
    assert re.fullmatch(r"cu\d+", here.flavor)
    assert f"_cutlass_ir.{here.flavor}." in pathlib.Path(_cutlass_ir.__file__).name
    text = "\n".join(toolchain.lines())
    assert text.startswith(f"toolchain: {here}, apache-tvm-ffi ")
    assert toolchain.verdict(here) in text


def test_readme_names_the_frameworks_and_each_toolchain_compared():
    text = (ROOT / "README.md").read_text()
    quick = text[text.index("## Quick start"):text.index("## Use")]
    for f in toolchain.FRAMEWORKS:
        assert f"`{f.requirement}`" in quick, f.requirement
    for t in toolchain.COMPARED:
        row = re.search(rf"^\| {re.escape(t.dsl)} \| {t.flavor} \|.*$", quick, re.M)
        assert row, t
        # the row's last cell says what the verdict says: the statuses hold, or not
        holds = "statuses hold" in toolchain.verdict(t)
        assert row.group(0).rstrip(" |").rsplit("|", 1)[1].strip().startswith(
            "hold" if holds else "every kernel unproven"), row.group(0)
    for run in toolchain.GPU_RUNS.values():
        assert run.commit[:7] in quick and run.evidence in quick


# ------------------------------------------------------------- scripts/compare_ptx.py
def _kept(tmp_path, name, tc, builds):
    """A ``--keep-ptx`` directory: ``toolchain.json`` and ``{build: PTX}`` for sm_90a."""
    d = tmp_path / name
    (d / "sm_90a_0").mkdir(parents=True)
    (d / "toolchain.json").write_text(json.dumps({"dsl": tc.dsl, "flavor": tc.flavor}))
    for build, ptx in builds.items():
        (d / "sm_90a_0" / f"{build}.ptx").write_text(ptx)
        (d / "sm_90a_0" / f"{build}.facts.json").write_text('{"registers": 40}')
    return str(d)


@pytest.fixture
def compare():
    return _script("compare_ptx")


PTX = ".version 9.4\n.target sm_90a\nmov.u32 %r1, 1;\n"  # the cu13 flavour's


def test_compare_ptx_passes_what_the_table_says(compare, tmp_path, capsys):
    newest = _kept(tmp_path, "a", toolchain.VERIFIED, {"g1": PTX, "g2": PTX})
    same = _kept(tmp_path, "b", toolchain.Toolchain("4.8.0", "cu13"), {"g1": PTX, "g2": PTX})
    cu12 = PTX.replace("9.4", "8.8")
    other = _kept(tmp_path, "c", toolchain.Toolchain("4.8.0", "cu12"), {"g1": cu12, "g2": cu12})
    assert compare.main([newest, same]) == 0
    assert compare.main([newest, other]) == 0
    plain = _kept(tmp_path, "d", toolchain.Toolchain("4.8.1", "cu12"), {"g1": cu12, "g2": cu12})
    assert compare.main([plain, other]) == 0  # 4.8.0 cu12 is named the same as 4.8.1 cu12
    drifted = _kept(tmp_path, "e", toolchain.Toolchain("4.8.0", "cu12"),
                    {"g1": cu12, "g2": cu12.replace("1;", "2;")})
    assert compare.main([plain, drifted]) == 1
    assert "2 of 2 builds differ: 2 in their PTX (2 only in its .version directive)" in \
        capsys.readouterr().out


def test_compare_ptx_fails_where_the_table_is_wrong(compare, tmp_path, capsys):
    newest = _kept(tmp_path, "a", toolchain.VERIFIED, {"g1": PTX, "g2": PTX})
    one_differs = _kept(tmp_path, "b", toolchain.Toolchain("4.8.0", "cu13"),
                        {"g1": PTX, "g2": PTX.replace("1;", "2;")})
    assert compare.main([newest, one_differs]) == 1
    assert "these differ but are not named: ['g2']" in capsys.readouterr().out
    unknown = _kept(tmp_path, "c", toolchain.Toolchain("4.7.1", "cu12"), {"g1": PTX, "g2": PTX})
    assert compare.main([newest, unknown]) == 1
    assert "nvidia-cutlass-dsl 4.7.1 (cu12) not in ts_moe/toolchain.py COMPARED" in \
        capsys.readouterr().out
    fewer = _kept(tmp_path, "d", toolchain.Toolchain("4.8.0", "cu13"), {"g1": PTX})
    assert compare.main([newest, fewer]) == 1
    assert "not the same builds" in capsys.readouterr().out


# ----------------------------------------------------------- scripts/resolve_beside.py
CONFLICT = """\
ERROR: Cannot install ts-moe==0.1.0 and vllm==0.33.0 because these package versions have \
conflicting dependencies.

The conflict is caused by:
    ts-moe 0.1.0 depends on apache-tvm-ffi>=0.1.15
    vllm 0.33.0 depends on apache-tvm-ffi==0.1.11

ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/\
dependency-resolution/#dealing-with-dependency-conflicts
"""
OFFLINE = """\
WARNING: Retrying (Retry(total=0)) after connection broken by 'NewConnectionError(\
"<pip._vendor.urllib3.connection.HTTPSConnection>: Failed to establish a new connection: \
[Errno -3] Temporary failure in name resolution")': /simple/vllm/
ERROR: Could not find a version that satisfies the requirement vllm==0.33.0 (from versions: none)
"""


@pytest.mark.parametrize("output, code, says", [
    (CONFLICT, 1, "FAILS: ts_moe does not install beside it: ts-moe 0.1.0 depends on "
                  "apache-tvm-ffi>=0.1.15; vllm 0.33.0 depends on apache-tvm-ffi==0.1.11"),
    (OFFLINE, 2, "NOT CHECKED: pip could not reach the package index: WARNING: Retrying"),
    ("ERROR: No matching distribution found for flashinfer-python==0.7.3\n", 2,
     "NOT CHECKED: ERROR: No matching distribution found for flashinfer-python==0.7.3"),
])
def test_resolve_beside_tells_a_conflict_from_no_check(output, code, says, monkeypatch, capsys):
    resolve = _script("resolve_beside")
    monkeypatch.setattr(resolve, "resolve", lambda *a: ({}, output))
    assert resolve.check("vllm==0.33.0", toolchain.FRAMEWORKS[0]) == code
    assert capsys.readouterr().out.startswith(f"vllm==0.33.0: {says}")


def _found(dsl, flavors, tvm, torch):
    found = {"nvidia-cutlass-dsl": (dsl, {}), "apache-tvm-ffi": (tvm, {}), "torch": (torch, {}),
             "vllm": ("0.33.0", {}), "ts-moe": ("0.1.0", {})}
    found.update({f"nvidia-cutlass-dsl-libs-{f}": (dsl, {}) for f in flavors})
    return found


def test_resolve_beside_checks_the_resolution_against_the_table(monkeypatch, capsys):
    resolve = _script("resolve_beside")
    vllm = toolchain.FRAMEWORKS[0]
    monkeypatch.setattr(resolve, "resolve",
                        lambda *a: (_found("4.8.0", ("cu12", "cu13"), "0.1.11", "2.14.0"), ""))
    assert resolve.check(vllm.requirement, vllm) == 0
    assert "as ts_moe/toolchain.py FRAMEWORKS says" in capsys.readouterr().out
    monkeypatch.setattr(resolve, "resolve",
                        lambda *a: (_found("4.8.1", ("cu12",), "0.1.11", "2.14.0"), ""))
    assert resolve.check(vllm.requirement, vllm) == 1
    assert "nvidia-cutlass-dsl 4.8.1, not 4.8.0; no cu13 flavour" in capsys.readouterr().out


def test_resolve_beside_reads_the_newest_releases_pins(monkeypatch, capsys):
    resolve = _script("resolve_beside")
    ours = {"requires_dist": ["nvidia-cutlass-dsl<4.9,>=4.8.0", "apache-tvm-ffi>=0.1.11",
                              "torch>=2.8"]}
    theirs = {"requires_dist": ["nvidia-cutlass-dsl[cu13]==4.9.0", "apache-tvm-ffi==0.1.11",
                                "torch==2.15.0", "tensorizer==2.10.1; extra == \"tensorizer\""]}
    monkeypatch.setattr(resolve, "resolve",
                        lambda *a: ({"vllm": ("0.35.0", theirs), "ts-moe": ("0.1.0", ours)}, ""))
    assert resolve.newest(toolchain.FRAMEWORKS[0]) == 1
    out = capsys.readouterr().out
    assert out.startswith("vllm 0.35.0 (the newest release): pins nvidia-cutlass-dsl[cu13]"
                          "==4.9.0, apache-tvm-ffi==0.1.11, torch==2.15.0; FAILS")
    assert "nvidia-cutlass-dsl==4.9.0, outside ts_moe's nvidia-cutlass-dsl<4.9,>=4.8.0" in out


def test_resolve_beside_runs_pip_from_no_callers_directory(tmp_path, monkeypatch):
    """A ``pip/`` in the directory the script is run from is never imported in pip's place
    (``python -m`` puts its working directory first on the path).  The command as the
    script starts it, asked for pip's version only (no index needed)."""
    resolve = _script("resolve_beside")
    planted = tmp_path / "pip"
    planted.mkdir()
    for name in ("__init__.py", "__main__.py"):
        (planted / name).write_text("import pathlib\n"
                                    "pathlib.Path(__file__).parent.with_name('imported')"
                                    ".write_text('planted pip')\n"
                                    "raise SystemExit(97)\n")
    monkeypatch.chdir(tmp_path)
    real_run, ran = subprocess.run, []

    def pip_version(args, **kwargs):
        ran.append(real_run([*args[:args.index("pip") + 1], "--version"], **kwargs))
        return subprocess.CompletedProcess(args, 1, ran[-1].stdout)

    monkeypatch.setattr(resolve.subprocess, "run", pip_version)
    assert resolve.resolve("vllm==0.33.0") == ({}, ran[0].stdout)
    assert ran[0].returncode == 0 and ran[0].stdout.startswith("pip "), ran[0].stdout
    assert not (tmp_path / "imported").exists()
