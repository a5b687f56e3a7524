"""CPU: the sm_100 kernel's barrier protocol (its arrival counts, as the kernel builds
its pipelines from them) survives every interleaving of both CTAs' roles, and the
model check catches planted bugs."""

import dataclasses

import pytest

from csrc_free_kernels.sm100.grouped_gemm_sm100 import PROTOCOL

from .sm100_protocol_model import Counts, ProtocolError, Shape, check

KERNEL = Counts(**dataclasses.asdict(PROTOCOL))


def test_the_kernel_protocol_has_no_deadlock_race_or_stale_read():
    # 2 ring stages, 1 accumulator stage, 2 tiles of 2 k-tiles: every barrier
    # wraps its phase at least once
    states = check(KERNEL, Shape(stages=2, acc_stages=1, tiles=2, k_tiles=2))
    assert states > 10_000


def test_the_counts_are_the_kernels():
    assert (KERNEL.a_full, KERNEL.acc_empty) == (256, 8)  # both CTAs' gather threads, warps


@pytest.mark.parametrize("bug, field, value, finding", [
    ("the gather barrier counts one CTA's threads", "a_full", 128, "stale read"),
    ("the gather barrier counts a third CTA", "a_full", 384, "deadlock"),
    ("the accumulator is freed by one CTA's epilogue", "acc_empty", 4, "race"),
    ("the weight barrier expects a second arming", "b_full", 2, "deadlock"),
])
def test_planted_count_bugs_are_caught(bug, field, value, finding):
    with pytest.raises(ProtocolError, match=finding):
        check(dataclasses.replace(KERNEL, **{field: value}),
              Shape(stages=2, acc_stages=1, tiles=2, k_tiles=2))


def test_a_commit_to_the_own_ctas_barrier_is_caught():
    """The generic destination-rank arrive would land on the thread's own CTA's
    barrier: the peer's rows never reach the leader's count."""
    with pytest.raises(ProtocolError, match="deadlock"):
        check(KERNEL, Shape(stages=2, acc_stages=1, tiles=2, k_tiles=2),
              gather_commit_cta=lambda c: c)
