"""Integrations of ts_moe with other libraries (imported on demand, not by ``import ts_moe``).

* :mod:`ts_moe.integrations.transformers`: Hugging Face transformers' Mixtral
  blocks and experts interface.
* :mod:`ts_moe.integrations.vllm`: vLLM 0.33's plugin (``TS_MOE_VLLM=1``), ts_moe's
  experts under vLLM's bf16 and block-FP8 MoE layers.
"""
