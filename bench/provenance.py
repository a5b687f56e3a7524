"""Where a run's numbers come from: the code, the machine, the packages.

Every result JSON written by the harness carries :func:`collect`'s dict under
``"provenance"``: the git commit of the checkout and whether its tracked files
had uncommitted changes (``dirty``), the host, the GPU and its driver, the
torch, CUDA, nvidia-cutlass-dsl and transformers versions, and the CUDA flavour of
the DSL compiler the process loaded (``dsl-flavor``: "cu12" or "cu13"; one release's
two flavours make different cubins, ``ts_moe/toolchain.py``).  A field that cannot
be known here (no git checkout, no GPU, a package not installed) is ``None``,
never a guess.  A JSON without the dict says nothing of its provenance, and
:func:`describe` says so.

:func:`staleness` compares the run with the last commit that changed the
kernels or the ops (``csrc_free_kernels/``, ``ts_moe/``), by commit time.
"""

import datetime
import importlib.metadata
import socket
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CODE_PATHS = ("csrc_free_kernels", "ts_moe")  # a change here makes earlier runs stale
_DSL = "nvidia-cutlass-dsl"
PACKAGES = (_DSL, "transformers")
FIELDS = ("commit", "dirty", "host", "gpu", "driver", "torch", "cuda", *PACKAGES, "dsl-flavor")


def _git(*args, repo: Path = REPO) -> str | None:
    """``git args`` in ``repo``: its stdout stripped, or None (no git, not a checkout)."""
    try:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _package(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _dsl_flavor() -> str | None:
    """The flavour of the DSL compiler this process loads; None without the DSL."""
    if _package(_DSL) is None:
        return None
    from csrc_free_kernels.common.kernel_cache import dsl_flavor

    return dsl_flavor()


def _driver() -> str | None:
    """The NVIDIA driver's version, from nvidia-smi or the kernel module; None without one."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=30)
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ..."
        words = Path("/proc/driver/nvidia/version").read_text().split()
    except OSError:
        return None
    after = words[words.index("Module") + 1:] if "Module" in words else []
    return after[0] if after else None


def collect(device: torch.device | None = None, repo: Path = REPO,
            given_commit: str | None = None) -> dict:
    """The provenance of a run on ``device`` (a CUDA device: its GPU and driver)
    of the code in ``repo``.

    ``given_commit``: the commit the caller says the tree is, for a copy whose
    ``.git`` is not the tree's own (the device machine's copy has none, or the
    session's starting commit under the working tree sent over it).  It wins over
    git; the tree state is then known only where git's HEAD is that commit."""
    commit = _git("rev-parse", "HEAD", repo=repo)
    status = _git("status", "--porcelain", "--untracked-files=no", repo=repo)
    if given_commit and commit != given_commit:
        commit, status = given_commit, None
    cuda = device is not None and torch.device(device).type == "cuda"
    return {
        "commit": commit,
        "dirty": None if commit is None or status is None else bool(status),
        "host": socket.gethostname() or None,
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "driver": _driver() if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{name: _package(name) for name in PACKAGES},
        "dsl-flavor": _dsl_flavor(),
    }


def describe(result: dict) -> str:
    """One line: the run's provenance, or that its JSON records none."""
    prov = result.get("provenance")
    if not prov:
        recorded = ", ".join(f"{name} {result[key]}" for name, key in (("torch", "torch"),
                                                                       ("CUDA", "cuda"))
                             if result.get(key))
        return ("provenance unknown: the JSON records no commit, tree state, host, driver or "
                "package versions" + (f" (it records {recorded})" if recorded else ""))
    commit = prov.get("commit")
    state = {True: " with uncommitted changes", False: "",
             None: " (tree state not recorded)"}[prov.get("dirty")]
    parts = [f"commit {commit[:12]}{state}" if commit else "commit unknown",
             f"host {prov.get('host') or 'unknown'}",
             f"GPU {prov.get('gpu') or 'none'}",
             f"driver {prov.get('driver') or 'none'}"]
    parts += [f"{name} {prov.get(key) or 'not installed'}{_flavor(prov) if key == _DSL else ''}"
              for name, key in (("torch", "torch"), ("CUDA", "cuda"),
                                *((p, p) for p in PACKAGES))]
    return ", ".join(parts)


def _flavor(prov: dict) -> str:
    """`` (cu13)`` after an installed DSL's release: the compiler flavour it loaded."""
    if not prov.get(_DSL):
        return ""
    return f" ({prov.get('dsl-flavor') or 'flavour not recorded'})"


def commit_time(commit: str, repo: Path = REPO) -> datetime.datetime | None:
    """The commit's committer time, or None where this checkout does not have it."""
    out = _git("show", "-s", "--format=%ct", f"{commit}^{{commit}}", "--", repo=repo)
    return None if not out else datetime.datetime.fromtimestamp(int(out.split()[0]),
                                                                datetime.timezone.utc)


def last_change(repo: Path = REPO) -> tuple[str, datetime.datetime] | None:
    """The last commit that changed :data:`CODE_PATHS` and its time (None: not a checkout)."""
    out = _git("log", "-1", "--format=%H %ct", "--", *CODE_PATHS, repo=repo)
    if not out:
        return None
    sha, seconds = out.split()
    return sha, datetime.datetime.fromtimestamp(int(seconds), datetime.timezone.utc)


def staleness(result: dict, repo: Path = REPO) -> str | None:
    """A warning when ``result`` is older than the last change to the kernels or the
    ops: the run's commit time where its commit is known here, else its date."""
    last = last_change(repo)
    if last is None:
        return None
    prov = result.get("provenance") or {}
    when = commit_time(prov["commit"], repo) if prov.get("commit") else None
    what = f"its commit {prov['commit'][:12]}" if when else None
    if when is None:
        try:
            when = datetime.datetime.fromisoformat(result["date"])
        except (KeyError, TypeError, ValueError):
            return (f"warning: the run has no date and no known commit; the kernels or ops "
                    f"last changed in {last[0][:12]}")
        what = f"its date {result['date']}"
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    if last[1] <= when:
        return None
    return (f"warning: this run is older than the last change to {' or '.join(CODE_PATHS)} "
            f"(commit {last[0][:12]} of {last[1].isoformat(timespec='seconds')}; the run: "
            f"{what}): its numbers may not be those of this code; measure again")
