"""TMA producers -> async-thread consumers, with the task-warp-leader rule."""

from dataclasses import dataclass
from typing import Optional

import cutlass.cute as cute
import cutlass.pipeline as cp
from cutlass._mlir import ir
from cutlass.cutlass_dsl import Boolean, dsl_user_op, if_generate


@dataclass(frozen=True)
class TSPipelineTmaAsync(cp.PipelineTmaAsync):
    """``PipelineTmaAsync`` whose full barrier is armed by one warp per task.

    The task-warp-leader rule: a *task* may map several TMA producer warps onto
    one pipeline (say warp 0 loads the token tile of a stage, warps 1-2 the
    expert-weight tiles of the same stage).  The base class arms the stage's
    full barrier (``mbarrier.arrive.expect_tx``) from every warp that calls
    ``producer_acquire``: each warp would add one arrival and its own byte
    count, so the barrier would need to know how many warps there are.  Here
    every producer warp still waits on the stage's *empty* barrier (so no warp
    overwrites a slot the consumers still read), but only the warp for which
    ``is_task_warp_leader`` holds performs the single arrival, carrying
    ``tx_count``: the aggregate byte count of all the task's warps' loads for
    one stage.  The full barrier therefore keeps an arrival count of one.

    A non-leader warp's TMA may complete before the leader arms the barrier:
    the transaction count goes transiently negative, which the mbarrier allows;
    the phase cannot flip before the leader's arrival, the only one expected.

    Fields: those of ``PipelineTmaAsync`` (``sync_object_full``,
    ``sync_object_empty``, ``num_stages``, ``producer_mask``,
    ``consumer_mask``, ``is_signaling_thread``) plus ``is_task_warp_leader``.
    """

    is_task_warp_leader: Boolean

    @staticmethod
    def create(  # type: ignore[override]
        *,
        num_stages: int,
        producer_group: cp.CooperativeGroup,
        consumer_group: cp.CooperativeGroup,
        tx_count: int,
        barrier_storage: cute.Pointer,
        is_task_warp_leader: Boolean,
        cta_layout_vmnk: Optional[cute.Layout] = None,
        mcast_mode_mn: tuple[int, int] = (1, 1),
        defer_sync: bool = False,
    ) -> "TSPipelineTmaAsync":
        """Build the base ``PipelineTmaAsync`` and attach the leader predicate.

        ``tx_count`` is the aggregate byte count of one stage over all the
        task's producer warps; ``producer_group`` should count one arrival
        (the leader's).  The other arguments are those of the base ``create``.
        """
        base = cp.PipelineTmaAsync.create(
            num_stages=num_stages,
            producer_group=producer_group,
            consumer_group=consumer_group,
            tx_count=tx_count,
            barrier_storage=barrier_storage,
            cta_layout_vmnk=cta_layout_vmnk,
            mcast_mode_mn=mcast_mode_mn,
            defer_sync=defer_sync,
        )
        return TSPipelineTmaAsync(
            sync_object_full=base.sync_object_full,
            sync_object_empty=base.sync_object_empty,
            num_stages=base.num_stages,
            producer_mask=base.producer_mask,
            consumer_mask=base.consumer_mask,
            is_signaling_thread=base.is_signaling_thread,
            is_task_warp_leader=is_task_warp_leader,
        )

    @dsl_user_op
    def producer_acquire(
        self,
        state: cp.PipelineState,
        try_acquire_token: Optional[Boolean] = None,
        *,
        loc: Optional[ir.Location] = None,
        ip: Optional[ir.InsertionPoint] = None,
    ) -> None:
        """Every caller waits for the slot to be empty; only the leader arms it."""
        full, empty = self.sync_object_full, self.sync_object_empty
        if_generate(
            try_acquire_token is None or try_acquire_token == 0,
            lambda: empty.wait(state.index, state.phase, loc=loc, ip=ip),
            loc=loc,
            ip=ip,
        )
        if_generate(
            self.is_task_warp_leader,
            lambda: full.arrive_and_expect_tx(state.index, full.tx_count, loc=loc, ip=ip),
            loc=loc,
            ip=ip,
        )
