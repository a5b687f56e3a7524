"""CuTeDSL kernels (Python only, no C++/CUDA source), by family and arch.

Each family has up to three modules, one job each: ``<family>_config``
(configurations on :class:`kernel_config.KernelConfig`, and the heuristic that
picks one from shapes), ``<family>`` (the kernel classes), ``<family>_launch``
(the torch entry points: compile once, launch on the current stream).

- ``grouped_gemm_sm90``: ragged grouped GEMM and fused SwiGLU, Hopper (WGMMA +
  TMA); ``sm90_mma`` its MMA warpgroups (the walk, the mainloop and its hooks);
  ``sm90_epilogue`` its epilogue pieces; ``grouped_gemm_sm90_store_warp`` its
  store-warp variant.
- ``grouped_gemm_dw_sm90``: the k-grouped GEMM (weight gradient), Hopper.
- ``grouped_gemm_fp8_sm90``: the FP8 (e4m3) grouped GEMM and fused SwiGLU,
  Hopper: the bf16 kernel's subclass with an FP8 mainloop (blockwise, rowwise
  and tensorwise scales); ``quantize_fp8_sm90``:
  activations to e4m3, their scales in the GEMM's layout.
- ``grouped_gemm_sm100``: ragged grouped GEMM, Blackwell.
- ``swiglu_sm90``: the SwiGLU activation and its gradient, elementwise.
- ``route_sm90``: routing and slot order in one CTA, the combine, the row gather;
  ``router_sm90``: the router logits GEMV and the routing on many CTAs.
- ``tile_schedule``: the ragged (expert, m-tile, n-tile) tile schedule the GEMMs
  walk, and its k-grouped sibling.
- ``compile``: in-memory and on-disk cache of compiled kernels, the fake
  arguments' helpers and the torch -> DSL dtype table; ``pdl``: programmatic
  dependent launch; ``settings``: the kernels' switches and environment
  variables (``ts_moe.settings`` shares them).
- ``kernel_cache``: the on-disk cache's rules (a path only this uid or root can
  write, used through one directory descriptor; sha256-checked objects);
  ``kernel_cache_path``: the walk from ``/`` that checks and opens it.
- ``ptx_dump``: GPU-free compilation for one arch, keeping the PTX.

How far each family is proven on hardware (some are not yet: they are off
by default), and what turns it on, is declared once, in
``ts_moe/ops/kernel_status.py``.  Variants measured and lost are not here:
bench/notes/ records them; the test-only kernels (the ``ts_pipeline`` probes)
are in ``tests/kernels/``.  Modules import ``cutlass`` when they are imported;
this package does not.
"""
