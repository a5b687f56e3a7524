"""Programmatic dependent launch (PDL) for the forward kernels (sm_90+).

A kernel launched with ``use_pdl=True`` may be scheduled before the kernel
ahead of it in the stream has finished: its CTAs take SMs as the earlier
grid's CTAs leave them, instead of after the whole grid has drained and a
new launch has gone through.  At decode the block is six short dependent
launches, so that start-up is a visible part of its time.

The rule that keeps it exact: a kernel launched so calls :func:`enter` first
thing, before it touches global memory (reads and writes: a buffer it writes
may have been freed by a tensor the earlier kernel still reads).
``griddepcontrol.wait`` returns once the earlier grid has completed and its
writes are visible; every grid ahead of that one had completed before it
passed its own wait (or started), so the whole stream before is done.  Only
then does the kernel let its own dependents launch
(``griddepcontrol.launch_dependents``).

``TS_MOE_PDL=0`` (or ``ts_moe.settings.pdl = False``: :mod:`.settings`)
compiles and launches without it.  It is read at each use of
:data:`ENABLED` (:func:`enabled`), that is at each kernel build: the
compile keys carry it, and a build's trace reads it for both its
``griddepcontrol`` instructions and its launch.  A kernel already built in
this process keeps what it was built with (the launchers memoize their
kernels), so a change reaches the kernels first used after it; set it before
the first kernel call to have it everywhere, and never while a kernel builds.
Either way is safe to mix in one stream: a PDL kernel waits for whatever ran
before it.  Measured on and off:
bench/notes/2026-12-04-pdl.md.
"""

import cutlass.cute as cute

from .settings import settings


def enabled() -> bool:
    """Whether a kernel built now uses PDL: :attr:`.settings.KernelSettings.pdl`, read now."""
    return settings.pdl


def __getattr__(name: str):
    if name == "ENABLED":  # the builds' and compile keys' spelling of enabled()
        return enabled()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def reads_before_wait() -> None:
    """In a PDL kernel that reads global memory before :func:`enter` on purpose (weights
    and ``offs`` the kernel ahead does not write: ``prefetch_weights``), called while it
    traces: the pre-flight's ``pdl-order`` rule then allows L2 and TMA loads before the
    wait (``csrc_free_kernels/preflight/pdl_order.py``); writes never."""
    if enabled():
        from ..preflight.trace import declare_pdl_early_reads

        declare_pdl_early_reads()


def enter() -> None:
    """At a PDL kernel's start, in every thread: wait for the stream ahead, then
    let the next kernel launch (emits nothing without :data:`ENABLED`)."""
    if enabled():
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
