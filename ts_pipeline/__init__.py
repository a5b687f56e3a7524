"""Task-scheduled (TS) pipelines for CuTeDSL kernels.

Three pipeline classes with the public surface of
``cutlass.experimental.task_scheduling.pipeline`` (nvidia-cutlass-dsl 4.8.1),
built on the public ``cutlass.pipeline`` classes:

- :class:`TSPipelineTmaAsync`: several TMA producer warps of one task fill one
  stage under one full barrier, armed once by the task's first warp.
- :class:`TSPipelineUmmaUmma`: a tcgen05 (UMMA) producer feeding a UMMA consumer.
- :class:`TSPipelineAsyncUmma`: thread or cp.async producers feeding a UMMA
  consumer, with CUTLASS's 2-SM producer-commit rule.

Code written for the reference module runs unchanged with ``import ts_pipeline``.
"""

from .tma import TSPipelineTmaAsync
from .umma import TSPipelineAsyncUmma, TSPipelineUmmaUmma

__all__ = ["TSPipelineTmaAsync", "TSPipelineUmmaUmma", "TSPipelineAsyncUmma"]
