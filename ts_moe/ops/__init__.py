"""The ``torch.ops.ts_moe`` operators, and the one place that decides how each call runs.

Modules, one job each:

- :mod:`.gemm`: ``grouped_gemm`` (schema, CPU/CUDA/fake kernels, gradient);
- :mod:`.swiglu`: ``grouped_gemm_swiglu``, ``swiglu``, ``swiglu_backward``;
- :mod:`.routing`: ``router_logits``, ``route_slots``, ``sort_slots``,
  ``combine``, and the router-kernel switch;
- :mod:`.library`: the ``torch.library.Library`` and how an op registers (the
  FP8 ops of :mod:`ts_moe.fp8` register with it too);
- :mod:`.paths`: which backends a call runs on (device and dtypes only);
- :mod:`.backend`: the interface every backend of an op family offers
  (``choose_config``, ``run``), the FP8 families (:mod:`ts_moe.fp8`'s ops) among them;
- :mod:`.kernels`: the kernel backends (``csrc_free_kernels.*_launch``, the
  FP8 ones that :mod:`ts_moe.fp8.paths` takes included), imported once, each
  family under its own guard; :mod:`.kernel_status`: how far each family is
  proven and what turns it on; :mod:`.torch_backend`, :mod:`.reference_backend`:
  the others;
- :mod:`.layout`: what the ops allocate and the views backends receive.

From ``ts_moe.grouped_gemm`` to the pipeline, a bf16 call on an H100/H200::

    ts_moe/ops/gemm.py        grouped_gemm              -> torch.ops.ts_moe.grouped_gemm
    ts_moe/ops/library.py     autograd_kernel.kernel    no gradient wanted: the CUDA kernel, direct
    ts_moe/ops/gemm.py        _cuda                     paths.cuda_path: the sm_90 backends;
                                                        checks.layout_ready: validated once
    ts_moe/ops/gemm.py        dispatch                  backend.choose_config, then backend.run
    csrc_free_kernels/hopper/grouped_gemm_sm90_launch.py
                              GroupedGemmBackend        choose_config (grouped_gemm_sm90_config),
                                                        run -> _launch: the compiled kernel, once
    csrc_free_kernels/hopper/grouped_gemm_sm90.py
                              GroupedGemmSm90           __call__ -> kernel -> make_ring
    ts_pipeline/tma.py        TSPipelineTmaAsync.create the producers' stage ring
"""

from .backend import FAMILIES
from .gemm import grouped_gemm, grouped_gemm_backward, scatter_rows
from .paths import (Path, choose_path, cuda_path, device_backends, graph_path, kernel_arch,
                    use_sm100_kernel)
from .routing import (combine, gather_rows, permute, route, route_slots, router_kernel_enabled,
                      router_logits, sort_slots, use_router_kernel)
from .swiglu import grouped_gemm_swiglu, grouped_gemm_swiglu_backward

__all__ = [
    "FAMILIES", "Path", "choose_path", "combine", "cuda_path", "device_backends",
    "gather_rows", "graph_path", "grouped_gemm", "grouped_gemm_backward",
    "grouped_gemm_swiglu", "grouped_gemm_swiglu_backward", "kernel_arch", "permute", "route",
    "route_slots", "router_kernel_enabled", "router_logits", "scatter_rows", "sort_slots",
    "use_router_kernel", "use_sm100_kernel",
]
