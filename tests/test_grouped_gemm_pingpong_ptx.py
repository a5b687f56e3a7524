"""CPU: the ping-pong probe of the sm_90 GEMM (``tests/kernels/pingpong_probe.py``, a
variant that lost its A/B) compiles without local memory; its PTX has one warpgroup's 128x192 WGMMAs, a
constant named barrier for each warpgroup's turn and epilogue, and the pre-flight counts
each ring stage's releases once a warpgroup only because the kernel declares the turns."""

import dataclasses
import re

import pytest

from csrc_free_kernels import preflight

from .ptxas import ptx_fixture

BUILDS = ["gemm_pp192_bk", "gemm_pp192_c2_bk"]
ptx = ptx_fixture("sm_90a", BUILDS)


@pytest.mark.parametrize("name", BUILDS)
def test_one_warpgroup_a_tile(ptx, name):
    text = ptx[name]
    assert set(re.findall(r"wgmma\.mma_async\S*", text)) == {
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16"}
    # two m64 row blocks of four k16 steps a stage, traced once for both warpgroups
    assert len(re.findall(r"wgmma\.mma_async", text)) == 8
    assert "setmaxnreg.inc.sync.aligned.u32 \t232;" in text


@pytest.mark.parametrize("name", BUILDS)
def test_turn_and_epilogue_barriers_are_constants(ptx, name):
    bars = re.findall(r"\bbar\.(sync|arrive)\s+(\d+)(?:,\s*(\d+))?;", ptx[name])
    turns = {(op, i, n) for op, i, n in bars if i in ("3", "4")}
    assert turns == {("sync", "3", "256"), ("sync", "4", "256"),
                     ("arrive", "3", "256"), ("arrive", "4", "256")}
    epilogue = {(i, n) for op, i, n in bars if op == "sync" and i in ("1", "2")}
    assert epilogue == {("1", "128"), ("2", "128")}


@pytest.mark.parametrize("name", BUILDS)
def test_releases_count_once_a_turn(ptx_store, ptx, name):
    facts = ptx_store.facts("sm_90a", name)
    assert facts.turn_groups == [128, 256, 2] and facts.frame_bytes == 0
    assert preflight.check(name, ptx[name], facts) == []
    # undeclared, both warpgroups' releases would be one phase's: twice the init count
    found = preflight.check(name, ptx[name], dataclasses.replace(facts, turn_groups=None))
    assert found and {v.rule for v in found} == {"mbarrier-init"}
    assert all("but a phase gets" in v.why for v in found)
