"""CuTeDSL kernels (Python only, no C++/CUDA source), by family and arch.

Sub-packages, each declaring its families once (``<package>/__init__.py``: a
:class:`~.common.family.Family` record per family, imported with no DSL):

- ``hopper``: the Hopper (sm_90a) GEMMs: the ragged grouped GEMM and its fused SwiGLU
  form (``grouped_gemm_sm90``, with ``sm90_mma`` and ``sm90_epilogue``), the k-grouped
  GEMM of the weight gradient (``grouped_gemm_dw_sm90``), the elementwise SwiGLU
  (``swiglu_sm90``);
- ``fp8``: the FP8 (e4m3) grouped GEMM, the bf16 kernel's subclass with an FP8 mainloop,
  and the activation quantizer, Hopper;
- ``routing``: routing and slot order in one CTA, the combine, the row gather
  (``route_sm90``); the router logits and the routing on many CTAs (``router_sm90``);
- ``sm100``: the Blackwell (sm_100a) grouped GEMM, compiled and model-checked only;
- ``common``: the family record's types, the compile and its on-disk cache, the
  configuration base, programmatic dependent launch, the kernels' settings, the
  ragged tile schedules;
- ``preflight``: the GPU-free check of a build's PTX against the hardware's rules.

A family has up to three modules, one job each: ``<family>_config`` (configurations on
:class:`~.common.kernel_config.KernelConfig`, and the heuristic that picks one from
shapes), ``<family>`` (the kernel classes), ``<family>_launch`` (its builds, its backends
and what it serves: ``KERNELS``).  :mod:`.families` lists every family, one import line
per package; ``ts_moe``, ``python -m ts_moe compile`` and :mod:`.ptx_dump` (the PTX of
any build, without a GPU) read that list.  Variants measured and lost are not here:
bench/notes/ records them; the test-only kernels (the ``ts_pipeline`` probes) are in
``tests/kernels/``.  Modules import ``cutlass`` when they are imported; this package
and its records do not.
"""
