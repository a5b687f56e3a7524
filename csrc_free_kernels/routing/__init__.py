"""The routing families, Hopper, each declared here once: routing and slot order in one
CTA, the combine and the row gather (``route_sm90``); the router logits and the routing
on many CTAs (``router_sm90``, opt-in).  Importing this package imports no DSL."""

from ..common.family import Family, Op, Proof
from ..hopper import H100_RUN


def _route():
    from . import route_sm90_launch
    return route_sm90_launch.KERNELS


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
