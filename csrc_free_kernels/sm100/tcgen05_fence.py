"""The tcgen05 fences that order tensor-memory work across a thread synchronisation
(sm_100a).  The DSL's public API has the waits (``cute.arch.fence_view_async_tmem_load``,
``tcgen05.wait::ld``) but not these.

PTX ISA, "Memory Consistency Model for 5th generation of TensorCore operations"
(tcgen05 canonical synchronization patterns, non-pipelined instructions in different
threads): ``tcgen05.ld``, ``tcgen05.mma`` and the other asynchronous tcgen05 operations
are not ordered by an mbarrier or a CTA barrier alone.  The thread that hands tensor
memory over runs ``tcgen05.fence::before_thread_sync`` before it signals (after
``tcgen05.wait::ld`` for its loads; ``tcgen05.commit`` performs it for MMAs), and the
thread that takes it runs ``tcgen05.fence::after_thread_sync`` after its wait, before
its first asynchronous tcgen05 operation.  The pre-flight's ``tcgen05-order`` rule checks
both on every path (``csrc_free_kernels/preflight/tmem_order.py``).
"""

from cutlass._mlir.dialects import nvvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def before_thread_sync(*, loc=None, ip=None) -> None:
    """``tcgen05.fence::before_thread_sync``: this thread's earlier asynchronous tcgen05
    operations are ordered before the synchronisation that follows."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def after_thread_sync(*, loc=None, ip=None) -> None:
    """``tcgen05.fence::after_thread_sync``: this thread's later asynchronous tcgen05
    operations are ordered after the synchronisation before it."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC, loc=loc, ip=ip)
