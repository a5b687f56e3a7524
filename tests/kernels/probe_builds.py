"""The probes' PTX builds, beside the kernels' own (``csrc_free_kernels.ptx_dump.BUILDS``).

    CUTE_DSL_ARCH=sm_90a python -m tests.kernels.probe_builds OUT_DIR '["probe90_P1", ...]'

is ``python -m csrc_free_kernels.ptx_dump`` with these builds too: the PTX tests
hand :data:`MODULE` to ``ptx_dump.dump`` (``main_module``), so that its child
process runs this module and the package never imports the tests.
"""

import json
import sys

from csrc_free_kernels import ptx_dump

MODULE = "tests.kernels.probe_builds"


def _probe90(p, stages=4, **kw):
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
    return build


def _probe100(kind, cluster_v=2):
    def build():
        import cutlass
        import cutlass.cute as cute

        from .pipeline_probe_sm100 import PipelineProbeSm100

        return PipelineProbeSm100(kind, cluster_v), (cutlass.Int32(1),
                                                     cute.runtime.make_fake_stream())
    return build


BUILDS = {
    **{f"probe90_P{p}": _probe90(p) for p in (1, 2, 3, 4)},
    **{f"probe90_P{p}_reference": _probe90(p, reference=True) for p in (1, 2, 3, 4)},
    "probe90_P3_no_leader": _probe90(3, leader_arms=False),
    "probe100_async_thread_2cta": _probe100("async_thread"),
    "probe100_async_thread_1cta": _probe100("async_thread", 1),
    "probe100_async_load_2cta": _probe100("async_load"),
    "probe100_umma_umma_2cta": _probe100("umma_umma"),
    "probe100_umma_umma_1cta": _probe100("umma_umma", 1),
}
ALL_BUILDS = {**BUILDS, **ptx_dump.BUILDS}
"""Every build the PTX tests compile: the probes, then the kernels'."""


if __name__ == "__main__":
    ptx_dump.main(sys.argv[1], json.loads(sys.argv[2]), ALL_BUILDS)
