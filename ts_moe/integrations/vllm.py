"""ts_moe in vLLM 0.33: :func:`register`, the ``vllm.general_plugins`` entry point that
pyproject.toml declares and that vLLM calls in every process it starts.

It registers nothing unless ``ts_moe.settings.vllm`` is on (``TS_MOE_VLLM=1``): its FP8
part replaces vLLM's ``fp8`` quantization config for the whole process, which installing
a package must not do unasked. On, it registers, once per process (a second call, or
vLLM calling it again, changes nothing):

- :class:`~.vllm_methods.TsMoeUnquantizedMethod`, out of tree under vLLM's
  ``UnquantizedFusedMoEMethod``: bf16/fp16 MoE layers (Mixtral, Qwen3-MoE, ...);
- :class:`~.vllm_methods.TsMoeFp8Config` as the ``fp8`` quantization config: block-FP8
  MoE layers (DeepSeek-V3, Qwen3 ``-FP8``);

and vLLM's log says what it took over. Each layer is then served by ts_moe's experts or,
where they decline it, by vLLM's own choice (:mod:`.vllm_methods`). A registration that
another plugin already holds stays that plugin's, and the log says so.

vLLM is imported inside :func:`register` only, once the setting is on: the entry point
runs in every vLLM process, early, and off it must leave vLLM's model executor alone.
"""

from ..settings import settings

FP8_METHOD = "fp8"  # vLLM's quantization method name that TsMoeFp8Config takes
VLLM_SERIES = "0.33."  # the modular-MoE API the methods and experts are written against


def register() -> None:
    """vLLM's plugin entry point (module docstring): a no-op unless ``TS_MOE_VLLM=1`` (or
    ``ts_moe.settings.vllm = True``); idempotent. On, with a vLLM other than 0.33, a
    RuntimeError saying so (the plugin stands on 0.33's internals)."""
    if not settings.vllm:
        return
    import vllm

    if not vllm.__version__.startswith(VLLM_SERIES):
        raise RuntimeError(
            f"TS_MOE_VLLM=1: ts_moe's vLLM plugin is written for vLLM {VLLM_SERIES}x (its "
            f"modular MoE experts API), but vLLM {vllm.__version__} is installed; install "
            f"vllm==0.33.0 or unset TS_MOE_VLLM")
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod as vllm_method)
    from vllm.model_executor.layers.quantization import (get_quantization_config,
                                                         register_quantization_config)
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    from .vllm_methods import TsMoeFp8Config, TsMoeUnquantizedMethod
    from .vllm_methods import logger as _logger

    took = []
    holder = op_registry_oot.get(vllm_method.__name__)
    if holder is None:
        vllm_method.register_oot(TsMoeUnquantizedMethod)
        took.append(f"vLLM's {vllm_method.__name__} (bf16/fp16 MoE layers)")
    elif holder is not TsMoeUnquantizedMethod:
        _logger.warning("ts_moe leaves vLLM's %s to %s, registered before it",
                        vllm_method.__name__, holder.__qualname__)
    holder = get_quantization_config(FP8_METHOD)
    if holder is Fp8Config:
        register_quantization_config(FP8_METHOD)(TsMoeFp8Config)
        took.append(f"vLLM's '{FP8_METHOD}' quantization config (block-FP8 MoE layers)")
    elif holder is not TsMoeFp8Config:
        _logger.warning("ts_moe leaves vLLM's '%s' quantization config to %s, registered "
                        "before it", FP8_METHOD, holder.__qualname__)
    if took:
        _logger.info("ts_moe (TS_MOE_VLLM=1) took over %s; each MoE layer ts_moe declines "
                     "keeps vLLM's own experts, and the log says why", " and ".join(took))
