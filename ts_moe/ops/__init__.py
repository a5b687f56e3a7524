"""The ``torch.ops.ts_moe`` operators, and the one place that decides how each call runs.

Modules, one job each:

- :mod:`.gemm`: ``grouped_gemm`` (schema, CPU/CUDA/fake kernels, gradient);
- :mod:`.swiglu`: ``grouped_gemm_swiglu``, ``swiglu``, ``swiglu_backward``;
- :mod:`.routing`: ``router_logits``, ``route_slots``, ``sort_slots``,
  ``combine``, and the router-kernel switch;
- :mod:`.scaled`: the FP8 ``scaled_grouped_gemm`` and its SwiGLU form;
  :mod:`.quantize`: ``quantize_fp8`` (the formats: :mod:`ts_moe.fp8`);
- :mod:`.library`: the ``torch.library.Library`` and how an op registers;
- :mod:`.paths`: which backends a call tries, in order (device, dtypes, settings),
  from one table for every op family;
- :mod:`.backend`: the interface every backend of an op family offers
  (``choose_config``, ``run``) and the one rule that picks a backend
  (:func:`~.backend.take`: the first that takes the call, a refused kernel build
  declining it);
- :mod:`.kernels`: the kernel families (``csrc_free_kernels.families``), loaded
  once, each under its own guard; :mod:`.torch_backend`, :mod:`.reference_backend`
  (and :mod:`ts_moe.fp8.backends`): the others;
- :mod:`.layout`: what the ops allocate and the views backends receive.

From ``ts_moe.grouped_gemm`` to the pipeline, a bf16 call on an H100/H200::

    ts_moe/ops/gemm.py        grouped_gemm              -> torch.ops.ts_moe.grouped_gemm
    ts_moe/ops/library.py     autograd_kernel.kernel    no gradient wanted: the CUDA kernel, direct
    ts_moe/ops/gemm.py        _cuda                     paths.device_capability;
                                                        checks.layout_ready: validated once
    ts_moe/ops/gemm.py        dispatch                  paths.backends, backend.take:
                                                        choose_config, then backend.run
    csrc_free_kernels/hopper/grouped_gemm_sm90_launch.py
                              GroupedGemmBackend        choose_config (grouped_gemm_sm90_config),
                                                        run -> _launch: the compiled kernel, once
    csrc_free_kernels/hopper/grouped_gemm_sm90.py
                              GroupedGemmSm90           __call__ -> kernel -> make_ring
    ts_pipeline/tma.py        TSPipelineTmaAsync.create the producers' stage ring
"""

from .backend import PROTOCOLS, Op
from .gemm import grouped_gemm, grouped_gemm_backward, scatter_rows
from .paths import (Path, choose_path, fp8_kernels_enabled, graph_path, kernel_arch,
                    use_fp8_kernels, use_sm100_kernel)
from .quantize import quantize_fp8
from .routing import (combine, gather_rows, permute, route, route_slots, router_kernel_enabled,
                      router_logits, sort_slots, use_router_kernel)
from .scaled import scaled_grouped_gemm, scaled_grouped_gemm_swiglu
from .swiglu import grouped_gemm_swiglu, grouped_gemm_swiglu_backward

__all__ = [
    "PROTOCOLS", "Op", "Path", "choose_path", "combine", "fp8_kernels_enabled", "gather_rows",
    "graph_path", "grouped_gemm", "grouped_gemm_backward", "grouped_gemm_swiglu",
    "grouped_gemm_swiglu_backward", "kernel_arch", "permute", "quantize_fp8", "route",
    "route_slots", "router_kernel_enabled", "router_logits", "scaled_grouped_gemm",
    "scaled_grouped_gemm_swiglu", "scatter_rows", "sort_slots", "use_fp8_kernels",
    "use_router_kernel", "use_sm100_kernel",
]
