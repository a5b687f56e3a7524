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

``TS_MOE_PDL=0`` (read at import) compiles and launches without it; the
compile keys carry :data:`ENABLED`.  Measured on and off:
bench/notes/2026-12-04-pdl.md.
"""

import os

import cutlass.cute as cute

ENABLED = os.environ.get("TS_MOE_PDL", "1") != "0"


def enter() -> None:
    """At a PDL kernel's start, in every thread: wait for the stream ahead, then
    let the next kernel launch (emits nothing without :data:`ENABLED`)."""
    if ENABLED:
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
