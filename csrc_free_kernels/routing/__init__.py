"""The routing families, Hopper, each declared here once: routing and slot order in one
CTA, the combine and the row gather (``route_sm90``); the router logits and the routing
on many CTAs (``router_sm90``, opt-in); the combine's two gradients in one pass
(``combine_grad_sm90``).  Importing this package imports no DSL."""

from ..common.family import Family, Op, Proof
from ..hopper import H100_RUN


def _route():
    from . import route_sm90_launch
    return route_sm90_launch.KERNELS


def _combine_grad():
    from . import combine_grad_sm90_launch
    return combine_grad_sm90_launch.KERNELS


def _router():
    from . import router_sm90_launch
    return router_sm90_launch.KERNELS


ROUTE_SM90 = Family(
    "route_sm90", "routing and slot order in one CTA, the combine, the row gather", "sm_90a",
    Proof.VERIFIED, "against the plain-torch functions on the GPU (the same experts and order)",
    _route, serves=(Op.ROUTE_SLOTS, Op.SORT_SLOTS, Op.ROW_SUM), run=H100_RUN)
ROUTER_SM90 = Family(
    "router_sm90", "router logits, and the routing's top-k on many CTAs", "sm_90a",
    Proof.VERIFIED,
    "against float64 logits and route_slots on the GPU; against F.linear inside the "
    "Mixtral block on an H100 no difference beyond the noise "
    "(bench/notes/2026-12-06-h100-run.md): opt-in",
    _router, serves=(Op.ROUTER_LOGITS, Op.ROUTE_TOPK), run=H100_RUN, setting="router_kernel")
COMBINE_GRAD_SM90 = Family(
    "combine_grad_sm90", "the combine's gradients (to the expert rows and to the routing "
    "weights) in one pass", "sm_90a", Proof.VERIFIED,
    "against the float64 gradient of the combine and, in the layer's backward, an fp32 loop "
    "on the GPU", _combine_grad, serves=(Op.COMBINE_GRAD,), run=H100_RUN)
