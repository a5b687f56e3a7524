"""A TMA ring filled by P producer warps under one full barrier (sm_90a).

The smallest real kernel that exercises ``ts_pipeline.TSPipelineTmaAsync``: it
copies ``mX`` to ``mY`` through a shared-memory ring.  CI compiles it and reads
its PTX; the GPU test checks that it moves every byte through many ring wraps.
"""

import enum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cp
from cutlass.cute.nvgpu import cpasync

import ts_pipeline


class Warp(enum.IntEnum):
    """Warp roles of the probe's CTA."""

    PRODUCER = 0   # warps 0 .. P-1: one TMA box of each stage; warp 0 the task warp leader
    CONSUMER = 4   # warps 4 .. 7: copy each stage out


class PipelineProbeSm90:
    """Copy ``mX`` -> ``mY`` through a ``num_stages`` ring filled by P TMA warps.

    Warp roles (``4 + 4`` warps, one CTA per SM, persistent):

    - warps ``0 .. P-1``: TMA producers.  Stage ``s`` of CTA ``b`` holds
      ``P * rows`` rows of ``mX``; warp ``p`` loads rows ``[p*rows, (p+1)*rows)``
      of it.  Warp 0 is the task's first warp: it alone arms the stage's full
      barrier with the aggregate byte count (``leader_arms=False`` compiles a
      kernel in which no warp arms it, for the PTX checks only: it would hang).
    - warps ``4 .. 7`` (one warpgroup): consumer, copies the stage to ``mY``.

    Pipeline: producers -> consumer, ``TSPipelineTmaAsync``, ``num_stages``
    stages of ``P * rows * cols * 2`` bytes (``P`` boxes of ``rows x cols`` bf16).
    """

    consumer_warps = 4

    def __init__(self, num_producer_warps: int, num_stages: int, rows: int = 8,
                 cols: int = 64, leader_arms: bool = True, pipelines=ts_pipeline):
        if not 1 <= num_producer_warps <= 4:
            raise ValueError(f"num_producer_warps must be 1..4, got {num_producer_warps}")
        self.P = num_producer_warps
        self.num_stages = num_stages
        self.rows, self.cols = rows, cols
        self.leader_arms = leader_arms
        # the module providing TSPipelineTmaAsync: ts_pipeline, or NVIDIA's
        # reference module, so that tests can compare the two kernels' PTX
        self.pipelines = pipelines
        self.dtype = cutlass.BFloat16
        self.stage_rows = self.P * rows
        self.stage_bytes = self.stage_rows * cols * self.dtype.width // 8
        self.threads = 32 * (Warp.CONSUMER + self.consumer_warps)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stages_per_cta: cutlass.Int32,
                 num_ctas: cutlass.Int32, stream):
        # one box of one warp: (rows, cols), row-major, no swizzle
        box_layout = cute.make_layout((self.rows, self.cols), stride=(self.cols, 1))
        tma_atom, mX_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mX, box_layout, (self.rows, self.cols)
        )
        # (rows, cols, P, num_stages): warp p's box of stage s
        ring_layout = cute.make_layout(
            (self.rows, self.cols, self.P, self.num_stages),
            stride=(self.cols, 1, self.rows * self.cols, self.stage_rows * self.cols),
        )

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            ring: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(ring_layout)], 128
            ]

        self.shared_storage = SharedStorage
        self.kernel(tma_atom, mX_tma, mY, ring_layout, stages_per_cta).launch(
            grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, tma_atom: cute.CopyAtom, mX: cute.Tensor, mY: cute.Tensor,
               ring_layout: cute.Layout, stages_per_cta: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        sRing = storage.ring.get_tensor(ring_layout)
        is_leader = warp_idx == Warp.PRODUCER if self.leader_arms else cutlass.Boolean(False)
        ring = self.pipelines.TSPipelineTmaAsync.create(
            num_stages=self.num_stages,
            producer_group=cp.CooperativeGroup(cp.Agent.Thread),
            consumer_group=cp.CooperativeGroup(cp.Agent.Thread, self.consumer_warps),
            tx_count=self.stage_bytes,
            barrier_storage=storage.barriers.data_ptr(),
            is_task_warp_leader=is_leader,
        )
        first_box = bidx * stages_per_cta * self.P

        if warp_idx < Warp.PRODUCER + self.P:
            # (rows, cols, boxes) -> TMA view (TMA, boxes); ring (TMA, P, stages)
            gX = cute.local_tile(mX, (self.rows, self.cols), (None, 0))
            tXsX, tXgX = cpasync.tma_partition(
                tma_atom, 0, cute.make_layout(1),
                cute.group_modes(sRing, 0, 2), cute.group_modes(gX, 0, 2),
            )
            state = cp.make_pipeline_state(cp.PipelineUserType.Producer, self.num_stages)
            for s in cutlass.range(stages_per_cta, unroll=1):
                ring.producer_acquire(state)
                cute.copy(
                    tma_atom,
                    tXgX[None, first_box + s * self.P + warp_idx - Warp.PRODUCER],
                    tXsX[None, warp_idx - Warp.PRODUCER, state.index],
                    tma_bar_ptr=ring.producer_get_barrier(state),
                )
                state.advance()
            ring.producer_tail(state)

        if warp_idx >= Warp.CONSUMER:
            ctid = tidx - 32 * Warp.CONSUMER
            # the stage as one flat run of stage_rows * cols elements
            stage_elems = self.stage_rows * self.cols
            sFlat = cute.make_tensor(sRing.iterator, cute.make_layout(stage_elems * self.num_stages))
            state = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.num_stages)
            for s in cutlass.range(stages_per_cta, unroll=1):
                ring.consumer_wait(state)
                out = (first_box + s * self.P) * self.rows * self.cols
                for i in cutlass.range(ctid, stage_elems, 32 * self.consumer_warps, unroll=1):
                    mY[out + i] = sFlat[state.index * stage_elems + i]
                ring.consumer_release(state)
                state.advance()


def copy_through_ring(x, num_producer_warps: int, num_stages: int, num_ctas: int):
    """Run the probe on CUDA: ``x`` (num_ctas * S * P * 8, 64) bf16 -> flat copy of it."""
    import cutlass.cute as cute

    from csrc_free_kernels.common import compile as kcompile
    from csrc_free_kernels.common.family import Build

    probe = PipelineProbeSm90(num_producer_warps, num_stages)
    stages_per_cta = x.shape[0] // (num_ctas * probe.stage_rows)
    if stages_per_cta * num_ctas * probe.stage_rows != x.shape[0] or x.shape[1] != probe.cols:
        raise ValueError(f"x must be ({num_ctas} * S * {probe.stage_rows}, {probe.cols})")

    def build():
        n = cute.sym_int()
        fx = cute.runtime.make_fake_compact_tensor(
            cutlass.BFloat16, (n, probe.cols), stride_order=(1, 0), assumed_align=16)
        fy = cute.runtime.make_fake_compact_tensor(cutlass.BFloat16, (cute.sym_int(),),
                                                   assumed_align=16)
        return probe, (fx, fy, cutlass.Int32(1), cutlass.Int32(1), kcompile.fake_stream())

    fn = kcompile.get_compiled(Build(f"probe90_P{num_producer_warps}_s{num_stages}",
                                     ("PipelineProbeSm90", num_producer_warps, num_stages), build))
    y = x.new_empty(x.numel())
    fn(x, y, stages_per_cta, num_ctas)
    return y


def main() -> int:
    """Every P and ring depth, 1000+ stages per CTA on every SM, bit-exact."""
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    failures = 0
    for p in (1, 2, 3, 4):
        for stages in (2, 3, 4, 5, 6):
            x = torch.randn(sms * 1024 * p * 8, 64, device="cuda").to(torch.bfloat16)
            y = copy_through_ring(x, p, stages, sms)
            torch.cuda.synchronize()
            ok = torch.equal(y.view_as(x), x)
            failures += not ok
            print(f"P={p} stages={stages} ctas={sms} stages/cta=1024 bit-exact={ok}", flush=True)
    return failures


if __name__ == "__main__":
    raise SystemExit(main())
