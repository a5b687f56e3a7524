"""Every kernel family, one import line per package: the list the rest of the project
derives from (``ts_moe``'s kernel table and paths, ``ts-moe info``, ``python -m ts_moe
compile``, the PTX tests' and the pre-flight's build lists).  A family is declared once,
in its package (:class:`.common.family.Family`); adding one is its package's modules and
its name here.  Importing this module imports no DSL."""

from .common.family import check
from .fp8 import GEMM_FP8_SM90, QUANTIZE_FP8_SM90
from .hopper import GEMM_DW_SM90, GEMM_SM90, SWIGLU_SM90
from .routing import COMBINE_GRAD_SM90, ROUTE_SM90, ROUTER_SM90
from .sm100 import GEMM_SM100

FAMILIES = (GEMM_SM90, GEMM_DW_SM90, SWIGLU_SM90, ROUTE_SM90, COMBINE_GRAD_SM90, ROUTER_SM90,
            GEMM_SM100, GEMM_FP8_SM90, QUANTIZE_FP8_SM90)
check(FAMILIES)  # no two a call could not choose between
BY_NAME = {f.name: f for f in FAMILIES}
