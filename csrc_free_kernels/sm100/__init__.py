"""The Blackwell (sm_100a) grouped GEMM family (``grouped_gemm_sm100``; its barrier
protocol in ``sm100_protocol.md``).  Compiled and model-checked only: no Blackwell GPU
has run it."""
