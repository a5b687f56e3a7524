"""The ragged tile schedule of the grouped GEMM kernels, one for every arch.

The work of ``C[rows of e] = A[rows of e] @ B[e]`` is cut into tiles of
``tile_rows`` rows (of one expert) by one n-tile of output columns.  The
experts' row ends come from ``offs`` on the device, so the schedule is built by
the kernel itself, in shared memory: one warp prefix-scans
``cummax(clamp(offs, 0, M))`` and each expert's tile count, 32 experts per
step; the rows past the last expert form one more, zero-filled pseudo-expert.

Tiles are numbered expert by expert, and within an expert band by band
(``band_m`` m-tiles; 0: the whole expert), n-tile by n-tile within a band, the
m-tile fastest: CTAs running at the same time share weight tiles in L2, and a
band's token rows stay in L2 while its weights stream past.

A cluster of ``cluster_m`` CTAs takes one tile of ``cluster_m * cta_rows`` rows
(each CTA its ``cta_rows``), or, with ``pair_tiles``, two consecutive tiles of
``cta_rows`` rows, one per CTA.  Clusters walk the tiles ``c, c + clusters, ...``.

:class:`RaggedTileSchedule` is the compile-time description (one per kernel
configuration); :class:`TileScheduler` its device side inside one CTA, which
hands out a :class:`WorkTile` per step.

Its sibling for the k-grouped GEMM (the weight gradient, ``out[e] = a[rows of
e]^T @ dy[rows of e]``), where the experts split the reduction instead of the
output rows: :class:`KGroupedTileSchedule`, :class:`KGroupedTileScheduler`,
:class:`KWorkTile`, the same ``create -> bind -> build -> work_tile`` steps.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute


class WorkTile(NamedTuple):
    """One step of a CTA's walk (DSL Int32 values)."""

    expert: object   # the expert; num_experts for the zero-filled tail
    row0: object     # this CTA's first row of the tile
    seg_end: object  # the expert's row end (M for the tail)
    n_tile: object   # the tile's column block


@dataclass(frozen=True)
class RaggedTileSchedule:
    """The schedule's compile-time shape.

    ``cta_rows``: rows a CTA owns per tile; ``cluster_m``: CTAs per cluster;
    ``pair_tiles``: the cluster's two CTAs take consecutive tiles instead of
    one cluster tile; ``band_m``: the raster band in m-tiles (0: whole
    experts); ``max_experts``: the tables' capacity.
    """

    cta_rows: int
    cluster_m: int = 1
    pair_tiles: bool = False
    band_m: int = 0
    max_experts: int = 512

    def __post_init__(self):
        if self.pair_tiles and self.cluster_m != 2:
            raise ValueError(f"pair_tiles needs cluster_m 2 (a CTA pair), got {self.cluster_m}")

    @property
    def tile_rows(self) -> int:
        """Rows of one schedule tile: a cluster tile spans the cluster's CTAs."""
        return self.cta_rows * (1 if self.pair_tiles else self.cluster_m)

    @property
    def table_words(self) -> int:
        """Int32 entries of each shared-memory table (row ends, tile ends)."""
        return self.max_experts + 1

    @staticmethod
    def ceil_div(rows, tile_rows: int):
        """``ceil(rows / tile_rows)`` for ``0 <= rows < 2**31``, in 64 bits: the
        32-bit ``rows + tile_rows - 1`` wraps for rows within ``tile_rows`` of 2**31
        (an expert of 2**31 - 8 rows counted no tiles and its output stayed zero)."""
        return cutlass.Int32((cutlass.Int64(rows) + (tile_rows - 1)) // tile_rows)


@cute.jit
def warp_segment_ends(mOffs: cute.Tensor, num_experts, m_rows, base, lane, carry,
                      coherent: cutlass.Constexpr = False):
    """One warp, experts ``base .. base + 31``: lane ``i``'s expert's row end
    ``cummax(clamp(offs, 0, M))``, ``carry`` the previous step's last end (>= 0,
    so it clamps from below too); a running max over the lanes.  ``coherent``:
    read ``offs`` from L2 (``ld.global.cg``), never from an SM's L1, for a read
    before ``griddepcontrol.wait`` (the wait is what orders L1 otherwise)."""
    end = cutlass.Int32(0)
    if base + lane < num_experts:
        if cutlass.const_expr(coherent):
            end = cute.arch.load(mOffs.iterator + cute.crd2idx(base + lane, mOffs.layout),
                                 cutlass.Int32, cop="cg")
        else:
            end = mOffs[base + lane]
    end = cutlass.max(cutlass.min(end, m_rows), carry)
    for d in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_up(end, 1 << d)
        if lane >= (1 << d):
            end = cutlass.max(end, other)
    return end


@dataclass(frozen=True)
class TileScheduler:
    """The schedule inside one CTA, a value built up in three steps: its place in
    the walk (:meth:`create`), the tables in shared memory (:meth:`bind`), and,
    once the build is visible, the tile count (:meth:`with_total`).  Frozen:
    the DSL passes a read-only frozen dataclass through dynamic control flow
    as it is.

    ``first``, ``step`` and ``lead`` drive the loop ``t = first; while t - lead <
    total_tiles: ...; t += step``.  With ``pair_tiles`` CTA ``r`` of cluster ``c``
    takes tile ``2c + r``, and both CTAs run an iteration while the pair's first
    tile exists (``lead = r``): each stage is released by the consumers of both.
    """

    schedule: RaggedTileSchedule
    cta_rank: object
    first: object
    step: object
    lead: object
    seg_end: object = None      # (table_words,) Int32 in shared memory
    tile_end: object = None     # (table_words,) Int32 in shared memory
    num_experts: object = None
    n_tiles: object = None
    total_tiles: object = None

    @staticmethod
    def create(schedule: RaggedTileSchedule, cta_rank, block, grid) -> "TileScheduler":
        pairs = 2 if schedule.pair_tiles else 1
        cluster = block // schedule.cluster_m
        clusters = grid // schedule.cluster_m
        lead = cta_rank if schedule.pair_tiles else 0
        return TileScheduler(schedule, cta_rank, first=cluster * pairs + lead,
                             step=clusters * pairs, lead=lead)

    def bind(self, storage, num_experts, n_cols, tile_n: int) -> "TileScheduler":
        """With the tables (``storage.seg_end``, ``storage.tile_end``: the kernel's
        shared storage) and the problem's expert count and n-tiles of ``tile_n``
        of the ``n_cols`` output columns."""
        table = cute.make_layout(self.schedule.table_words)
        return dataclasses.replace(self, seg_end=storage.seg_end.get_tensor(table),
                                   tile_end=storage.tile_end.get_tensor(table),
                                   num_experts=num_experts,
                                   n_tiles=(n_cols + tile_n - 1) // tile_n)

    def with_total(self) -> "TileScheduler":
        """With ``total_tiles``, the tail included (read once the build is visible)."""
        return dataclasses.replace(self, total_tiles=self.tile_end[self.num_experts])

    @cute.jit
    def build(self, mOffs: cute.Tensor, m_rows: cutlass.Int32,
              coherent: cutlass.Constexpr = False):
        """One warp: ``seg_end = cummax(clamp(offs, 0, M))`` and the inclusive
        prefix sum of each expert's tile count, 32 experts per step; entry
        ``num_experts`` is the zero-filled tail ``[seg_end[-1], M)``.
        ``coherent``: ``offs`` read from L2 (see :func:`warp_segment_ends`)."""
        tile_m = self.schedule.tile_rows
        num_experts, n_tiles = self.num_experts, self.n_tiles
        sSegEnd, sTileEnd = self.seg_end, self.tile_end
        lane = cute.arch.lane_idx()
        carry_end = cutlass.Int32(0)
        carry_tiles = cutlass.Int32(0)
        for base in cutlass.range(0, num_experts, 32, unroll=1):
            e = base + lane
            end = warp_segment_ends(mOffs, num_experts, m_rows, base, lane, carry_end,
                                    coherent)
            start = cute.arch.shuffle_sync_up(end, 1)
            if lane == 0:
                start = carry_end
            tiles = self.schedule.ceil_div(end - start, tile_m) * n_tiles
            for d in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_up(tiles, 1 << d)
                if lane >= (1 << d):
                    tiles = tiles + other
            tiles = tiles + carry_tiles
            if e < num_experts:
                sSegEnd[e] = end
                sTileEnd[e] = tiles
            carry_end = cute.arch.shuffle_sync(end, 31)
            carry_tiles = cute.arch.shuffle_sync(tiles, 31)
        if lane == 0:
            sSegEnd[num_experts] = m_rows
            sTileEnd[num_experts] = carry_tiles + self.schedule.ceil_div(m_rows - carry_end,
                                                                         tile_m) * n_tiles

    @cute.jit
    def work_tile(self, t: cutlass.Int32) -> WorkTile:
        """Tile ``t``: its expert by binary search of the tile ends, then band,
        n-tile and m-tile within the expert."""
        schedule = self.schedule
        sSegEnd, sTileEnd = self.seg_end, self.tile_end
        lo = cutlass.Int32(0)
        hi = self.num_experts
        for _ in cutlass.range_constexpr(math.ceil(math.log2(schedule.table_words))):
            mid = (lo + hi) // 2
            if sTileEnd[mid] > t:
                hi = mid
            else:
                lo = cutlass.min(mid + 1, hi)
        expert = lo
        tiles_before = cutlass.Int32(0)
        seg_start = cutlass.Int32(0)
        if expert > 0:
            tiles_before = sTileEnd[expert - 1]
            seg_start = sSegEnd[expert - 1]
        seg_end = sSegEnd[expert]
        tile_rows = schedule.tile_rows
        m_tiles = schedule.ceil_div(seg_end - seg_start, tile_rows)
        local = t - tiles_before
        band_tiles = m_tiles
        band0 = cutlass.Int32(0)  # first m-tile of the band
        if cutlass.const_expr(schedule.band_m > 0):
            band0 = local // (schedule.band_m * self.n_tiles) * schedule.band_m
            band_tiles = cutlass.min(m_tiles - band0, schedule.band_m)
            local = local - band0 * self.n_tiles
        n_tile = local // band_tiles
        m_tile = band0 + local - n_tile * band_tiles
        row0 = seg_start + m_tile * tile_rows
        if cutlass.const_expr(not schedule.pair_tiles):
            row0 += self.cta_rank * schedule.cta_rows  # this CTA's part of a cluster tile
        return WorkTile(expert, row0, seg_end, n_tile)


class KWorkTile(NamedTuple):
    """One step of a CTA's walk in the k-grouped GEMM: an output tile of one
    expert and the token rows it reduces over (DSL Int32 values)."""

    expert: object
    m_tile: object     # tile of K (output rows)
    n_tile: object     # tile of N (output columns)
    row_start: object  # the expert's token rows [row_start, row_end)
    row_end: object


@dataclass(frozen=True)
class KGroupedTileSchedule:
    """The k-grouped schedule's compile-time shape: output tiles of ``tile_m x
    tile_n``, raster bands of ``band_n`` n-tiles, ``max_experts`` row ends in
    shared memory.

    Tiles are numbered expert by expert; within an expert band by band (``band_n``
    n-tiles), m-tile by m-tile within a band, the n-tile fastest, so that the
    CTAs running together share a few dy and a columns in L2.  The tile count
    ``E * m_tiles * n_tiles`` does not depend on ``offs``: CTA ``b`` of ``grid``
    takes tiles ``b, b + grid, ...``; only a tile's rows come from the table.
    """

    tile_m: int
    tile_n: int
    band_n: int
    max_experts: int = 512

    @staticmethod
    def tile_coords(t, m_tiles, n_tiles, band_n: int):
        """Tile ``t`` -> (expert, m_tile, n_tile): plain arithmetic, run by the
        kernel on DSL integers and by the CPU tests on Python ints."""
        per_expert = m_tiles * n_tiles
        expert = t // per_expert
        local = t - expert * per_expert
        n0 = local // (band_n * m_tiles) * band_n  # first n-tile of the band
        width = cutlass.min(n_tiles - n0, band_n)  # the last band may be narrower
        rest = local - n0 * m_tiles
        m_tile = rest // width
        return expert, m_tile, n0 + rest - m_tile * width


@dataclass(frozen=True)
class KGroupedTileScheduler:
    """The k-grouped schedule inside one CTA: its place in the walk
    (:meth:`create`), then the problem and the row-end table in shared memory
    (:meth:`bind`; the table is built by one warp, :meth:`build`).  The loop is
    ``t = first; while t < total_tiles: ...; t += step``."""

    schedule: KGroupedTileSchedule
    first: object
    step: object
    seg_end: object = None      # (max_experts,) Int32: cummax(clamp(offs, 0, M))
    num_experts: object = None
    m_tiles: object = None
    n_tiles: object = None
    total_tiles: object = None

    @staticmethod
    def create(schedule: KGroupedTileSchedule, block, grid) -> "KGroupedTileScheduler":
        return KGroupedTileScheduler(schedule, first=block, step=grid)

    def bind(self, storage, num_experts, k_rows, n_cols) -> "KGroupedTileScheduler":
        """With the table (``storage.seg_end``) and the problem: ``num_experts``
        (K, N) outputs of ``k_rows x n_cols``."""
        schedule = self.schedule
        m_tiles = (k_rows + schedule.tile_m - 1) // schedule.tile_m
        n_tiles = (n_cols + schedule.tile_n - 1) // schedule.tile_n
        seg_end = storage.seg_end.get_tensor(cute.make_layout(schedule.max_experts))
        return dataclasses.replace(self, seg_end=seg_end, num_experts=num_experts,
                                   m_tiles=m_tiles, n_tiles=n_tiles,
                                   total_tiles=num_experts * m_tiles * n_tiles)

    @cute.jit
    def build(self, mOffs: cute.Tensor, m_rows: cutlass.Int32):
        """One warp: ``seg_end = cummax(clamp(offs, 0, M))``, 32 experts per step."""
        lane = cute.arch.lane_idx()
        carry = cutlass.Int32(0)
        for base in cutlass.range(0, self.num_experts, 32, unroll=1):
            e = base + lane
            end = warp_segment_ends(mOffs, self.num_experts, m_rows, base, lane, carry)
            if e < self.num_experts:
                self.seg_end[e] = end
            carry = cute.arch.shuffle_sync(end, 31)

    @cute.jit
    def work_tile(self, t: cutlass.Int32) -> KWorkTile:
        expert, m_tile, n_tile = self.schedule.tile_coords(t, self.m_tiles, self.n_tiles,
                                                           self.schedule.band_n)
        row_start = cutlass.Int32(0)
        if expert > 0:
            row_start = self.seg_end[expert - 1]
        return KWorkTile(expert, m_tile, n_tile, row_start, self.seg_end[expert])
