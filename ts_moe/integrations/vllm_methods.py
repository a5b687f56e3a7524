"""The vLLM MoE methods that put ts_moe's experts (:mod:`.vllm_experts`) under a layer:
each is vLLM's own method with only its choice of experts changed, made when vLLM builds
the layer.

- :class:`TsMoeUnquantizedMethod`: vLLM's ``UnquantizedFusedMoEMethod`` (bf16/fp16
  layers), which :mod:`ts_moe.integrations.vllm` registers out of tree under that
  class's name, so that vLLM makes it wherever it would make its own;
- :class:`TsMoeFp8Config`: vLLM's ``Fp8Config``, registered as the ``fp8`` quantization
  config; the MoE method it gives is vLLM's ``Fp8MoEMethod``, as
  :class:`TsMoeFp8MoEMethod`.

Each asks the experts class about the layer through the hook vLLM's own oracle asks its
kernels with (``is_supported_config``). Taken, the experts class becomes ts_moe's and the
backend the one whose weight conversion leaves the weights as loaded (vLLM's Triton
experts read them so, and so does ts_moe); the rest of the method (weights, loading,
prepare/finalize) stays vLLM's. Declined, vLLM's choice stays, and vLLM's log says why,
once per reason. A ``moe_backend`` named to vLLM (``--moe-backend``) is the user's choice:
ts_moe declines such a layer.
"""

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod)
from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod
from vllm.model_executor.layers.quantization.utils.quant_utils import (kFp8Dynamic128Sym,
                                                                      kFp8Static128BlockSym)

from .vllm_experts import BLOCK_SHAPE, TsMoeExperts, TsMoeFp8Experts

LOGGER_NAME = "vllm.ts_moe"  # under vLLM's "vllm" logger: in vLLM's log, in its format
logger = init_logger(LOGGER_NAME)
AUTO_BACKEND = "auto"  # vLLM's moe_backend when the user names none


def _activation_format(moe) -> mk.FusedMoEActivationFormat:
    """The format vLLM's prepare/finalize will hand the experts (its oracle's rule)."""
    if moe.moe_parallel_config.use_batched_activation_format:
        return mk.FusedMoEActivationFormat.BatchedExperts
    return mk.FusedMoEActivationFormat.Standard


def takes_layer(experts_cls: type[TsMoeExperts], moe, weight_key, activation_key,
                vllm_choice: str) -> bool:
    """Whether ts_moe's ``experts_cls`` serves the layer of ``moe`` (vLLM's
    ``FusedMoEConfig``), said in vLLM's log: once per layer shape taken, once per reason
    declined (``vllm_choice``: what vLLM chose, which then stays)."""
    if moe.moe_backend != AUTO_BACKEND:
        declined(experts_cls, f"vLLM's moe_backend set to {moe.moe_backend!r}", vllm_choice)
        return False
    taken, reason = experts_cls.is_supported_config(
        experts_cls, moe, weight_key, activation_key, _activation_format(moe))
    if not taken:
        declined(experts_cls, reason, vllm_choice)
        return False
    logger.info_once("ts_moe serves the %s MoE layers of %d experts, hidden size %d, "
                     "intermediate size %d per rank (%s)", experts_cls.WEIGHT_KIND,
                     moe.num_local_experts, moe.hidden_dim,
                     moe.intermediate_size_per_partition, experts_cls.__name__)
    return True


def declined(experts_cls: type[TsMoeExperts], reason: str, vllm_choice: str) -> None:
    """vLLM's log, once per reason: ts_moe leaves such layers to ``vllm_choice``."""
    logger.info_once("ts_moe declines %s MoE layers: %s; vLLM's %s serves them",
                     experts_cls.WEIGHT_KIND, reason, vllm_choice)


class TsMoeUnquantizedMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method, on ts_moe's experts where they serve the layer
    (module docstring)."""

    def __init__(self, moe):
        super().__init__(moe)
        vllm_choice = self.unquantized_backend.value
        if takes_layer(TsMoeExperts, moe, None, None, vllm_choice):
            self.unquantized_backend = UnquantizedMoeBackend.TRITON  # weights as loaded
            self.experts_cls = TsMoeExperts


class TsMoeFp8MoEMethod(Fp8MoEMethod):
    """vLLM's FP8 MoE method, on ts_moe's block-FP8 experts where they serve the layer
    (module docstring). :class:`TsMoeFp8Config` makes vLLM's method, then makes it this
    one (its state is all the parent's) and lets it choose."""

    def choose_experts(self) -> None:
        vllm_choice = self.fp8_backend.value
        if not self.block_quant:
            declined(TsMoeFp8Experts, "FP8 weights scaled per tensor", vllm_choice)
        elif list(self.moe_block_shape) != BLOCK_SHAPE:  # refined for tensor parallelism
            declined(TsMoeFp8Experts, f"FP8 weight blocks of {list(self.moe_block_shape)}",
                     vllm_choice)
        elif takes_layer(TsMoeFp8Experts, self.moe, kFp8Static128BlockSym, kFp8Dynamic128Sym,
                         vllm_choice):
            self.fp8_backend = Fp8MoeBackend.TRITON  # weights and scales as loaded
            self.experts_cls = TsMoeFp8Experts


class TsMoeFp8Config(Fp8Config):
    """vLLM's ``fp8`` quantization config, whose MoE layers' method is
    :class:`TsMoeFp8MoEMethod`; every other layer's method is vLLM's."""

    def get_quant_method(self, layer, prefix):
        method = super().get_quant_method(layer, prefix)
        if type(method) is Fp8MoEMethod:
            method.__class__ = TsMoeFp8MoEMethod
            method.choose_experts()
        return method
