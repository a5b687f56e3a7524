"""CPU: every sm_100a configuration of the Blackwell grouped GEMM compiles, and its
PTX has the instructions its design relies on.  No Blackwell GPU exists here:
this (with the protocol model check) is all the verification the kernel has."""

import re

import pytest

from csrc_free_kernels import ptx_dump
from csrc_free_kernels.sm100 import GEMM_SM100

from .ptxas import NO_SPILLS, PTXAS, assemble, ptx_fixture, registers, run_for_arch

BUILDS = ptx_dump.builds_of(GEMM_SM100)
PEER_BIT = 1 << 24
ptx = ptx_fixture("sm_100a", BUILDS)


def test_every_configuration_is_built(ptx):
    from csrc_free_kernels.sm100 import grouped_gemm_sm100_config as g

    assert set(BUILDS) <= set(ptx)
    built = {ptx_dump.BUILDS[n].spec["config"].name for n in BUILDS}
    assert built == set(g.CONFIGS)
    assert any(ptx_dump.BUILDS[n].spec["swiglu"] for n in BUILDS)
    assert any(not ptx_dump.BUILDS[n].spec["gather"] for n in BUILDS)


@pytest.mark.parametrize("name", BUILDS)
def test_two_cta_mma_and_commits(ptx, name):
    text = ptx[name]
    assert re.search(r"tcgen05\.mma\.cta_group::2\.kind::f16", text)
    assert "tcgen05.mma.cta_group::1" not in text
    # the MMA releases the token and weight stages and commits the accumulator:
    # tcgen05.commit multicast to the pair
    commits = re.findall(r"tcgen05\.commit\.cta_group::2\.mbarrier::arrive::one"
                         r"\.shared::cluster\.multicast::cluster\.b64", text)
    assert len(commits) >= 3
    assert re.search(r"tcgen05\.alloc\.cta_group::2", text)
    assert re.search(r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32", text)
    assert ".local" not in text  # nothing spilled to local memory in the PTX


@pytest.mark.parametrize("name", BUILDS)
def test_gather_commits_to_the_leader_barrier(ptx, name):
    """Each gather thread: 16-byte cp.async, wait, proxy fence, then one
    mbarrier.arrive...shared::cluster on its full barrier's address with the peer
    bit cleared (the leader CTA's barrier), never a destination-rank arrive."""
    text = ptx[name]
    assert len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*, 16;", text)) >= 1
    masked = dict(re.findall(r"and\.b32\s+(%r\d+),\s*%r\d+,\s*(-?\d+);", text))
    commits = [m for m in re.finditer(
        r"fence\.proxy\.async\.shared::cta;\s*and\.b32\s+(%r\d+),\s*%r\d+,\s*(-?\d+);"
        r"(?:\s*//[^\n]*)*\s*mbarrier\.arrive(\.release\.cluster)?\.shared::cluster\.b64\s+_,"
        r"\s*\[(%r\d+)\];", text)]
    assert len(commits) == 1, "one per-thread commit site in the gather loop"
    reg, mask, _, arrive_reg = commits[0].groups()
    assert reg == arrive_reg and masked[reg] == mask
    assert (int(mask) & 0xFFFFFFFF) & PEER_BIT == 0, "the peer bit must be cleared"
    assert (int(mask) & 0xFFFFFFFF) | 0xFF == 0xFEFFFFFF | 0xFF, "only the peer bit (and alignment)"
    # the gather barrier counts every gather thread of both CTAs: 256 arrivals
    assert re.search(r"mov\.b32\s+%r\d+, 256;\s*mbarrier\.init\.shared\.b64", text)


@pytest.mark.parametrize("name", BUILDS)
def test_weights_by_tma_armed_once_per_stage(ptx, name):
    text = ptx[name]
    loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\.tile"
                       r"\.mbarrier::complete_tx::bytes[^ ]*\.cta_group::2", text)
    assert loads, "2-CTA TMA loads of the weight halves"
    # one arming site: the leader's expect_tx with both halves' bytes
    assert len(re.findall(r"mbarrier\.arrive\.expect_tx", text)) == 1


@pytest.mark.skipif(PTXAS is None, reason="ptxas not installed")
@pytest.mark.parametrize("name", BUILDS)
def test_no_spills_when_assembled(ptx, name, tmp_path):
    """ptxas for sm_100a: registers per configuration, and no spill."""
    info = assemble(ptx[name], "sm_100a", tmp_path)
    used = registers(info)
    print(f"{name}: {used} registers")
    assert NO_SPILLS in info
    assert used * 320 <= 65536  # one CTA of 320 threads per SM


def test_gather_writes_the_bytes_the_mma_reads(tmp_path):
    """The gather threads' (row, k, stage) view of the A stages and the MMA's layout
    are the same map: offset 64 r + k + 8192 s (bf16, tile_k 64), under the same
    128-byte swizzle.  Both layouts are pinned as cutlass 4.8.1 builds them."""
    script = tmp_path / "probe_layouts.py"  # the DSL compiles from source files only
    script.write_text(
        "import cutlass, cutlass.cute as cute\n"
        "from csrc_free_kernels.sm100 import grouped_gemm_sm100 as g\n"
        "from csrc_free_kernels.sm100.grouped_gemm_sm100_config import WIDE\n"
        "k = g.GroupedGemmSm100(WIDE, gather=True, b_n_major=True)\n"
        "@cute.jit\n"
        "def probe():\n"
        "    k._setup(cutlass.BFloat16, cutlass.BFloat16, False)\n"
        "    print('MMA', k.a_smem_layout)\n"
        "    print('LOAD', k.a_load_layout())\n"
        "probe()\n")
    out = run_for_arch("sm_100a", [str(script)], timeout=300)
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    # MMA: ((rows, k in atom), 1, k atoms, stages) -> 64 r + k%16 + 16 (k//16) + 8192 s
    assert lines["MMA"] == "S<3,4,3> o 0 o ((128,16),1,4,6):((64,1),0,16,8192)"
    # gather view: ((r%8, r//8), (k, 1), (1, stages)) -> 64 (r%8) + 512 (r//8) + k + 8192 s
    assert lines["LOAD"] == "S<3,4,3> o 0 o ((8,16),(64,1),(1,6)):((64,512),(1,0),(0,8192))"


def test_choose_config_counts_pair_tiles():
    """256 columns while they make two waves of pair tiles over 74 pairs, else 128."""
    from csrc_free_kernels.sm100 import grouped_gemm_sm100_config as g

    assert g.choose_config(8, 28672, 4096, 16384) is g.WIDE       # Mixtral gate_up, prefill
    assert g.choose_config(8, 4096, 14336, 32) is g.NARROW        # Mixtral down, decode
    assert g.choose_config(256, 4096, 7168, 8192) is g.WIDE       # DeepSeek gate_up: 256 experts
    assert g.choose_config(256, 4096, 7168, 8) is g.NARROW        # 8 rows: 8 experts at most
