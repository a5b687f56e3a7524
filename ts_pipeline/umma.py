"""Pipelines whose consumer is a tcgen05 (UMMA) MMA, for sm_100a.

Compile-verified only: no Blackwell GPU was available to this project.
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cp
from cutlass.cutlass_dsl import dsl_user_op

CtaGroup = cute.nvgpu.tcgen05.CtaGroup

# SM100 shared::cluster addresses carry the CTA's parity in the pair at bit 24;
# clearing it names the same barrier in the even CTA (SM0) of the 2-SM pair.
_PEER_BIT_CLEAR_MASK = 0xFEFFFFFF


def _is_two_cta(cta_layout_vmnk: Optional[cute.Layout]) -> bool:
    return cta_layout_vmnk is not None and cute.size(cta_layout_vmnk, mode=[0]) != 1


def _cta_group(cta_layout_vmnk: Optional[cute.Layout]) -> CtaGroup:
    return CtaGroup.TWO if _is_two_cta(cta_layout_vmnk) else CtaGroup.ONE


def _peer_mask(cta_layout_vmnk: Optional[cute.Layout]):
    """The mask of this CTA and its 2-SM peer; None for a single CTA."""
    if not _is_two_cta(cta_layout_vmnk):
        return None
    return cp.PipelineAsyncUmma._compute_peer_cta_mask(cta_layout_vmnk)


def _barrier_pair(barrier_storage, num_stages, full_agent, empty_agent):
    """Full barriers at the 8-byte-aligned storage, empty barriers right after."""
    base = barrier_storage.align(min_align=8)
    full = cp.PipelineTmaUmma._make_sync_object(base, num_stages, full_agent)
    empty = cp.PipelineTmaUmma._make_sync_object(base + num_stages, num_stages, empty_agent)
    return full, empty


def _fence_and_sync(cta_layout_vmnk: Optional[cute.Layout], defer_sync: bool) -> None:
    """Make the mbarrier inits visible: CTA sync, or relaxed cluster sync."""
    if defer_sync:
        return
    cute.arch.mbarrier_init_fence()
    if cta_layout_vmnk is None or cute.size(cta_layout_vmnk) == 1:
        cp.agent_sync(cp.Agent.ThreadBlock)
    else:
        cp.agent_sync(cp.Agent.ThreadBlockCluster, is_relaxed=True)


@dataclass(frozen=True)
class TSPipelineUmmaUmma(cp.PipelineAsync):
    """A UMMA producer feeding a UMMA consumer (e.g. MMA -> MMA through TMEM).

    Both barrier arrays use tcgen05-commit arrivals.  ``cta_group`` is
    ``CtaGroup.TWO`` when the cluster's V mode has size 2 (2-SM MMA), and then
    both producer and consumer commits multicast to the peer-CTA mask.
    """

    cta_group: CtaGroup

    @staticmethod
    def create(  # type: ignore[override]
        *,
        num_stages: int,
        producer_group: cp.CooperativeGroup,
        consumer_group: cp.CooperativeGroup,
        barrier_storage: cute.Pointer,
        cta_layout_vmnk: Optional[cute.Layout] = None,
        defer_sync: bool = False,
    ) -> "TSPipelineUmmaUmma":
        full, empty = _barrier_pair(
            barrier_storage,
            num_stages,
            (cp.PipelineOp.TCGen05Mma, producer_group),
            (cp.PipelineOp.TCGen05Mma, consumer_group),
        )
        mask = _peer_mask(cta_layout_vmnk)
        cta_group = _cta_group(cta_layout_vmnk)
        _fence_and_sync(cta_layout_vmnk, defer_sync)
        return TSPipelineUmmaUmma(
            sync_object_full=full,
            sync_object_empty=empty,
            num_stages=num_stages,
            producer_mask=mask,
            consumer_mask=mask,
            cta_group=cta_group,
        )

    @dsl_user_op
    def producer_commit(self, state: cp.PipelineState, *, loc=None, ip=None) -> None:
        """tcgen05.commit of the stage's full barrier (with mask and cta group)."""
        self.sync_object_full.arrive(
            state.index, self.producer_mask, self.cta_group, loc=loc, ip=ip
        )

    @dsl_user_op
    def consumer_release(self, state: cp.PipelineState, *, loc=None, ip=None) -> None:
        """tcgen05.commit of the stage's empty barrier (with mask and cta group)."""
        self.sync_object_empty.arrive(
            state.index, self.consumer_mask, self.cta_group, loc=loc, ip=ip
        )


@dataclass(frozen=True)
class TSPipelineAsyncUmma(cp.PipelineAsyncUmma):
    """Thread (``AsyncThread``) or cp.async (``AsyncLoad``) producers -> UMMA consumer.

    The 2-SM peer-bit arrive: with a 2-CTA V mode the MMA of the pair is issued
    by the even CTA (SM0), which waits on *its* full barrier for the producers
    of both CTAs.  CUTLASS C++ (``PipelineUmmaConsumerAsync``) publishes each
    producer thread's commit by taking the shared-memory address of the
    thread's own full barrier, clearing SM100's peer bit (``addr & 0xFEFFFFFF``)
    so that it names the same barrier in SM0, and issuing one
    ``mbarrier.arrive.shared::cluster.b64`` on it.  The base class would
    instead do a generic async-thread arrive to a destination CTA rank; this
    class follows the C++ rule.

    ``producer_op`` is ``PipelineOp.AsyncThread`` (default) or
    ``PipelineOp.AsyncLoad`` (cp.async completion arrives, no producer mask);
    anything else is a ``ValueError``.
    """

    producer_op: cp.PipelineOp = cp.PipelineOp.AsyncThread

    @staticmethod
    def create(  # type: ignore[override]
        *,
        num_stages: int,
        producer_group: cp.CooperativeGroup,
        consumer_group: cp.CooperativeGroup,
        barrier_storage: cute.Pointer,
        cta_layout_vmnk: Optional[cute.Layout] = None,
        producer_op: cp.PipelineOp = cp.PipelineOp.AsyncThread,
        defer_sync: bool = False,
    ) -> "TSPipelineAsyncUmma":
        if producer_op == cp.PipelineOp.AsyncThread:
            base = cp.PipelineAsyncUmma.create(
                num_stages=num_stages,
                producer_group=producer_group,
                consumer_group=consumer_group,
                barrier_storage=barrier_storage,
                cta_layout_vmnk=cta_layout_vmnk,
                defer_sync=defer_sync,
            )
            return TSPipelineAsyncUmma(
                sync_object_full=base.sync_object_full,
                sync_object_empty=base.sync_object_empty,
                num_stages=base.num_stages,
                producer_mask=base.producer_mask,
                consumer_mask=base.consumer_mask,
                cta_group=base.cta_group,
                producer_op=producer_op,
            )
        if producer_op != cp.PipelineOp.AsyncLoad:
            raise ValueError(
                "TSPipelineAsyncUmma: producer_op must be PipelineOp.AsyncThread or "
                f"PipelineOp.AsyncLoad, got {producer_op}"
            )
        full, empty = _barrier_pair(
            barrier_storage,
            num_stages,
            (cp.PipelineOp.AsyncLoad, producer_group),
            (cp.PipelineOp.TCGen05Mma, consumer_group),
        )
        cta_group = _cta_group(cta_layout_vmnk)
        consumer_mask = _peer_mask(cta_layout_vmnk)
        _fence_and_sync(cta_layout_vmnk, defer_sync)
        return TSPipelineAsyncUmma(
            sync_object_full=full,
            sync_object_empty=empty,
            num_stages=num_stages,
            producer_mask=None,
            consumer_mask=consumer_mask,
            cta_group=cta_group,
            producer_op=producer_op,
        )

    @dsl_user_op
    def producer_commit(self, state: cp.PipelineState, *, loc=None, ip=None) -> None:
        """Per-thread cluster arrive on SM0's barrier (2-SM threads), else the base arrive."""
        if self.producer_op == cp.PipelineOp.AsyncThread and self.cta_group is CtaGroup.TWO:
            barrier = self.sync_object_full.get_barrier(state.index, loc=loc, ip=ip)
            sm0_addr = barrier.toint(loc=loc, ip=ip) & cutlass.Int32(_PEER_BIT_CLEAR_MASK)
            cute.arch.inline_ptx(
                "mbarrier.arrive.shared::cluster.b64 _, [{$r0}];",
                read_only_args=[sm0_addr],
                loc=loc,
                ip=ip,
            )
        else:
            self.sync_object_full.arrive(state.index, self.producer_mask, loc=loc, ip=ip)
