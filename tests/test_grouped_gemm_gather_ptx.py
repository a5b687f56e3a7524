"""CPU: the gathering variant of the sm_90 GEMM (``grouped_gemm_sm90_gather``, awaiting
its A/B) passes the pre-flight (every build of ``tests/kernels/probe_builds.py`` does:
``test_preflight.py``); its PTX loads the tokens by ``cp.async`` only (no token TMA),
completes each stage by one ``cp.async.mbarrier.arrive.noinc`` a lane into barriers
counting 33, and fences the async proxy before the MMAs read a stage; the pre-flight
catches the fence or the arrival removed."""

import re

import pytest

from csrc_free_kernels.hopper import grouped_gemm_sm90_gather as variant

from .ptxas import NO_SPILLS, PTXAS, assemble, ptx_fixture

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
    # a lane's copies of a stage (rows / 16 rows, half the chunks of each; 16-row boxes:
    # the same), each from the row or from the zero vector: twice that many copy
    # instructions in the code
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


@pytest.mark.skipif(PTXAS is None, reason="needs ptxas")
@pytest.mark.parametrize("name", BUILDS)
def test_ptxas_no_spills(ptx, name, tmp_path):
    info = assemble(ptx[name], "sm_90a", tmp_path)
    assert "0 bytes stack frame, " + NO_SPILLS in info, info


def _init_counts(text):
    """The constant init counts where the PTX passes them in registers."""
    regs = re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*(%r\d+);", text)
    found = set()
    for reg in regs:
        m = re.search(rf"mov\.(?:b|u|s)32\s+{re.escape(reg)},\s*(\d+);", text)
        if m:
            found.add(int(m.group(1)))
    return found


@pytest.mark.parametrize("name", ["gemm_prefill_bk_gather", "gemm_decode16_bk_gather"])
def test_every_mma_follows_a_fence_after_its_stage_barrier(ptx, name):
    """Each wgmma: between it and the nearest full-barrier wait before it (the
    consumer's), a fence.proxy.async."""
    order = [(m.start(), m.group(0)) for m in re.finditer(
        r"mbarrier\.try_wait\.parity|fence\.proxy\.async\.shared::cta|wgmma\.mma_async",
        ptx[name])]
    mmas = [i for i, (_, op) in enumerate(order) if op == "wgmma.mma_async"]
    assert mmas
    for i in mmas:
        before = [op for _, op in order[:i] if op != "wgmma.mma_async"]
        assert before and before[-1].startswith("fence"), (name, order[i][0])


NOINC = re.compile(r"cp\.async\.mbarrier\.arrive\.noinc\.shared(?:::cta)?\.b64\s+(\[[^\]]+\]);")


@pytest.mark.parametrize("edit, rule", [
    ("the consumers' fence removed", "proxy-fence"),
    ("the lanes' arrival removed", "mbarrier-init"),
    ("a plain arrival instead, the copies maybe in flight", "proxy-fence")])
def test_the_preflight_catches_a_broken_stage_hand_over(ptx_store, ptx, edit, rule):
    from csrc_free_kernels import preflight

    name = "gemm_prefill_p2_bk_gather"
    text, facts = ptx[name], ptx_store.facts("sm_90a", name)
    assert preflight.check(name, text, facts) == []
    if edit.startswith("a plain"):
        edited = NOINC.sub(r"mbarrier.arrive.shared.b64 %rd9999, \1;", text)
        assert edited != text
    else:
        needle = ("fence.proxy.async.shared::cta" if rule == "proxy-fence"
                  else "cp.async.mbarrier.arrive.noinc")
        edited = "\n".join("" if needle in line else line for line in text.split("\n"))
    found = preflight.check(name, edited, facts)
    assert found and {v.rule for v in found} == {rule}


def test_launch_refuses_a_partial_k_chunk_before_any_kernel():
    import torch

    from csrc_free_kernels.hopper.grouped_gemm_sm90_config import CONFIGS

    a = torch.zeros(4, 12, dtype=torch.bfloat16)  # K = 12: not whole 16-byte chunks
    b = torch.zeros(2, 12, 16, dtype=torch.bfloat16)
    out = torch.full((3, 16), float("nan"), dtype=torch.bfloat16)
    index = torch.zeros(3, dtype=torch.int32)
    offs = torch.tensor([1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="K = 12 is not a multiple of 8"):
        variant.launch(a, b, offs, out, index, CONFIGS["prefill"])


def test_no_token_rows_give_zero_rows_without_a_kernel():
    import torch

    from csrc_free_kernels.hopper.grouped_gemm_sm90_config import CONFIGS

    a = torch.zeros(0, 16, dtype=torch.bfloat16)
    out = torch.full((3, 8), float("nan"), dtype=torch.bfloat16)
    got = variant.launch(a, torch.zeros(2, 16, 8, dtype=torch.bfloat16),
                         torch.tensor([1, 3], dtype=torch.int32), out,
                         torch.tensor([0, -1, 5], dtype=torch.int32), CONFIGS["prefill"])
    assert got is out and (out == 0).all()
