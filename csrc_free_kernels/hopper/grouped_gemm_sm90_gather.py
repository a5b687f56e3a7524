"""The sm_90 GEMM with the token rows gathered in its own A loads: a variant awaiting its
A/B (no call reaches it).

``out[r] = a[a_index[r]] @ b[e(r)]``: the MoE layer's rows in expert order read straight
from the token matrix, so no permuted copy of ``x`` (or of ``dy``) is written by a row
kernel and read back by the GEMM (issue 51: the two gathers of the training step cost
about 0.7 ms of Qwen3's 8.5 ms at T = 16384, ``bench/notes/2026-12-07-training-node.md``).
An index outside ``[0, M)`` reads as a zero row, as the op's contract says.

What changes against :class:`.grouped_gemm_sm90.GroupedGemmSm90` (everything else, the
weights' TMA, the schedule, the MMA warpgroups and the epilogue, is the base kernel's):

- LOAD_A loads by ``cp.async``, 16 bytes a copy, into the same swizzled stages the
  MMA reads: lane ``l`` owns rows ``l % 16 + 16 * i`` of every tile, reads their
  indices once a tile, and copies every other chunk of each row's k-tile (lanes ``l``
  and ``l + 16`` read a row's 32-byte sectors whole);
  a dead row (an index outside ``[0, M)``, past the index's end) and the K tail copy
  16 zero bytes from a global zero vector instead, so every byte of a stage arrives
  by ``cp.async``;
- the stage's full barrier counts 33 arrivals: the task leader's one (the first weight
  warp here, arming the weights' TMA bytes: ``TSPipelineTmaAsync``) and one
  ``cp.async.mbarrier.arrive.noinc`` of each LOAD_A lane, which the hardware performs
  once the lane's copies so far have landed: no wait in the producer, a lane keeps as
  many stages in flight as the ring has;
- the MMA threads fence the async proxy (``fence.proxy.async``) after a stage's full
  barrier and before its ``wgmma`` (:meth:`~GatherTokens.stage_visible`): the copies
  wrote the stage in the generic proxy, the MMA reads it in the async one (the
  pre-flight's ``proxy-fence`` rule, which follows the writes to the reader through the
  barrier).
"""

import dataclasses
import functools

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.nvgpu import cpasync

from ..common import compile as kcompile
from ..common.family import Build
from . import grouped_gemm_sm90_launch as sm90_launch
from .grouped_gemm_sm90 import GroupedGemmSm90, GroupedGemmSwigluSm90, Warp
from .grouped_gemm_sm90_config import CONFIGS, TileConfig

LANES = 32
CHUNK_BITS = 128  # one cp.async
ROW_LANES = 2  # lanes a row: a pair reads 32 contiguous bytes, one L2 sector


class GatherTokens:
    """The gather's hooks, mixed into the plain and the SwiGLU kernel (module docstring)."""

    variant = "gather"

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB_ekn: cute.Tensor, mC: cute.Tensor,
                 mOffs: cute.Tensor, mIndex: cute.Tensor, mZeros: cute.Tensor,
                 num_ctas: cutlass.Int32, stream):
        """mA (M, K) tokens, mB_ekn (E, K, N), mC (M', N) in expert order, mOffs (E,),
        mIndex (M',) int32: output row ``r`` reads token row ``mIndex[r]``; mZeros: 16
        zero bytes of mA's type."""
        self.launch(mA, mB_ekn, mC, mOffs, (mA, mIndex, mZeros), num_ctas, stream)

    def extra_params(self, tma_atom_a, mA, mIndex, mZeros) -> tuple:
        return (mA, mIndex, mZeros)

    def ring_producers(self) -> tuple:
        # LOAD_A's 32 lanes arrive for themselves (noinc); a weight warp arms the
        # weights' TMA bytes, so the two roles' thread sets are disjoint
        return 1 + LANES, self.cfg.b_warps * self.b_part_bytes, Warp.LOAD_B

    def gather_copy(self):
        """cp.async of 16 bytes; lane ``l`` takes row ``l % R`` of every R rows and
        every ``32 / R``-th chunk of a row, ``R = min(rows, 32 / ROW_LANES)``."""
        r = self.row_lanes()
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.a_dtype, num_bits_per_copy=CHUNK_BITS)
        return cute.make_tiled_copy_tv(atom, cute.make_layout((r, LANES // r)),
                                       cute.make_layout((1, CHUNK_BITS // self.a_dtype.width)))

    def row_lanes(self) -> int:
        """R: the rows one copy instruction of the warp covers."""
        return min(self.cfg.rows, LANES // ROW_LANES)

    @cute.jit
    def token_tiles(self, tma_atom_a, mA_tma, sA_box, row0, extra) -> tuple:
        """LOAD_A, per tile: this lane's partition of the stages, and its rows' token
        rows (0 where dead) and whether each is live."""
        mA, mIndex, _ = extra
        r = self.row_lanes()
        lane = cute.arch.lane_idx()
        tAsA = self.gather_copy().get_slice(lane).partition_D(sA_box)  # (CPY, reps, chunks, stages)
        srcs = []
        lives = []
        for i in cutlass.range_constexpr(self.cfg.rows // r):
            row = row0 + lane % r + r * i
            src = mIndex[cutlass.min(row, mIndex.shape[0] - 1)]
            live = row < mIndex.shape[0] and src >= 0 and src < mA.shape[0]
            if not live:
                src = cutlass.Int32(0)
            srcs.append(src)
            lives.append(live)
        return tAsA, srcs, lives

    @cute.jit
    def load_a(self, tma_atom_a, a_tiles, k, stage, bar, extra):
        """This lane's chunks of k-tile ``k`` into ``stage``, then its arrival on the
        stage's full barrier once they have landed."""
        mA, _, mZeros = extra
        tAsA, srcs, lives = a_tiles
        r = self.row_lanes()
        chunk = CHUNK_BITS // self.a_dtype.width
        lane = cute.arch.lane_idx()
        thr_copy = self.gather_copy().get_slice(lane)
        k_cols = mA.shape[1]
        for i in cutlass.range_constexpr(self.cfg.rows // r):
            gRow = mA[srcs[i], None]
            for j in cutlass.range_constexpr(cute.size(tAsA, mode=[2])):
                col = k * self.cfg.tile_k + (j * (LANES // r) + lane // r) * chunk
                dst = tAsA[None, i, j, stage]
                if lives[i] and col < k_cols:
                    cute.copy(thr_copy, cute.local_tile(gRow, (chunk,), (col // chunk,)), dst)
                else:  # a dead row, the K tail: 16 zero bytes, by cp.async too
                    cute.copy(thr_copy, mZeros, dst)
        cute.arch.cp_async_mbarrier_arrive_noinc(bar)

    def stage_visible(self):
        """The async proxy fenced: the stage's bytes came by ``cp.async``, in the
        generic proxy, and the MMA reads them in the async one."""
        cute.arch.fence_view_async_shared()


class GroupedGemmGatherSm90(GatherTokens, GroupedGemmSm90):
    """The plain GEMM, gathering its token rows (:class:`GatherTokens`)."""


class GroupedGemmSwigluGatherSm90(GatherTokens, GroupedGemmSwigluSm90):
    """The fused SwiGLU GEMM, gathering its token rows (:class:`GatherTokens`)."""


def build(config: TileConfig, a_dtype=torch.bfloat16, b_n_major: bool = False,
          swiglu: bool = False) -> Build:
    """One build of the variant: the base kernel's build (its name, with the ``_gather``
    suffix, and key) with this ``__call__``'s arguments, ``a_index`` int32 (M',) and the
    zero vector added."""
    kernel_cls = GroupedGemmSwigluGatherSm90 if swiglu else GroupedGemmGatherSm90
    base = sm90_launch.build(config, a_dtype, a_dtype, b_n_major, swiglu, False, kernel_cls)

    def make():
        ca = kcompile.CUTE_DTYPES[a_dtype]
        args = kcompile.fake_gemm_args(ca, ca, b_n_major, own_n_out=swiglu, row_index=True,
                                       gather=True)
        zeros = cute.runtime.make_fake_compact_tensor(ca, (CHUNK_BITS // ca.width,),
                                                      assumed_align=16)
        return kernel_cls(config), (*args, zeros, cutlass.Int32(1), kcompile.fake_stream())

    return dataclasses.replace(base, make=make, spec={**base.spec, "gather": True})


def builds():
    """The variant's builds for its A/B and its tests: the layer's (bf16, K-major
    weights), plain in every configuration, SwiGLU in the 128-row ones; and one with
    N-major weights (the weight loads differ by layout, the token loads do not)."""
    for config in CONFIGS.values():
        yield build(config)
        if config.rows == 128 and config.name != "mid":
            yield build(config, swiglu=True)
    yield build(CONFIGS["prefill"], b_n_major=True)


def launch(a, b, offs, out, a_index, config: TileConfig, swiglu: bool = False):
    """``out = a[a_index] @ b[e]`` per expert by the variant (the arguments as the op
    validates them: ``a_index`` int32 of ``out``'s rows), on the current stream.  K must
    be whole 16-byte chunks (the K tail is zero-filled a chunk at a time)."""
    chunk = 16 // a.element_size()
    if a.shape[1] % chunk:
        raise ValueError(f"a: K = {a.shape[1]} is not a multiple of {chunk}: the gathering "
                         f"GEMM copies whole 16-byte chunks of a row")
    if a.shape[0] == 0:  # no token: every row reads as zero (the kernel's TMA needs rows)
        return out.zero_()
    device = a.get_device()
    fn, ctas = _launcher(config, a.dtype, b.stride(-1) == 1, swiglu, device)
    fn(a, b, out, offs, a_index, _zeros(a.dtype, device), ctas)
    return out


@functools.cache
def _launcher(config: TileConfig, a_dtype, b_n_major: bool, swiglu: bool, device_index: int):
    """The compiled kernel and its grid (one CTA per SM, whole clusters): one cache
    lookup per call."""
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return (kcompile.get_compiled(build(config, a_dtype, b_n_major, swiglu)),
            sms // config.cluster_m * config.cluster_m)


_ZEROS = {}


def _zeros(dtype, device_index: int) -> torch.Tensor:
    """16 zero bytes of ``dtype`` on the device, the source of the dead chunks' copies:
    made once, outside any graph capture (a capture would only record the fill, and the
    tensor would live in the graph's pool), and complete before any stream reads it."""
    key = (dtype, device_index)
    if key not in _ZEROS:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the gathering GEMM's first call on a device must run outside "
                               "CUDA-graph capture (it makes its zero vector)")
        zeros = torch.zeros(16 // dtype.itemsize, dtype=dtype, device=f"cuda:{device_index}")
        torch.cuda.synchronize(device_index)
        _ZEROS[key] = zeros
    return _ZEROS[key]
