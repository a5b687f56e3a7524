"""Small sm_100a kernels that drive the UMMA-side TS pipelines, for PTX checks.

Compile-verified only: no Blackwell GPU is available to this project, so these
kernels have never run; CI compiles them with ``CUTE_DSL_ARCH=sm_100a`` and
reads the barrier instructions in their PTX.
"""

import enum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cp

import ts_pipeline


class Warp(enum.IntEnum):
    """Warp roles of the probe's CTA (160 threads)."""

    PRODUCER = 0   # warp 0 (umma_umma), or warps 0-3 (the async producers)
    CONSUMER = 4   # the UMMA-side consumer


class PipelineProbeSm100:
    """Run ``num_iters`` acquire/commit/wait/release rounds of one TS pipeline.

    ``kind`` selects the pipeline:

    - ``"async_thread"``: ``TSPipelineAsyncUmma`` with ``AsyncThread``
      producers (warps 0-3, 128 threads) -> UMMA consumer (warp 4);
    - ``"async_load"``: the same with ``AsyncLoad`` (cp.async arrive) producers;
    - ``"umma_umma"``: ``TSPipelineUmmaUmma``, warp 0 producer -> warp 4 consumer.

    ``cluster_v`` is the size of the cluster's V mode: 2 makes a 2-SM pair
    (``CtaGroup.TWO``), 1 a single CTA.  No data moves: the kernel exists to
    show the barrier traffic each pipeline emits.
    """

    kinds = ("async_thread", "async_load", "umma_umma")

    def __init__(self, kind: str, cluster_v: int = 2, num_stages: int = 4,
                 producer_op=None):
        if kind not in self.kinds:
            raise ValueError(f"kind must be one of {self.kinds}, got {kind!r}")
        self.kind = kind
        self.cluster_v = cluster_v
        self.num_stages = num_stages
        # lets a test pass a producer op that TSPipelineAsyncUmma must refuse
        self.producer_op = producer_op or (
            cp.PipelineOp.AsyncLoad if kind == "async_load" else cp.PipelineOp.AsyncThread
        )

    @cute.jit
    def __call__(self, num_iters: cutlass.Int32, stream):
        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]

        self.shared_storage = SharedStorage
        self.kernel(num_iters).launch(
            grid=(self.cluster_v, 1, 1), block=(32 * (Warp.CONSUMER + 1), 1, 1),
            cluster=(self.cluster_v, 1, 1), stream=stream,
        )

    def _make_pipeline(self, barriers):
        # (V, M, N, K) cluster layout: a 2-SM pair along V
        cta_layout_vmnk = cute.make_layout((self.cluster_v, 1, 1, 1))
        if self.kind == "umma_umma":
            return ts_pipeline.TSPipelineUmmaUmma.create(
                num_stages=self.num_stages,
                producer_group=cp.CooperativeGroup(cp.Agent.Thread),
                consumer_group=cp.CooperativeGroup(cp.Agent.Thread),
                barrier_storage=barriers,
                cta_layout_vmnk=cta_layout_vmnk,
            )
        return ts_pipeline.TSPipelineAsyncUmma.create(
            num_stages=self.num_stages,
            # both CTAs' 128 producer threads arrive on SM0's barrier
            producer_group=cp.CooperativeGroup(cp.Agent.Thread, 128 * self.cluster_v),
            consumer_group=cp.CooperativeGroup(cp.Agent.Thread),
            barrier_storage=barriers,
            cta_layout_vmnk=cta_layout_vmnk,
            producer_op=self.producer_op,
        )

    @cute.kernel
    def kernel(self, num_iters: cutlass.Int32):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        pipe = self._make_pipeline(storage.barriers.data_ptr())
        producer_warps = 1 if self.kind == "umma_umma" else 4

        if warp_idx < Warp.PRODUCER + producer_warps:
            state = cp.make_pipeline_state(cp.PipelineUserType.Producer, self.num_stages)
            for _ in cutlass.range(num_iters, unroll=1):
                pipe.producer_acquire(state)
                pipe.producer_commit(state)
                state.advance()
        if warp_idx == Warp.CONSUMER:
            state = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.num_stages)
            for _ in cutlass.range(num_iters, unroll=1):
                pipe.consumer_wait(state)
                pipe.consumer_release(state)
                state.advance()
