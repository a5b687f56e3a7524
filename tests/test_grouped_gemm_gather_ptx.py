"""CPU: the gathering variant of the sm_90 GEMM (``grouped_gemm_sm90_gather``, awaiting
its A/B) passes the pre-flight (every build of ``tests/kernels/probe_builds.py`` does:
``test_preflight.py``); its PTX loads the tokens by ``cp.async`` only (no token TMA),
completes each stage by one ``cp.async.mbarrier.arrive.noinc`` a lane into barriers
counting 33, and fences the async proxy before the MMAs read a stage; the pre-flight
catches the fence or the arrival removed."""

import re

import pytest

from csrc_free_kernels.hopper import grouped_gemm_sm90_gather as variant

from .ptxas import ptx_fixture

BUILDS = [b.name for b in variant.builds()]
ptx = ptx_fixture("sm_90a", BUILDS)


def _config(name):
    return next(b for b in variant.builds() if b.name == name).spec["config"]


def test_builds_are_named_apart_from_the_shipped_ones():
    from csrc_free_kernels.hopper import grouped_gemm_sm90_launch as launch

    shipped = {b.name for b in launch.builds()}
    assert BUILDS and all(n.endswith("_gather") and n not in shipped for n in BUILDS)


@pytest.mark.parametrize("name", BUILDS)
def test_tokens_by_cp_async_stages_by_noinc_arrivals(ptx, name):
    text = ptx[name]
    cfg = _config(name)
    # a lane's copies of a stage: rows / 32 rows (one row in 32/rows lanes) x its chunks,
    # each a real row or the zero vector: twice that many cp.async in the code
    per_lane = cfg.rows * cfg.tile_k // 8 // 32
    assert len(re.findall(r"cp\.async\.cg\.shared\.global(?:\.L2::\d+B)?\s+\[", text)) == 2 * per_lane
    assert text.count("cp.async.mbarrier.arrive.noinc.shared") == 1
    assert "cp.async.wait_group" not in text and "cp.async.commit_group" not in text
    # only the weights come by TMA: one 3-D tensor load a weight warp
    loads = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d\.shared::cl?u?s?t?e?r?c?t?a?\.global", text)
    assert loads and set(loads) == {"3"}
    inits = re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*(\d+);", text)
    counts = {int(c) for c in inits} or _init_counts(text)
    assert 33 in counts
    assert "fence.proxy.async.shared::cta" in text
    assert ".local" not in text


def _init_counts(text):
    """The constant init counts where the PTX passes them in registers."""
    regs = re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*(%r\d+);", text)
    found = set()
    for reg in regs:
        m = re.search(rf"mov\.(?:b|u|s)32\s+{re.escape(reg)},\s*(\d+);", text)
        if m:
            found.add(int(m.group(1)))
    return found


def test_the_fence_precedes_every_mma_after_a_full_barrier(ptx):
    text = ptx["gemm_prefill_bk_gather"]
    order = re.findall(r"mbarrier\.try_wait\.parity|fence\.proxy\.async\.shared::cta|"
                       r"wgmma\.mma_async", text)
    first = order.index("wgmma.mma_async")
    assert "fence.proxy.async.shared::cta" in order[:first]
    last_fence = max(i for i, op in enumerate(order[:first]) if op.startswith("fence"))
    assert all(op.startswith("mbarrier") for op in order[:last_fence]) or \
        order[last_fence - 1].startswith("mbarrier")


@pytest.mark.parametrize("edit, rule", [("the consumers' fence removed", "proxy-fence"),
                                        ("the lanes' arrival removed", "mbarrier-init")])
def test_the_preflight_catches_a_broken_stage_hand_over(ptx_store, ptx, edit, rule):
    from csrc_free_kernels import preflight

    name = "gemm_prefill_p2_bk_gather"
    text, facts = ptx[name], ptx_store.facts("sm_90a", name)
    assert preflight.check(name, text, facts) == []
    needle = ("fence.proxy.async.shared::cta" if rule == "proxy-fence"
              else "cp.async.mbarrier.arrive.noinc")
    lines = [("" if needle in line else line) for line in text.split("\n")]
    found = preflight.check(name, "\n".join(lines), facts)
    assert found and {v.rule for v in found} == {rule}
