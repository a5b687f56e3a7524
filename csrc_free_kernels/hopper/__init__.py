"""The Hopper (sm_90a) GEMM families: the row-grouped GEMM and its fused SwiGLU form
(``grouped_gemm_sm90``, with its MMA warpgroups ``sm90_mma`` and epilogue pieces
``sm90_epilogue``), its store-warp variant (``grouped_gemm_sm90_store_warp``), the
k-grouped GEMM of the weight gradient (``grouped_gemm_dw_sm90``) and the elementwise
SwiGLU activation (``swiglu_sm90``)."""
