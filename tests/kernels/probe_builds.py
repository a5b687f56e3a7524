"""The probes' PTX builds, beside the kernels' own (``csrc_free_kernels.ptx_dump.BUILDS``):
the ``ts_pipeline`` probes, and kernel builds no call reaches that the tests read (a
configuration without raster bands; 2x1 cluster tiles; the store-warp epilogue, the pre-flight's bulk-copy
probe; the ping-pong warpgroups' turns; the GEMM's variants awaiting an A/B; FP8 mainloops under a lowered register cap).

    CUTE_DSL_ARCH=sm_90a python -m tests.kernels.probe_builds OUT_DIR '["probe90_P1", ...]'

is ``python -m csrc_free_kernels.ptx_dump`` with these builds too: the PTX tests
hand :data:`MODULE` to ``ptx_dump.dump`` (``main_module``), so that its child
process runs this module and the package never imports the tests.
"""

import dataclasses
import json
import sys

from csrc_free_kernels import ptx_dump
from csrc_free_kernels.common.family import Build

MODULE = "tests.kernels.probe_builds"


def _probe(name, make):
    return Build(name, ("probe", name), make, {"plain_compile": True})


def _probe90(name, p, stages=4, **kw):
    def build():
        import cutlass
        import cutlass.cute as cute

        from .pipeline_probe_sm90 import PipelineProbeSm90

        n = cute.sym_int()
        x = cute.runtime.make_fake_compact_tensor(
            cutlass.BFloat16, (n, 64), stride_order=(1, 0), assumed_align=16)
        y = cute.runtime.make_fake_compact_tensor(cutlass.BFloat16, (cute.sym_int(),),
                                                  assumed_align=16)
        if kw.pop("reference", False):
            from cutlass.experimental.task_scheduling import pipeline as ref
            kw["pipelines"] = ref
        return PipelineProbeSm90(p, stages, **kw), (x, y, cutlass.Int32(1), cutlass.Int32(1),
                                                     cute.runtime.make_fake_stream())
    return _probe(name, build)


def _probe100(name, kind, cluster_v=2):
    def build():
        import cutlass
        import cutlass.cute as cute

        from .pipeline_probe_sm100 import PipelineProbeSm100

        return PipelineProbeSm100(kind, cluster_v), (cutlass.Int32(1),
                                                     cute.runtime.make_fake_stream())
    return _probe(name, build)


def _whole_experts():
    """The prefill GEMM without raster bands (``band_m=0``): its schedule's other walk."""
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as c
    from csrc_free_kernels.hopper import grouped_gemm_sm90_launch as g

    b = g.build(dataclasses.replace(c.PREFILL, band_m=0))
    return dataclasses.replace(b, name="gemm_prefill_whole_experts")


def _cluster_tiles():
    """The prefill GEMM on 2x1 cluster tiles (a CTA pair on one 256-row tile, multicasting
    every weight part; lost to pair tiles, bench/notes/2026-12-07-gemm-core-h100.md): the
    pre-flight tests' plainest 2-CTA cluster, multicast loads and remote arrivals."""
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as c
    from csrc_free_kernels.hopper import grouped_gemm_sm90_launch as g

    return g.build(dataclasses.replace(c.PREFILL, name="prefill_c2", cluster_m=2))


def _store_warp():
    """The prefill GEMM whose output tiles a warp of their own stores, row by row, with
    bulk copies (a variant that lost its A/B; :mod:`.store_warp_probe`)."""
    import cutlass

    from csrc_free_kernels.common import compile as kcompile
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as c
    from csrc_free_kernels.hopper.grouped_gemm_sm90_launch import _fake_args

    from .store_warp_probe import GroupedGemmStoreWarpSm90

    def make():
        return GroupedGemmStoreWarpSm90(c.PREFILL), (
            *_fake_args(cutlass.BFloat16, cutlass.BFloat16, True, GroupedGemmStoreWarpSm90),
            cutlass.Int32(1), kcompile.fake_stream())

    return Build("gemm_prefill_sw", ("probe", "gemm_prefill_sw"), make, {})


def _pingpong():
    """The GEMM with ping-pong MMA warpgroups (a variant that lost its A/B;
    :mod:`.pingpong_probe`), with and without CTA pairs, K-major weights."""
    import torch

    from csrc_free_kernels.hopper import grouped_gemm_sm90_launch as g

    from .pingpong_probe import CONFIGS, GroupedGemmPingpongSm90

    return tuple(g.build(config, torch.bfloat16, torch.bfloat16, False,
                         kernel_cls=GroupedGemmPingpongSm90) for config in CONFIGS.values())


def _variants():
    """The sm_90 GEMM's variants awaiting an A/B (their own modules; no call reaches them)."""
    from csrc_free_kernels.hopper import grouped_gemm_sm90_gather

    return tuple(grouped_gemm_sm90_gather.builds())


def _capped(config, regs):
    """The widest FP8 mainloop (SwiGLU, blockwise) with its MMA warpgroups capped at
    ``regs`` registers: it must still not spill."""
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_config as c
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_launch as f

    b = f.build(c.CONFIGS[config], "blockwise", swiglu=True)

    def make():
        kernel, args = b.make()
        kernel.mma_regs = regs
        return kernel, args

    spec = {**b.spec, "regs": regs}
    return Build(f"{b.name}_r{regs}", (*b.key, ("mma_regs", regs)), make, spec)


BUILDS = {b.name: b for b in (
    *(_probe90(f"probe90_P{p}", p) for p in (1, 2, 3, 4)),
    *(_probe90(f"probe90_P{p}_reference", p, reference=True) for p in (1, 2, 3, 4)),
    _probe90("probe90_P3_no_leader", 3, leader_arms=False),
    _probe100("probe100_async_thread_2cta", "async_thread"),
    _probe100("probe100_async_thread_1cta", "async_thread", 1),
    _probe100("probe100_async_load_2cta", "async_load"),
    _probe100("probe100_umma_umma_2cta", "umma_umma"),
    _probe100("probe100_umma_umma_1cta", "umma_umma", 1),
    _whole_experts(), _cluster_tiles(), _store_warp(), *_pingpong(), *_variants(), _capped("fp8_decode", 168), _capped("fp8_mid", 168))}
ALL_BUILDS = {**BUILDS, **ptx_dump.BUILDS}
"""Every build the PTX tests compile: the probes, then the kernels'."""
SM100 = [n for n in ALL_BUILDS if n.startswith("probe100_") or (
    n in ptx_dump.BUILDS and ptx_dump.arch_of(n) == "sm_100a")]
"""The builds compiled for sm_100a (the others: sm_90a)."""


if __name__ == "__main__":
    ptx_dump.main(sys.argv[1], json.loads(sys.argv[2]), BUILDS)
