"""The kernel backends, imported once and statically: the only place the ops
import ``csrc_free_kernels`` (the bf16 ops' paths, :mod:`ts_moe.ops.paths`, and
the FP8 ops', :mod:`ts_moe.fp8.paths`; only the command line reaches the
package's build tools directly: ``python -m ts_moe compile`` and ``cache``).
Importing them imports the DSL.  Without ``nvidia-cutlass-dsl`` (``cutlass``)
the imports fail and every name here is None: the kernel paths are then
unavailable and the paths never choose them."""

try:
    from csrc_free_kernels import grouped_gemm_dw_sm90_launch as sm90_dw
    from csrc_free_kernels import grouped_gemm_fp8_sm90_launch as sm90_fp8
    from csrc_free_kernels import grouped_gemm_sm90_launch as sm90
    from csrc_free_kernels import grouped_gemm_sm100_launch as sm100
    from csrc_free_kernels import route_sm90_launch as route_sm90
    from csrc_free_kernels import router_sm90_launch as router_sm90
    from csrc_free_kernels import quantize_fp8_sm90_launch as quantize_fp8_sm90
    from csrc_free_kernels import swiglu_sm90_launch as swiglu_sm90
except ImportError:  # no cutlass: the references and torch's grouped_mm only
    sm90 = sm90_dw = sm90_fp8 = sm100 = route_sm90 = router_sm90 = swiglu_sm90 = None
    quantize_fp8_sm90 = None

AVAILABLE = sm90 is not None
