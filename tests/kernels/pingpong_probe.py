"""The Hopper grouped GEMM with ping-pong MMA warpgroups (128x192 a warpgroup, CTA pairs
multicasting the weight tile, the public sm_90 leaders' shape): a variant that lost its
A/B in all 36 cases of three models (bench/notes/2026-12-07-gemm-core-h100.md), kept here
as the probe of the pre-flight's turn-taking groups (``declare_turn_groups``: each ring
stage released by the four warps of one warpgroup, not of both).  Never launched.

Each MMA warpgroup owns a whole ``tile_m x tile_n`` tile (two m64 WGMMA row blocks) and
the two take alternate tiles of the CTA's walk, so that one's epilogue runs under the
other's mainloop.  Turns order the warpgroups' mainloops, so that neither waits on a
stage whose full barrier is more than one phase behind it (a parity wait would pass at
once).  Each warpgroup has its own epilogue buffers and barrier.
"""

import dataclasses
import enum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cp
import cutlass.utils.hopper_helpers as sm90_utils

from csrc_free_kernels.hopper.grouped_gemm_sm90 import GroupedGemmSm90, Warp
from csrc_free_kernels.hopper.grouped_gemm_sm90_config import PREFILL, TileConfig
from csrc_free_kernels.hopper.sm90_epilogue import mma_operands, stage_to_shared
from csrc_free_kernels.common.tile_schedule import TileScheduler
from csrc_free_kernels.preflight.trace import declare_turn_groups


class Barrier(enum.IntEnum):
    """Named barriers among the MMA threads (id 0 is the CTA-wide one)."""

    EPILOGUE_WG0 = 1   # an epilogue sub-tile of warpgroup 0's tile is in shared memory
    EPILOGUE_WG1 = 2
    TURN_WG0 = 3       # warpgroup 0 may issue its next tile's WGMMAs
    TURN_WG1 = 4


@dataclasses.dataclass(frozen=True)
class GroupBarrier:
    """A named barrier of warpgroup ``group`` (a warp-uniform value, 0 or 1): ``id0`` for
    warpgroup 0, ``id1`` for 1, each a constant in the PTX (the pre-flight's
    ``named-barrier`` rule), chosen by a uniform branch."""

    group: cutlass.Int32
    id0: int
    id1: int
    threads: int

    @cute.jit
    def arrive_and_wait(self):
        if self.group == 0:
            cute.arch.barrier(barrier_id=self.id0, number_of_threads=self.threads)
        else:
            cute.arch.barrier(barrier_id=self.id1, number_of_threads=self.threads)

    @cute.jit
    def arrive(self):
        if self.group == 0:
            cute.arch.barrier_arrive(barrier_id=self.id0, number_of_threads=self.threads)
        else:
            cute.arch.barrier_arrive(barrier_id=self.id1, number_of_threads=self.threads)


# 128x192 a warpgroup (192 fp32 accumulators a thread), five 40 KB stages; with CTA
# pairs multicasting each weight part (K-major weights: 48-row shares of 96-row parts)
PINGPONG = dataclasses.replace(PREFILL, name="pp192", tile_n=192, stages=5, cluster_m=1)
PINGPONG_C2 = dataclasses.replace(PINGPONG, name="pp192_c2", cluster_m=2)
CONFIGS = {c.name: c for c in (PINGPONG, PINGPONG_C2)}


class GroupedGemmPingpongSm90(GroupedGemmSm90):
    """:class:`GroupedGemmSm90` with ping-pong MMA warpgroups.

    The producers fill the ring in the walk's order, one tile after another; the
    warpgroup of turn ``t % 2`` consumes tile ``t``'s stages and advances past the
    other's.  Turns order the warpgroups' mainloops (:class:`Barrier` ``TURN_*``): a
    warpgroup waits for its turn before its first stage wait and gives the turn to the
    other after its last, so that neither waits on a stage whose full barrier is more
    than one phase behind it (a parity wait would pass at once).  Each stage is
    released by the four warps of one warpgroup (per CTA of the cluster).  Each
    warpgroup has its own epilogue buffers and barrier.  Pair tiles are not taken
    (their missing-tile stages would need both warpgroups' turns).
    """

    def __init__(self, config: TileConfig, acc_dtype=cutlass.Float32,
                 prefetch_weights: bool = False):
        if config.tile_m != 128 or config.pair_tiles or config.a_rows:
            raise ValueError(f"{config.name}: ping-pong warpgroups take 128-row tiles, "
                             f"whole token boxes and no pair tiles")
        super().__init__(config, acc_dtype, prefetch_weights)
        self.epi_threads = 128

    def tile_warpgroups(self) -> int:
        return 1

    def make_epi_smem_layout(self, c_dtype, c_layout):
        # each warpgroup's epi_stages buffers, warpgroup 0's first
        return sm90_utils.make_smem_layout_epi(c_dtype, c_layout, self.epi_tile,
                                               2 * self.epi_stages)

    @cute.jit
    def consume(self, tiled_mma, mC, sA, sB, sC, ring, ctid, sched: TileScheduler, k_tiles,
                extra):
        """Warpgroup ``group`` (``ctid // 128``) takes the walk's tiles ``t`` with
        ``t % 2 == group``, the other's stages skipped; one traced body for both, its
        barrier ids and epilogue buffers offset by ``group``."""
        cfg = self.cfg
        group = cute.arch.make_warp_uniform(ctid // 128)
        wtid = ctid % 128
        ops = mma_operands(tiled_mma, sA, sB, wtid, (cfg.tile_m, cfg.tile_n), self.acc_dtype)
        staged = stage_to_shared(
            tiled_mma, ops.acc, sC, wtid, self.c_layout, self.c_dtype, self.acc_dtype)
        stores = self.tile_stores(sC, wtid)
        m_subs, _, _ = self.epi_subtiles()
        assert cute.size(staged.acc, mode=[1]) == m_subs and cute.size(staged.acc, mode=[2]) == 1, \
            (staged.acc.layout, self.epi_tile)
        my_turn = GroupBarrier(group, Barrier.TURN_WG0, Barrier.TURN_WG1, 256)
        their_turn = GroupBarrier(group, Barrier.TURN_WG1, Barrier.TURN_WG0, 256)
        epi_barrier = GroupBarrier(group, Barrier.EPILOGUE_WG0, Barrier.EPILOGUE_WG1, 128)
        buf0 = group * self.epi_stages
        # each ring stage is released by the warpgroup whose turn it is
        declare_turn_groups(32 * Warp.MMA, 256, 2)

        read = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.stages)
        release = cp.make_pipeline_state(cp.PipelineUserType.Consumer, self.stages)
        lead, total_tiles = sched.lead, sched.total_tiles
        n_cols = mC.shape[1]
        t = sched.first
        turn = cutlass.Int32(0)  # the CTA's tiles so far
        epi_count = cutlass.Int32(0)
        while t - lead < total_tiles:
            tile = sched.work_tile(cutlass.min(t, total_tiles - 1))
            rows_valid = self.stored_rows(tile.row0, tile.seg_end, t, total_tiles)
            run = tile.expert < sched.num_experts
            if turn % 2 == group:
                if turn > 0:
                    my_turn.arrive_and_wait()
                ops.acc.fill(0.0)
                if run:
                    read, release = self.mainloop(tiled_mma, ops, ring, read, release, k_tiles,
                                                  rows_valid, 0, tile, n_cols, ())
                if t + sched.step - lead < total_tiles:  # the other's tile follows
                    their_turn.arrive()
                epi_count = self.group_epilogue(staged, stores, mC, tile.row0, tile.n_tile,
                                                rows_valid, epi_count, epi_barrier, buf0)
            else:
                if run:
                    # the other warpgroup's tile: its stages are not ours
                    for _ in cutlass.range(k_tiles, unroll=1):
                        read.advance()
                        release.advance()
            turn += 1
            t += sched.step

    @cute.jit
    def group_epilogue(self, staged, stores, mC, row0, n_tile, rows_valid, epi_count,
                       epi_barrier, buf0):
        """The kernel's epilogue on this warpgroup's buffers (from ``buf0``), its threads
        meeting at its own ``epi_barrier``."""
        r2s, tRS_sC, tRS_rAcc, tRS_rD, tRS_rOut = staged
        thr_s2g, tSsC = stores
        m_subs, n_subs, chunks_n = self.epi_subtiles()
        tile_mn = (self.cfg.tile_m, self.out_tile_n)
        gC = cute.local_tile(cute.domain_offset((row0, 0), mC), tile_mn, (0, n_tile))
        cC = cute.local_tile(cute.make_identity_tensor(mC.shape), tile_mn, (0, n_tile))
        for epi in cutlass.range_constexpr(m_subs * n_subs):
            mi, ni = divmod(epi, n_subs)
            buf = buf0 + epi_count % self.epi_stages
            self.epilogue_fragment(tRS_rAcc, mi * chunks_n + ni, tRS_rD, tRS_rOut)
            cute.copy(r2s, tRS_rOut, tRS_sC[None, None, None, buf])
            epi_barrier.arrive_and_wait()
            self.store_subtile(thr_s2g, tSsC, gC, cC, mi, ni, buf, rows_valid, mC.shape[1])
            epi_count += 1
        return epi_count
