"""Integrations of ts_moe with other libraries (imported on demand, not by ``import ts_moe``).

* :mod:`ts_moe.integrations.transformers`: Hugging Face transformers' Mixtral
  blocks and experts interface.
"""
