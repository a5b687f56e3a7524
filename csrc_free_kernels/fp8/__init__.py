"""The FP8 (e4m3) families, Hopper: the grouped GEMM and its fused SwiGLU form
(``grouped_gemm_fp8_sm90``, the bf16 kernel's subclass with an FP8 mainloop) and the
activation quantizer (``quantize_fp8_sm90``)."""
