"""Compile-only checks of ts_pipeline: real kernels built for sm_90a and
sm_100a without a GPU, their PTX read back.  (The sm_100a kernels have never
run: no Blackwell GPU is available to this project.)"""

import re

import pytest

from csrc_free_kernels import ptx_dump

from .kernels.probe_builds import BUILDS
from .ptxas import ptx_fixture

SM90 = [f"probe90_P{p}" for p in (1, 2, 3, 4)] + [
    f"probe90_P{p}_reference" for p in (1, 2, 3, 4)] + ["probe90_P3_no_leader"]
SM100 = [n for n in BUILDS if n.startswith("probe100")]

ptx90 = ptx_fixture("sm_90a", SM90, "ptx90")
ptx100 = ptx_fixture("sm_100a", SM100, "ptx100")


def _mov_value(ptx: str, reg: str) -> int:
    (value,) = re.findall(rf"mov\.b32\s+{re.escape(reg)},\s*(\d+);", ptx)
    return int(value)


def _normalise(ptx: str) -> str:
    """Drop the names the DSL derives from Python objects and module paths."""
    ptx = re.sub(r"//.*", "", ptx)
    ptx = re.sub(r"\b\w*(?:_object_at_|pipeline_probe)\w*", "NAME", ptx)
    return "\n".join(line.strip() for line in ptx.splitlines() if line.strip())


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_one_expect_tx_with_aggregate_bytes(ptx90, p):
    ptx = ptx90[f"probe90_P{p}"]
    arms = re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64\s+\S+,\s*\[\S+\],\s*(%r\d+);", ptx)
    assert len(arms) == 1, "one arrive.expect_tx site per acquire"
    # P boxes of 8 x 64 bf16 per stage, armed once
    assert _mov_value(ptx, arms[0]) == p * 8 * 64 * 2
    assert ptx.count("cp.async.bulk.tensor.2d") == 1


def test_expect_tx_only_from_the_leader_every_warp_waits(ptx90):
    with_leader, without = ptx90["probe90_P3"], ptx90["probe90_P3_no_leader"]
    # no leader predicate -> no warp arms: the arm is reachable only through it
    assert "expect_tx" not in without
    # ...while every producer warp still waits on the empty barrier: the same
    # waits (producer empty, producer tail, consumer full) in both kernels
    waits = lambda s: s.count("mbarrier.try_wait.parity")  # noqa: E731
    assert waits(without) == waits(with_leader) >= 2
    # the arm sits behind a branch on the warp index, after the empty wait
    body = with_leader[with_leader.index("mbarrier.try_wait.parity"):]
    before_arm = body[: body.index("expect_tx")]
    assert re.search(r"@%p\d+ bra", before_arm)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_same_ptx_as_reference_module(ptx90, p):
    if not ptx_dump.reference_module_available():
        pytest.skip("cutlass.experimental.task_scheduling.pipeline not in this nvidia-cutlass-dsl")
    assert _normalise(ptx90[f"probe90_P{p}"]) == _normalise(ptx90[f"probe90_P{p}_reference"])


def test_async_umma_2cta_commit_is_peer_bit_cleared_cluster_arrive(ptx100):
    ptx = ptx100["probe100_async_thread_2cta"]
    arrives = re.findall(r"mbarrier\.arrive\.shared::cluster\.b64\s+_,\s*\[(%r\d+)\];", ptx)
    assert len(arrives) == 1
    (masks,) = [re.findall(rf"and\.b32\s+{re.escape(arrives[0])},\s*%r\d+,\s*(-?\d+);", ptx)]
    assert len(masks) == 1
    mask = int(masks[0]) & 0xFFFFFFFF
    # bit 24 (the SM100 peer bit) cleared; the compiler may also clear the low
    # bits it knows are zero in an 8-byte-aligned barrier address
    assert mask & (1 << 24) == 0 and (mask | 0x7) == 0xFEFFFFFF
    # the consumer releases with a 2-CTA tcgen05 commit to the peer mask
    assert "tcgen05.commit.cta_group::2" in ptx


def test_async_umma_1cta_uses_base_arrive(ptx100):
    ptx = ptx100["probe100_async_thread_1cta"]
    assert "mbarrier.arrive.shared::cluster.b64 _" not in ptx
    assert re.search(r"mbarrier\.arrive(\.release\.cta)?\.shared(::cta)?\.b64", ptx)
    assert "tcgen05.commit.cta_group::1" in ptx


def test_async_load_variant(ptx100):
    ptx = ptx100["probe100_async_load_2cta"]
    assert "cp.async.mbarrier.arrive.noinc.shared.b64" in ptx
    assert "mbarrier.arrive.shared::cluster" not in ptx
    assert "tcgen05.commit.cta_group::2" in ptx


@pytest.mark.parametrize("cluster, group", [("2cta", 2), ("1cta", 1)])
def test_umma_umma_commits(ptx100, cluster, group):
    ptx = ptx100[f"probe100_umma_umma_{cluster}"]
    commits = re.findall(r"tcgen05\.commit\.cta_group::(\d)", ptx)
    assert commits == [str(group)] * 2  # producer commit + consumer release
    if group == 2:
        assert ptx.count(".multicast::cluster") == 2


def test_other_producer_op_is_refused():
    import cutlass.pipeline as cp

    import ts_pipeline

    with pytest.raises(ValueError, match="AsyncThread or PipelineOp.AsyncLoad"):
        ts_pipeline.TSPipelineAsyncUmma.create(
            num_stages=2,
            producer_group=cp.CooperativeGroup(cp.Agent.Thread),
            consumer_group=cp.CooperativeGroup(cp.Agent.Thread),
            barrier_storage=None,
            producer_op=cp.PipelineOp.TmaLoad,
        )


def test_fields_and_signatures_match_spec():
    import dataclasses
    import inspect

    import ts_pipeline

    fields = [f.name for f in dataclasses.fields(ts_pipeline.TSPipelineTmaAsync)]
    assert fields == ["sync_object_full", "sync_object_empty", "num_stages", "producer_mask",
                      "consumer_mask", "is_signaling_thread", "is_task_warp_leader"]
    assert [f.name for f in dataclasses.fields(ts_pipeline.TSPipelineUmmaUmma)][-1] == "cta_group"
    assert [f.name for f in dataclasses.fields(ts_pipeline.TSPipelineAsyncUmma)][-1] == "producer_op"
    params = lambda cls: list(inspect.signature(cls.create).parameters)  # noqa: E731
    assert params(ts_pipeline.TSPipelineTmaAsync) == [
        "num_stages", "producer_group", "consumer_group", "tx_count", "barrier_storage",
        "is_task_warp_leader", "cta_layout_vmnk", "mcast_mode_mn", "defer_sync"]
    assert params(ts_pipeline.TSPipelineUmmaUmma) == [
        "num_stages", "producer_group", "consumer_group", "barrier_storage",
        "cta_layout_vmnk", "defer_sync"]
    assert params(ts_pipeline.TSPipelineAsyncUmma) == [
        "num_stages", "producer_group", "consumer_group", "barrier_storage",
        "cta_layout_vmnk", "producer_op", "defer_sync"]
