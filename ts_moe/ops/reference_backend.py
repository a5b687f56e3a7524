"""The plain-torch backend of every op family (:mod:`ts_moe.ops.backend`): the
CPU's, the fallback of every other, and what the kernels are checked against.
It takes every call.  Its grouped GEMMs read ``offs`` on the host (a sync on a
GPU); its routing runs on the device (:mod:`ts_moe.reference`)."""

import torch.nn.functional as F

from .. import reference
from ..reference import (acc_dtype, gather_rows, grouped_gemm_k_reference, grouped_gemm_reference,
                         grouped_gemm_swiglu_reference, swiglu, swiglu_backward)
from .kernels import Op

CONFIG = "reference"


class GroupedGemm:
    gathers = False

    def choose_config(self, a, b, offs, out, a_index):
        return CONFIG

    def run(self, a, b, offs, out, config, *, a_index=None, prefetch_weights=False):
        return out.copy_(grouped_gemm_reference(a, b, offs, out.dtype))


class GroupedGemmK:
    def choose_config(self, a, b, offs, out):
        return CONFIG

    def run(self, a, b, offs, out, config):
        return out.copy_(grouped_gemm_k_reference(a, b, offs, out.dtype))


class GroupedGemmSwiglu:
    gathers = False

    def choose_config(self, a, gate_up, offs, out, a_index):
        return CONFIG

    def run(self, a, gate_up, offs, out, config, *, a_index=None, prefetch_weights=False):
        return out.copy_(grouped_gemm_swiglu_reference(a, gate_up, offs))


class SwigluActivation:
    """fp32 math (fp64 for fp64), one rounding."""

    def choose_config(self, h, dy):
        return CONFIG

    def forward(self, h, out, config):
        return out.copy_(swiglu(h.to(acc_dtype(h.dtype)), h.dtype))

    def backward(self, dy, h, dh, config):
        return dh.copy_(swiglu_backward(dy, h, h.dtype))


class RouteSlots:
    def choose_config(self, logits, top_k):
        return CONFIG

    def run(self, logits, top_k, config):
        weights, experts = reference.route(logits, top_k)
        experts = experts.contiguous()  # a slice of the sort: the kernels' layout
        return (weights.contiguous(), experts,
                *reference.sort_slots(experts, logits.shape[1]))


class RouteTopK:
    def choose_config(self, logits, top_k):
        return CONFIG

    def run(self, logits, top_k, config):
        weights, experts = reference.route(logits, top_k)
        return weights.contiguous(), experts.contiguous()


class SortSlots:
    def choose_config(self, experts, num_experts):
        return CONFIG

    def run(self, experts, num_experts, config):
        return tuple(reference.sort_slots(experts, num_experts))


class RowSum:
    def choose_config(self, src, index, weights):
        return CONFIG

    def run(self, src, index, weights, config):
        if weights is None:
            return gather_rows(src, index)
        return reference.combine(src, weights, index)


class CombineGrad:
    def choose_config(self, dout, y_sorted, weights, order):
        return CONFIG

    def run(self, dout, y_sorted, weights, order, config):
        return reference.combine_grad(dout, y_sorted, weights, order)


class RouterLogits:
    """``F.linear`` (cuBLAS on a GPU)."""

    def choose_config(self, x, weight):
        return CONFIG

    def run(self, x, weight, config):
        return F.linear(x, weight)


GROUPED_GEMM = GroupedGemm()
GROUPED_GEMM_K = GroupedGemmK()
GROUPED_GEMM_SWIGLU = GroupedGemmSwiglu()
SWIGLU_ACTIVATION = SwigluActivation()
ROUTE_SLOTS = RouteSlots()
ROUTE_TOPK = RouteTopK()
SORT_SLOTS = SortSlots()
ROW_SUM = RowSum()
COMBINE_GRAD = CombineGrad()
ROUTER_LOGITS = RouterLogits()
BACKENDS = {Op.GROUPED_GEMM: GROUPED_GEMM, Op.GROUPED_GEMM_K: GROUPED_GEMM_K,
            Op.GROUPED_GEMM_SWIGLU: GROUPED_GEMM_SWIGLU, Op.SWIGLU_ACTIVATION: SWIGLU_ACTIVATION,
            Op.ROUTE_SLOTS: ROUTE_SLOTS, Op.ROUTE_TOPK: ROUTE_TOPK, Op.SORT_SLOTS: SORT_SLOTS,
            Op.ROW_SUM: ROW_SUM, Op.COMBINE_GRAD: COMBINE_GRAD, Op.ROUTER_LOGITS: ROUTER_LOGITS}
"""The bf16 families' references, by op family (the FP8 ones: :mod:`ts_moe.fp8.backends`)."""
