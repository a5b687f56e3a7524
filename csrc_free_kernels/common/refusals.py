"""The kernel builds this process refused: a build whose PTX breaks a hardware rule the
pre-flight checks (:mod:`csrc_free_kernels.preflight`) is never launched.

Its compile (:func:`.compile.get_compiled`) records the refusal here once, with one
:class:`RefusedBuildWarning` naming the build and the rules, and raises
:class:`PreflightError`; a later call that needs the build meets the same refusal again
without compiling it.  A backend whose ``run`` meets one has launched nothing: the ops
take the next backend of the call's paths (``ts_moe.ops.backend``), and the ``info``
report of the process (``ts_moe.info_cli``) lists its refusals (:func:`refused`).
Importing this module imports no DSL.
"""

import threading
import warnings
from typing import NamedTuple


class Refusal(NamedTuple):
    """A refused build: its name, the rules it breaks, and each violation in words (the
    rule, why, the PTX line)."""

    build: str
    rules: tuple[str, ...]
    details: str

    @classmethod
    def of(cls, build: str, found) -> "Refusal":
        """The refusal of ``build`` for the pre-flight's violations ``found``."""
        return cls(build, tuple(dict.fromkeys(v.rule for v in found)),
                   "\n".join(map(str, found)))


class PreflightError(RuntimeError):
    """A build breaks a hardware rule the pre-flight checks: it is refused before it can
    reach a GPU (where most such faults are a sticky illegal instruction or a hang).
    Raised before its kernel launches or writes anything."""

    def __init__(self, refusal: Refusal):
        self.refusal = refusal
        super().__init__(
            f"ts_moe: the {refusal.build} kernel build breaks the hardware's rules and is "
            f"not launched (csrc_free_kernels.preflight):\n{refusal.details}")


class RefusedBuildWarning(RuntimeWarning):
    """A kernel build was refused by the pre-flight: the calls that need it take the next
    path of their table."""


_by_key: dict = {}
_lock = threading.Lock()


def record(key, refusal: Refusal) -> None:
    """Keep ``refusal`` under the compile's ``key``, warning once per key."""
    with _lock:
        if key in _by_key:
            return
        _by_key[key] = refusal
    warnings.warn(f"ts_moe: the {refusal.build} kernel build breaks the hardware's rule "
                  f"{', '.join(refusal.rules)} and is never launched in this process: the "
                  f"calls that need it take the next path of their table (the info report of "
                  f"this process, ts_moe.info_cli.run(), lists the refused builds)\n"
                  f"{refusal.details}", RefusedBuildWarning, stacklevel=3)


def get(key) -> Refusal | None:
    """The refusal kept under ``key``, or None."""
    return _by_key.get(key)


def refused() -> tuple[Refusal, ...]:
    """Every build this process refused, in the order it met them (one per name)."""
    return tuple({r.build: r for r in list(_by_key.values())}.values())
