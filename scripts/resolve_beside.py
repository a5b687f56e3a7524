#!/usr/bin/env python3
"""Check that pip resolves this checkout beside each framework release of ts_moe/toolchain.py.

    python scripts/resolve_beside.py [--newest] [REQUIREMENT ...]

For each framework release (default: those of ``toolchain.FRAMEWORKS``), ``pip install
--dry-run --ignore-installed --report`` of this checkout together with it (nothing is
installed), then checks that the resolution holds the DSL, TVM-FFI and torch releases
``toolchain.FRAMEWORKS`` names for it, with the DSL's cu13 flavour, and that the DSL
release is one ``toolchain.COMPARED`` has compared; a release not named there is only
resolved and reported.  Give releases pinned (``vllm==0.34.0``): unpinned, pip backtracks
to whichever old release fits.

``--newest`` also reads the newest release of each framework (its metadata alone, no
resolution) and checks that its pins of the packages ts_moe requires fall within ts_moe's
ranges: the early warning that a release has moved its pins.

One line per check; exit 0 if all pass, 1 if one conflicts (pip's reason quoted) or
differs from what is named, 2 if it could not be checked (the index unreachable, a
package missing from it: a failure, not a pass).  Needs pip 23.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from ts_moe import toolchain  # noqa: E402

PACKAGES = ("ts_moe", "ts_pipeline", "csrc_free_kernels")  # pyproject's packages.find
# pip's words when it could not reach an index
_OFFLINE = re.compile(r"NewConnectionError|Failed to establish a new connection|"
                      r"Temporary failure in name resolution|Network is unreachable|"
                      r"ConnectTimeout|ReadTimeout|\(from versions: none\)")


def resolve(requirement: str, *options: str) -> tuple[dict, str]:
    """``({name: (version, metadata)}, "")`` of the dry run's resolution, or ``({}, pip's
    output)``.  pip builds the metadata of a copy of the checkout (what the package is
    made of), so that nothing is written into the checkout.  pip runs in the scratch
    folder with no working directory on its path (``PYTHONSAFEPATH``): a ``pip/`` in
    the caller's directory is never imported in its place, as ``python -m`` would."""
    with tempfile.TemporaryDirectory(prefix="ts_moe_resolve_") as scratch:
        project = Path(scratch) / "ts_moe"
        project.mkdir()
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            shutil.copy2(ROOT / name, project / name)
        for package in PACKAGES:
            shutil.copytree(ROOT / package, project / package,
                            ignore=shutil.ignore_patterns("__pycache__"))
        report = Path(scratch) / "report.json"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
             "--no-input", "--progress-bar", "off", "--report", str(report), *options,
             str(project), requirement],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=scratch,
            env=dict(os.environ, PIP_NO_INPUT="1", PYTHONSAFEPATH="1"))
        if proc.returncode:
            return {}, proc.stdout
        found = json.loads(report.read_text())["install"]
    return {canonicalize_name(item["metadata"]["name"]): (item["metadata"]["version"],
                                                          item["metadata"])
            for item in found}, ""


def conflict(output: str) -> str:
    """pip's explanation of a conflict: its lines naming who requires what."""
    return "; ".join(line.strip() for line in output.splitlines()
                     if " depends on " in line or "The user requested" in line)


def not_checked(output: str) -> str:
    """Why pip found no resolution other than a conflict with ts_moe: the index
    unreachable, or pip's first error."""
    lines = [s.strip() for s in output.splitlines()]
    offline = [s for s in lines if _OFFLINE.search(s)]
    if offline:
        return f"pip could not reach the package index: {offline[0]}"
    errors = [s for s in lines if s.startswith(("ERROR", "error"))]
    return errors[0] if errors else (lines[-1] if lines else "pip said nothing")


def summary(found: dict) -> str:
    dsl = found.get("nvidia-cutlass-dsl", ("absent",))[0]
    flavors = sorted(name.rsplit("-", 1)[1] for name in found
                     if re.fullmatch(r"nvidia-cutlass-dsl-libs-cu\d+", name))
    return (f"nvidia-cutlass-dsl {dsl} (flavours {', '.join(flavors) or 'none'}), "
            f"apache-tvm-ffi {found.get('apache-tvm-ffi', ('absent',))[0]}, "
            f"torch {found.get('torch', ('absent',))[0]}")


def mismatches(framework: toolchain.Framework, found: dict) -> list[str]:
    """How the resolution differs from what ``framework`` names, and whether its DSL
    release is compared."""
    bad = []
    for name, want in (("nvidia-cutlass-dsl", framework.dsl.dsl),
                       ("apache-tvm-ffi", framework.tvm_ffi), ("torch", framework.torch)):
        got = found.get(name, ("absent",))[0]
        if got != want:
            bad.append(f"{name} {got}, not {want}")
    if f"nvidia-cutlass-dsl-libs-{framework.dsl.flavor}" not in found:
        bad.append(f"no {framework.dsl.flavor} flavour of the DSL")
    if framework.dsl not in toolchain.COMPARED:
        bad.append(f"{framework.dsl} is not in toolchain.COMPARED")
    return bad


def check(requirement: str, framework: toolchain.Framework | None) -> int:
    found, output = resolve(requirement)
    if not found:
        why = conflict(output)
        if "ResolutionImpossible" in output and "ts-moe" in why:
            print(f"{requirement}: FAILS: ts_moe does not install beside it: {why}")
            return 1
        print(f"{requirement}: NOT CHECKED: {not_checked(output)}")
        return 2
    name = canonicalize_name(Requirement(requirement).name)
    release = f"{name} {found[name][0]}" if name in found else requirement
    line = f"{requirement}: resolves ({release}): {summary(found)}"
    if framework is None:
        print(line)
        return 0
    bad = mismatches(framework, found)
    if bad:
        print(f"{line}; FAILS: not what ts_moe/toolchain.py FRAMEWORKS says: {'; '.join(bad)}")
        return 1
    print(f"{line}; as ts_moe/toolchain.py FRAMEWORKS says; its kernels: "
          f"{toolchain.verdict(framework.dsl)}")
    return 0


def newest(framework: toolchain.Framework) -> int:
    """Whether the framework's newest release pins the packages ts_moe requires within
    ts_moe's ranges (``==`` pins; a range is reported, not checked)."""
    name = canonicalize_name(Requirement(framework.requirement).name)
    found, output = resolve(name, "--no-deps")
    if not found:
        print(f"{name} (the newest release): NOT CHECKED: {not_checked(output)}")
        return 2
    version, metadata = found[name]
    ours = {canonicalize_name(r.name): r
            for r in map(Requirement, found["ts-moe"][1].get("requires_dist", []))
            if r.marker is None}
    pins, outside = [], []
    for theirs in map(Requirement, metadata.get("requires_dist", [])):
        mine = ours.get(canonicalize_name(theirs.name))
        if mine is None or (theirs.marker and not theirs.marker.evaluate({"extra": ""})):
            continue
        exact = [s.version for s in theirs.specifier if s.operator == "=="]
        if theirs.specifier:
            pins.append(str(theirs).split(";")[0])
        if exact and exact[0] not in mine.specifier:
            outside.append(f"{theirs.name}=={exact[0]}, outside ts_moe's "
                           f"{theirs.name}{mine.specifier}")
    head = (f"{name} {version} (the newest release): pins "
            f"{', '.join(pins) or 'nothing ts_moe requires'}")
    if outside:
        print(f"{head}; FAILS: ts_moe would not install beside it: {'; '.join(outside)}")
        return 1
    print(f"{head}: within ts_moe's ranges (resolve it whole: python "
          f"scripts/resolve_beside.py {name}=={version})")
    return 0


def main(argv: list[str]) -> int:
    import pip

    if int(pip.__version__.split(".")[0]) < 23:
        print(f"pip {pip.__version__}: needs pip 23 or newer (--dry-run --report)")
        return 2
    named = {f.requirement: f for f in toolchain.FRAMEWORKS}
    asked = [a for a in argv if a != "--newest"]
    codes = [check(r, named.get(r)) for r in (asked or named)]
    if "--newest" in argv:
        codes += [newest(f) for f in toolchain.FRAMEWORKS]
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
