"""CuTeDSL kernels (Python only, no C++/CUDA source), one module per family and arch.

- ``grouped_gemm_sm90``: ragged grouped GEMM, Hopper (WGMMA + TMA).
- ``tile_schedule``: the ragged (expert, m-tile, n-tile) tile schedule every kernel walks.
- ``pipeline_probe_sm90`` / ``pipeline_probe_sm100``: small kernels that exercise
  ``ts_pipeline`` (the sm_100a ones are compile-verified only).
- ``compile``: in-memory and on-disk cache of compiled kernels.
- ``kernel_cache``: the on-disk cache's rules (a directory only this uid can write,
  sha256-checked objects).
- ``ptx_dump``: GPU-free compilation for one arch, keeping the PTX.

Modules import ``cutlass`` when they are imported; this package does not.
"""
