"""CPU: the k-grouped (weight-gradient) GEMM compiles for sm_90a; its PTX has the
instructions the design relies on, assembles without spills, and the host-side
pieces (schedule decode, validators, entry checks, reference) behave."""

import re

import pytest
import torch

from csrc_free_kernels import ptx_dump
from csrc_free_kernels.hopper import GEMM_DW_SM90

from .ptxas import NO_SPILLS, PTXAS, assemble, ptx_fixture

BUILDS = ptx_dump.builds_of(GEMM_DW_SM90)


def dw():
    from csrc_free_kernels.hopper import grouped_gemm_dw_sm90
    return grouped_gemm_dw_sm90


def dwc():
    from csrc_free_kernels.hopper import grouped_gemm_dw_sm90_config
    return grouped_gemm_dw_sm90_config


ptx = ptx_fixture("sm_90a", BUILDS)


def _build(name):
    """(configuration, {"dtype": ..., "out": ...}) of build ``name``, dtypes by name."""
    spec = ptx_dump.BUILDS[name].spec
    return spec["config"], {"dtype": str(spec["ab_dtype"]).split(".")[-1],
                            "out": str(spec["c_dtype"]).split(".")[-1]}


def test_every_configuration_is_built(ptx):
    assert set(BUILDS) <= set(ptx)
    assert {_build(n)[0].name for n in BUILDS} == set(dwc().CONFIGS)
    assert any(_build(n)[1]["out"] == "float32" for n in BUILDS)
    assert any(_build(n)[1]["dtype"] == "float16" for n in BUILDS)


@pytest.mark.parametrize("name", BUILDS)
def test_kernel_ptx(ptx, name):
    text = ptx[name]
    cfg, kw = _build(name)
    dtype = "f16" if kw["dtype"] == "float16" else "bf16"
    # each MMA warpgroup: 64 x tile_n x 16, fp32 accumulators, both operands from smem
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(\w+)\.(\w+)", text)
    assert wgmma and set(wgmma) == {(f"m64n{cfg.tile_n}k16", dtype, dtype)}
    assert len(wgmma) == cfg.tile_k // 16  # one chunk's k-blocks, one mainloop site
    # TMA loads (2-D: a^T and dy), 64-element (128-byte) boxes: tile_m / 64 of
    # a^T from warp 0, tile_n / dy_warps / 64 of dy from each dy warp
    loads = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d\.shared::cta\.global", text)
    assert set(loads) == {"2"}
    assert len(loads) == cfg.tile_m // 64 + cfg.tile_n // cfg.dy_warps // 64
    assert ".multicast::cluster" not in text
    # one expect_tx site (the task warp leader), with the whole stage's bytes
    arms = re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64\s+\S+,\s*\[\S+\],\s*(%r\d+);",
                      text)
    assert len(arms) == 1
    (value,) = re.findall(rf"mov\.b32\s+{re.escape(arms[0])},\s*(\d+);", text)
    assert int(value) == cfg.stage_bytes
    assert "setmaxnreg.dec.sync.aligned.u32 \t40;" in text
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32 \t2(32|40);", text)
    # the tail rows of the last chunk: 16-byte zero stores into both operand
    # tiles, the generic -> async proxy fence, then the TAIL named barrier of
    # all MMA threads, before the first WGMMA of the chunk
    mma_threads = 128 * cfg.mma_warpgroups
    zeros = [m.start() for m in re.finditer(r"st\.shared\.v4\.b32\s+\[%r\d+\],\s*\{0, 0, 0, 0\};",
                                            text)]
    assert len(zeros) == 2
    fence = text.index("fence.proxy.async.shared::cta;")
    tail = text.index(f"bar.sync \t{int(dw().Barrier.TAIL)}, {mma_threads};")
    first_mma = text.index("wgmma.mma_async")
    assert max(zeros) < fence < tail < first_mma
    assert re.search(rf"bar\.sync \t{int(dw().Barrier.EPILOGUE)}, {mma_threads};", text)
    # deterministic: no atomics or reductions to global memory
    assert not re.search(r"\b(atom|red)\.", text)
    assert ("stmatrix" in text) == (kw["out"] != "float32")
    assert ".local" not in text
    stores = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d\.global\.shared::cta\.tile\.bulk_group",
                        text)
    # one 3-D (N, K, expert) TMA store per 32-column epilogue sub-tile, no thread stores
    assert stores == ["3"] * (cfg.tile_n // 32)
    assert "st.global" not in text
    buffers = dw().GroupedGemmDwSm90(cfg).epi_buffers(32 if kw["out"] == "float32" else 16)
    assert buffers == (2 if kw["out"] == "float32" else 4)
    _check_tma_store_order(text, mma_threads, buffers)
    # the named barriers are the kernel's two, among all its MMA threads
    assert set(re.findall(r"bar\.(?:sync|arrive)\s+(\d+), (\d+);", text)) == {
        (str(int(b)), str(mma_threads)) for b in dw().Barrier}


def _check_tma_store_order(text, mma_threads, buffers):
    """Each sub-tile: its shared-memory writes, the generic -> async proxy
    fence, the store warp's read-side bulk wait (all but the last
    ``buffers - 2`` stores have read their buffers: the next sub-tile's is
    free), the EPILOGUE barrier, then one elected lane issues the store and
    commits its bulk group; before exit a full wait for all stores."""
    epi_bar = f"bar.sync \t{int(dw().Barrier.EPILOGUE)}, {mma_threads};"
    store_re = r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta"
    stores = [m.start() for m in re.finditer(store_re, text)]
    prev = text.index("wgmma.wait_group.sync.aligned \t0;")  # the end of a tile's mainloop
    for pos in stores:
        seg = text[prev:pos]
        last_write = max(seg.rfind("stmatrix"), seg.rfind("st.shared"))
        fence = seg.rfind("fence.proxy.async.shared::cta;")
        wait = seg.rfind(f"cp.async.bulk.wait_group.read \t{buffers - 2};")
        bar = seg.rfind(epi_bar)
        assert 0 <= last_write < fence < bar and 0 <= wait < bar, seg
        # exactly one lane: one elect.sync between the barrier and the store
        assert seg[bar:].count("elect.sync") == 1, seg[bar:]
        after = text[pos:text.index("\n", text.index("\n", pos) + 1)]
        assert after.splitlines()[-1].strip() == "cp.async.bulk.commit_group;"
        prev = pos
    assert len(re.findall(r"cp\.async\.bulk\.wait_group\.read \t(\d+);", text)) == len(stores)
    final = text.rindex("cp.async.bulk.wait_group \t0;")
    assert final > stores[-1] and "ret;" in text[final:]


@pytest.mark.skipif(PTXAS is None, reason="needs ptxas")
@pytest.mark.parametrize("name", BUILDS)
def test_ptxas_no_spills(ptx, name, tmp_path):
    info = assemble(ptx[name], "sm_90a", tmp_path)
    assert "0 bytes stack frame, " + NO_SPILLS in info, info
    # the WGMMA fence sits in the mainloop: ptxas injects none of its own
    assert "C7519" not in info and "serialized" not in info, info


@pytest.mark.parametrize("m_tiles, n_tiles, band_n", [
    (32, 112, 8), (56, 16, 8), (3, 5, 2), (1, 1, 8), (4, 7, 3), (16, 6, 16)])
def test_schedule_decode_is_a_bijection(m_tiles, n_tiles, band_n):
    from csrc_free_kernels.common.tile_schedule import KGroupedTileSchedule

    experts = 3
    tiles = [KGroupedTileSchedule.tile_coords(t, m_tiles, n_tiles, band_n)
             for t in range(experts * m_tiles * n_tiles)]
    assert sorted(tiles) == [(e, m, n) for e in range(experts) for m in range(m_tiles)
                             for n in range(n_tiles)]
    # expert-major; within a band of band_n n-tiles the n-tile is fastest
    assert [u[0] for u in tiles] == sorted(u[0] for u in tiles)
    if n_tiles >= band_n > 1 and m_tiles > 1:
        assert tiles[:band_n + 1] == [(0, 0, n) for n in range(band_n)] + [(0, 1, 0)]


def test_configs_validate():
    import dataclasses

    g, c = dw(), dwc()
    for bad, msg in [(dict(tile_n=320), "tile_n"), (dict(tile_m=192), "tile_m"),
                     (dict(dy_warps=3), "dy_warps"), (dict(tile_n=192, dy_warps=2), "dy part"),
                     (dict(tile_k=24), "tile_k"), (dict(band_n=0), "band_n")]:
        with pytest.raises(ValueError, match=msg):
            g.GroupedGemmDwSm90(dataclasses.replace(c.WIDE, **bad))


@pytest.mark.parametrize("config", ["dw_128x256", "dw_128x128"])
@pytest.mark.parametrize("c_bits", [16, 32])
def test_stages_fit_shared_memory(config, c_bits):
    g = dw()
    cfg = dwc().CONFIGS[config]
    kernel = g.GroupedGemmDwSm90(cfg)
    stages = kernel.stage_count(16, c_bits)
    assert stages == cfg.stages  # an fp32 epilogue still leaves every stage
    epi = kernel.epi_buffers(c_bits) * cfg.tile_m * 32 * c_bits // 8
    assert epi == kernel.epi_bytes
    assert stages * cfg.stage_bytes + epi + 16 * stages + 4 * g.MAX_EXPERTS <= g.SMEM_CAPACITY


def test_stage_count_shrinks_to_fit():
    import dataclasses

    g, c = dw(), dwc()
    assert g.GroupedGemmDwSm90(dataclasses.replace(c.WIDE, stages=8)).stage_count(16, 16) == 4
    with pytest.raises(ValueError, match="room for 1 stages"):
        g.GroupedGemmDwSm90(dataclasses.replace(c.WIDE, tile_k=256)).stage_count(16, 32)


@pytest.mark.parametrize("name", BUILDS)
def test_shared_storage_layout(ptx, name):
    """The barriers sit right after the stages and epilogue buffers: the
    compiled stage count is the planned one."""
    cfg, kw = _build(name)
    c_bits = 32 if kw["out"] == "float32" else 16
    kernel = dw().GroupedGemmDwSm90(cfg)
    stages = kernel.stage_count(16, c_bits)
    barriers = stages * cfg.stage_bytes + kernel.epi_buffers(c_bits) * cfg.tile_m * 32 * c_bits // 8
    assert re.search(rf"mbarrier\.arrive\.expect_tx\.shared\.b64\s+\S+,\s*\[%r\d+\+{barriers}\]",
                     ptx[name])
    # the ring's barriers: `stages` full ones (1 arrival: the leader's
    # expect_tx), then `stages` empty ones (one arrival per MMA warp)
    inits = re.findall(r"mbarrier\.init\.shared\.b64\s+\[%r\d+\+(\d+)\],\s*(%r\d+);", ptx[name])
    regs = {r: int(v) for r, v in re.findall(r"mov\.b32\s+(%r\d+),\s*(\d+);", ptx[name])}
    assert [(int(off), regs[reg]) for off, reg in inits] == (
        [(barriers + 8 * s, 1) for s in range(stages)]
        + [(barriers + 8 * (stages + s), 4 * cfg.mma_warpgroups) for s in range(stages)])


@pytest.mark.parametrize("shape, name", [
    ((8, 4096, 28672, 8192), "dw_128x256"),      # Mixtral gate_up dW
    ((256, 7168, 4096, 131072), "dw_128x256"),   # DeepSeek-V3 gate_up dW
    ((128, 2048, 1536, 131072), "dw_128x256"),   # Qwen3 gate_up dW
    ((1, 256, 256, 64), "dw_128x128"),           # a few output tiles
    ((8, 512, 512, 4096), "dw_128x128"),
])
def test_choose_config(shape, name):
    cfg = dwc().choose_config(*shape)
    assert cfg.name == name


def test_store_warp_is_an_mma_warp():
    """The TMA stores are issued by an MMA warp: it meets the others at the
    EPILOGUE barrier before each store."""
    g = dw()
    assert g.Warp.MMA <= g.Warp.EPI_STORE < g.Warp.MMA + 4


def _args(m=64, k=32, n=48, e=4, dtype=torch.bfloat16, out_dtype=None):
    a = torch.randn(m, k, dtype=dtype)
    dy = torch.randn(m, n, dtype=dtype)
    offs = torch.tensor([10, 10, 40, 60][:e], dtype=torch.int32)
    out = torch.empty(e, k, n, dtype=out_dtype or dtype)
    return a, dy, offs, out


@pytest.mark.parametrize("a, dy, reason", [
    (torch.randn(32, 64), torch.randn(64, 48), "bf16 or fp16"),           # fp32 operands
    (torch.randn(36, 64).bfloat16(), torch.randn(64, 48).bfloat16(), "multiples of 8"),
    (torch.randn(32, 64).bfloat16(), torch.randn(64, 44).bfloat16(), "multiples of 8"),
])
def test_backend_declines_what_it_cannot_run(a, dy, reason):
    """The op validated the call; the backend declines, with its reason, what its kernel
    cannot take, before anything compiles (the op then runs the next path)."""
    from csrc_free_kernels.common.kernel_config import Declined
    from csrc_free_kernels.hopper.grouped_gemm_dw_sm90_launch import GROUPED_GEMM_K

    offs = torch.tensor([10, 40, 64], dtype=torch.int32)
    out = torch.empty(3, a.shape[0], dy.shape[1])
    got = GROUPED_GEMM_K.choose_config(a, dy, offs, out)
    assert isinstance(got, Declined) and reason in got.reason


def test_backend_takes_16_bit_multiples_of_8():
    from csrc_free_kernels.hopper.grouped_gemm_dw_sm90_launch import GROUPED_GEMM_K

    a, dy = torch.randn(32, 64).bfloat16(), torch.randn(64, 48).bfloat16()
    offs = torch.tensor([10, 40, 64], dtype=torch.int32)
    cfg = GROUPED_GEMM_K.choose_config(a, dy, offs, torch.empty(3, 32, 48))
    assert cfg.name in dwc().CONFIGS


def test_reference_matches_ts_moe_convention():
    from ts_moe.reference import grouped_gemm_k_reference as ts_ref

    a, dy, _, _ = _args(m=50)
    offs = torch.tensor([5, 3, 30, 70, 20], dtype=torch.int32)  # invalid: cummax + clamp
    ref = ts_ref(a.t(), dy, offs, torch.float32)  # the kernel's a (M, K) is the op's a.t()
    assert ref.shape == (5, 32, 48)
    torch.testing.assert_close(ref[0], a[:5].float().t() @ dy[:5].float())
    assert (ref[1] == 0).all() and (ref[4] == 0).all()  # empty after cummax
    torch.testing.assert_close(ref[2], a[5:30].float().t() @ dy[5:30].float())
    torch.testing.assert_close(ref[3], a[30:50].float().t() @ dy[30:50].float())
