"""CPU: the blockwise FP8 kernel's activation-scale box starts 16-byte aligned for every
tile the ragged schedule can hand out, and covers the tile's rows.

The scale box is the project's one TMA whose innermost (contiguous) mode is indexed by a
token row: ``sfa`` is M-major fp32, so a box starting at an expert's first row ``row0``
reads from ``sfa + 4 * row0``, and TMA refuses a start that is not a multiple of 16 bytes
(``bench/notes/2026-12-05-fp8-scale-box-alignment.md``).  The kernel starts the box at
``sfa_box_start(row0)`` and reads the tile's rows ``sfa_row_shift(row0)`` further on;
here those two methods run over the row starts of the schedule
(:func:`schedule_row_starts`, the formula of ``TileScheduler.work_tile``) for thousands
of random ragged ``offs``.
"""

import math
import random

import pytest
import torch

from csrc_free_kernels.fp8.grouped_gemm_fp8_sm90_config import CONFIGS

from .test_fp8_scale_maps import _check, _entry, _kernel, _quantized, _scales, maps  # noqa: F401


def schedule_row_starts(offs, m_rows, cfg):
    """Every ``row0`` a CTA's ``WorkTile`` takes: per expert segment of
    ``cummax(clamp(offs, 0, M))`` (and the tail past ``offs[-1]``), m-tile ``j`` of
    ``cluster_m * rows`` rows, CTA ``rank`` of the cluster: ``start + (j * cluster_m +
    rank) * rows``."""
    ends, run = [], 0
    for o in offs:
        run = max(run, min(max(o, 0), m_rows))
        ends.append(run)
    start = 0
    for end in ends + [m_rows]:
        tile_rows = cfg.rows * cfg.cluster_m
        for j in range(math.ceil((end - start) / tile_rows)):
            for rank in range(cfg.cluster_m):
                yield start + j * tile_rows + rank * cfg.rows
        start = end


def _random_offs(rng):
    """Ragged routing: empty experts, one-row experts, skew, DeepSeek-V3's 256 experts
    at T = 1..64 (top-8), Mixtral's 8 and Qwen3's 128."""
    experts = rng.choice([4, 8, 128, 256])
    tokens = rng.choice([1, 2, 3, 7, 16, 33, 64, 500, 4099])
    rows = tokens * rng.choice([1, 2, 8])
    weights = [rng.choice([0, 0, 1, rng.random() * 10, rng.random() ** 8]) for _ in range(experts)]
    total = sum(weights) or 1.0
    counts = [int(rows * w / total) for w in weights]
    counts[rng.randrange(experts)] += rows - sum(counts)
    offs, run = [], 0
    for c in counts:
        run += c
        offs.append(run)
    return offs, rows + rng.choice([0, 0, 5])  # sometimes rows past offs[-1]


@pytest.mark.parametrize("name", tuple(CONFIGS))
def test_scale_box_start_is_aligned_for_every_scheduled_tile(name):
    kernel = _kernel(name, False)
    cfg = kernel.cfg
    rng = random.Random(name)
    unaligned_rows = 0
    for _ in range(3000):
        offs, m_rows = _random_offs(rng)
        for row0 in schedule_row_starts(offs, m_rows, cfg):
            start, shift = kernel.sfa_box_start(row0), kernel.sfa_row_shift(row0)
            unaligned_rows += row0 % 4 != 0
            assert start % 4 == 0 and 0 <= start <= row0, (offs, row0)  # 16-byte start
            assert start + shift == row0
            assert start + kernel.sfa_box_rows >= row0 + cfg.rows  # the tile's rows loaded
            assert shift + cfg.tile_m <= kernel.sfa_stage_words  # reads stay in the stage
    assert unaligned_rows > 1000  # the draw did exercise unaligned expert starts


def test_deepseek_decode_starts():
    """DeepSeek-V3 gate_up at T = 1 (8 experts of 256 touched, one row each): the case
    whose tiles started the old box at unaligned rows, every T up to 64."""
    kernel = _kernel("fp8_decode16", False)
    rng = random.Random(0)
    for tokens in range(1, 65):
        for _ in range(20):
            counts = [0] * 256
            for _ in range(tokens):
                for e in rng.sample(range(256), 8):
                    counts[e] += 1
            offs = [sum(counts[:i + 1]) for i in range(256)]
            for row0 in schedule_row_starts(offs, offs[-1], kernel.cfg):
                assert kernel.sfa_box_start(row0) % 4 == 0


def test_emulation_without_the_shift_is_caught(maps, monkeypatch):  # noqa: F811
    """The emulation discriminates the new layout: reading the stage's scales without the
    shift (the box starts rounded down) fails where an expert starts off a multiple of 4."""
    gen = torch.Generator().manual_seed(5)
    kernel = _kernel("fp8_mid", False)
    a, b = _quantized((100, 256), gen), _quantized((2, 256, 128), gen)
    sfa, sfb = _scales("blockwise", 100, 256, 2, 128, gen)
    offs = torch.tensor([30, 100], dtype=torch.int32)  # expert 1 starts at row 30
    _check(kernel, _entry(maps, "fp8_mid", False), "blockwise", a, b, sfa, sfb, offs, False)
    monkeypatch.setattr(type(kernel), "sfa_row_shift", staticmethod(lambda row0: 0))
    with pytest.raises(AssertionError):
        _check(kernel, _entry(maps, "fp8_mid", False), "blockwise", a, b, sfa, sfb, offs,
               False)
