"""CPU: the TMA-store epilogue variant of the sm_90 GEMM (``grouped_gemm_sm90_tma_store``,
awaiting its A/B) compiles without local memory and passes the pre-flight (every build
of ``tests/kernels/probe_builds.py`` does: ``test_preflight.py``); its PTX stores each
sub-tile of a whole tile by one TMA store in a bulk group of its own, waits before each
sub-tile's barrier until the store that read the buffer it reuses is done, and waits for
all of them before the CTA exits; a partial tile still has the predicated thread stores."""

import re

import pytest

from csrc_free_kernels.hopper import grouped_gemm_sm90_tma_store as variant

from .ptxas import ptx_fixture

BUILDS = [b.name for b in variant.builds()]
ptx = ptx_fixture("sm_90a", BUILDS)


def _subtiles(name):
    """Sub-tiles of one output tile: ``tile_m x out_tile_n`` in ``min(tile_m, 128) x 32``
    epilogue tiles (the SwiGLU kernel's output tile is half the weight tile)."""
    b = next(b for b in variant.builds() if b.name == name)
    cfg = b.spec["config"]
    out_n = cfg.tile_n // 2 if b.spec["swiglu"] else cfg.tile_n
    return (cfg.tile_m // min(cfg.tile_m, 128)) * (out_n // 32)


def test_builds_are_named_apart_from_the_shipped_ones():
    from csrc_free_kernels.hopper import grouped_gemm_sm90_launch as launch

    shipped = {b.name for b in launch.builds()}
    assert BUILDS and all(n.endswith("_tma_store") and n not in shipped for n in BUILDS)


@pytest.mark.parametrize("name", BUILDS)
def test_one_tma_store_a_subtile_each_in_its_group(ptx, name):
    text = ptx[name]
    n = _subtiles(name)
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", text)) == n
    assert text.count("cp.async.bulk.commit_group") == n
    # the wait before each sub-tile's barrier (two buffers: none may stay pending), and
    # the last one before the CTA exits
    waits = re.findall(r"cp\.async\.bulk\.wait_group\.read\s+(\d+);", text)
    assert waits == ["0"] * (n + 1)
    assert text.count("fence.proxy.async.shared::cta") >= n
    assert "st.global.v4" in text  # the partial tiles' predicated stores
    assert "elect.sync" in text


def test_the_wait_precedes_the_barrier_it_guards(ptx):
    text = ptx["gemm_prefill_p2_bk_tma_store"]
    order = re.findall(r"cp\.async\.bulk\.wait_group\.read|bar\.sync\s+1,|"
                       r"cp\.async\.bulk\.tensor\.2d\.global", text)
    # per sub-tile: wait, barrier, then the store (the last wait: at the exit)
    first = order.index("cp.async.bulk.wait_group.read")
    assert order[first:first + 3] == ["cp.async.bulk.wait_group.read",
                                      order[first + 1], "cp.async.bulk.tensor.2d.global"]
    assert order[first + 1].startswith("bar.sync")


@pytest.mark.parametrize("edit", ["the second wait removed", "the first wait one group deeper"])
def test_the_preflight_catches_a_buffer_reused_too_early(ptx_store, ptx, edit):
    """The pre-flight's ``bulk-store-reuse`` rule over this variant's ring: without the
    wait before a sub-tile's barrier, or with one that leaves a store pending, the next
    stmatrix writes a buffer a TMA store may still be reading."""
    from csrc_free_kernels import preflight

    name = "gemm_prefill_p2_bk_tma_store"
    text, facts = ptx[name], ptx_store.facts("sm_90a", name)
    assert preflight.check(name, text, facts) == []
    lines = text.split("\n")
    waits = [i for i, line in enumerate(lines) if "cp.async.bulk.wait_group.read" in line]
    if edit == "the second wait removed":
        lines[waits[1]] = ""
    else:
        lines[waits[0]] = lines[waits[0]].replace("read \t0;", "read \t1;")
    found = preflight.check(name, "\n".join(lines), facts)
    assert found and {v.rule for v in found} == {"bulk-store-reuse"}
    assert all("bulk store" in v.why and v.line for v in found)
