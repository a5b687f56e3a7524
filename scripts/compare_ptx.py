#!/usr/bin/env python3
"""Compare the kernels' PTX from two toolchains, and check it against ts_moe/toolchain.py.

    python -m pytest -q --keep-ptx=DIR_A tests/test_preflight.py    # on one toolchain
    python -m pytest -q --keep-ptx=DIR_B tests/test_preflight.py    # on another
    python scripts/compare_ptx.py DIR_A DIR_B

Each directory holds what a test session compiled (``--keep-ptx``, tests/conftest.py):
``toolchain.json``, and per arch each build's PTX and pre-flight facts.  Both must hold the
same builds.  A build differs if its PTX or its facts differ by a byte.  Where one side is
a toolchain whose PTX is that of the GPU runs (``toolchain.COMPARED``: nothing differs),
the builds that differ must be those ``COMPARED`` names for the other side; exit 1 (and
what to change) if not, or if a side's toolchain is not in ``COMPARED``.  ``.ci/run``
compares the newest supported release with the oldest, in both its flavours.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from ts_moe import toolchain  # noqa: E402


def read(directory: Path) -> tuple[toolchain.Toolchain, dict]:
    """The toolchain a kept directory was compiled with, and ``{build: (PTX, facts)}``
    (a build's name is unique over the arches)."""
    tc = toolchain.Toolchain(**json.loads((directory / "toolchain.json").read_text()))
    builds = {ptx.stem: (ptx.read_bytes(), ptx.with_suffix(".facts.json").read_bytes())
              for ptx in directory.glob("*/*.ptx")}
    return tc, builds


def only_version_line(ptx_a: bytes, ptx_b: bytes) -> bool:
    """Whether two PTX texts differ only in their ``.version`` directive."""
    def strip(text):
        return [line for line in text.splitlines() if not line.startswith(b".version ")]
    return strip(ptx_a) == strip(ptx_b)


def expected(tc_a, tc_b, names) -> set | None:
    """The builds that should differ, from ``toolchain.COMPARED`` (None: it cannot say,
    neither side having the GPU runs' PTX nor being named the same as the other)."""
    found = {tc: toolchain.COMPARED[tc].differs for tc in (tc_a, tc_b)}
    if tc_b in (toolchain.COMPARED[tc_a].same_as, tc_a) or \
            toolchain.COMPARED[tc_b].same_as == tc_a:
        return set()
    for this, other in ((tc_a, tc_b), (tc_b, tc_a)):
        if found[this] == ():
            d = found[other]
            return set(names) if d == toolchain.EVERY_BUILD else set(d)
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    (tc_a, a), (tc_b, b) = (read(Path(d)) for d in argv)
    print(f"comparing {len(a)} builds of {tc_a} ({argv[0]}) with {len(b)} of {tc_b} ({argv[1]})")
    if not a or set(a) != set(b):
        print(f"FAIL: not the same builds: only in {argv[0]}: {sorted(set(a) - set(b))}; "
              f"only in {argv[1]}: {sorted(set(b) - set(a))}")
        return 1
    unknown = [tc for tc in (tc_a, tc_b) if tc not in toolchain.COMPARED]
    if unknown:
        print(f"FAIL: {', '.join(map(str, unknown))} not in ts_moe/toolchain.py COMPARED: "
              f"compare it with {toolchain.VERIFIED} (the GPU runs' toolchain) and add it, "
              f"with the README's table")
        return 1
    diff = sorted(n for n in a if a[n] != b[n])
    ptx = [n for n in diff if a[n][0] != b[n][0]]
    version = [n for n in ptx if only_version_line(a[n][0], b[n][0])]
    facts = [n for n in diff if a[n][1] != b[n][1]]
    print(f"{len(diff)} of {len(a)} builds differ: {len(ptx)} in their PTX ({len(version)} only "
          f"in its .version directive), {len(facts)} in their pre-flight facts"
          + (": " + ", ".join(diff) if 0 < len(diff) <= 20 else ""))
    want = expected(tc_a, tc_b, a)
    if want is None:
        print("neither side has the GPU runs' PTX: nothing in COMPARED to check")
        return 0
    if set(diff) != want:
        print(f"FAIL: ts_moe/toolchain.py COMPARED says {len(want)} builds differ; these "
              f"differ but are not named: {sorted(set(diff) - want)[:10]}; these are named but "
              f"do not differ: {sorted(want - set(diff))[:10]}. Correct COMPARED and the "
              f"README's table, and say why they differ")
        return 1
    print("as ts_moe/toolchain.py COMPARED says")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
