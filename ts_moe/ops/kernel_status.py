"""Each kernel family's status, declared once: how far it is proven, on which run,
and what turns it on.

A family is the kernels of one ``csrc_free_kernels`` launch module (its
configurations, classes and pieces with it).  :mod:`ts_moe.ops.kernels`
imports each under its own guard, by the names here; ``python -m ts_moe info``
prints each family's status beside the path this machine's GPU gets; the
README's path tables and its table of families are generated from
:data:`STATUS` (``python -m bench report --readme``, checked by a CPU test).

A family is on by default only once it has produced correct results on a GPU
(:attr:`Proof.VERIFIED`, with the run); the others wait behind a setting of
``ts_moe.settings`` (``setting``), or no path of the ops takes them at all
(``in_ops=False``: the benchmark harness runs them).  A new GPU run that
proves or breaks a family changes its record here, and the README with it.
"""

import dataclasses
import enum


class Proof(enum.Enum):
    VERIFIED = "verified on hardware"
    COMPILED = "compiled and model-checked only"
    FAULTED = "faulted on hardware; the fix not yet run on a GPU"
    AWAITING_AB = "awaiting an A/B on a GPU"


@dataclasses.dataclass(frozen=True)
class Run:
    """A GPU run a status rests on: the commit of the tree, the device, the day, what
    happened."""

    commit: str
    device: str
    date: str
    result: str

    def __str__(self) -> str:
        return f"{self.device}, {self.commit}, {self.date}: {self.result}"


@dataclasses.dataclass(frozen=True)
class FamilyStatus:
    """One kernel family: ``name`` (the key everywhere), ``title``, its launch
    ``module`` in ``csrc_free_kernels``, the ``arch`` it is built for, its
    ``proof`` and the ``evidence`` for it, the GPU ``run`` that gave it (if any),
    the ``ts_moe.settings`` attribute that turns it on (``setting``; None: on
    by default), and whether a path of the ops takes it (``in_ops``)."""

    name: str
    title: str
    module: str
    arch: str
    proof: Proof
    evidence: str
    run: Run | None = None
    setting: str | None = None
    in_ops: bool = True

    @property
    def switch(self) -> str:
        """How it is turned on, in words."""
        if not self.in_ops:
            return "never by the ops (bench only)"
        return f"ts_moe.settings.{self.setting}" if self.setting else "on by default"


H200_RUN = Run("7b4d93b", "NVIDIA H200", "2026-12-05", "515 GPU tests passed")
FP8_RUN = Run("04b71cd", "NVIDIA H200", "2026-12-05",
              "the GEMM stopped with an illegal instruction at its first launch")

GEMM_SM90 = FamilyStatus(
    "gemm_sm90", "bf16/fp16 grouped GEMM and fused SwiGLU GEMM", "hopper.grouped_gemm_sm90_launch",
    "sm_90a", Proof.VERIFIED, "against the fp32 references on the GPU", H200_RUN)
GEMM_DW_SM90 = FamilyStatus(
    "gemm_dw_sm90", "k-grouped GEMM (the weight gradient)", "hopper.grouped_gemm_dw_sm90_launch",
    "sm_90a", Proof.VERIFIED, "against the fp32 references on the GPU", H200_RUN)
SWIGLU_SM90 = FamilyStatus(
    "swiglu_sm90", "SwiGLU activation and its gradient, elementwise", "hopper.swiglu_sm90_launch",
    "sm_90a", Proof.VERIFIED, "against the fp32 references on the GPU", H200_RUN)
ROUTE_SM90 = FamilyStatus(
    "route_sm90", "routing and slot order in one CTA, the combine, the row gather",
    "routing.route_sm90_launch", "sm_90a", Proof.VERIFIED,
    "against the plain-torch functions on the GPU (the same experts and order)", H200_RUN)
ROUTER_SM90 = FamilyStatus(
    "router_sm90", "router logits, and the routing's top-k on many CTAs",
    "routing.router_sm90_launch", "sm_90a", Proof.AWAITING_AB,
    "compiled and PTX-checked; its timing against F.linear and the one-CTA routing "
    "(scripts/router_ab.py) not yet run", setting="router_kernel")
STORE_WARP_SM90 = FamilyStatus(
    "gemm_sm90_store_warp", "grouped GEMM with its output tiles stored by a warp of their own",
    "hopper.grouped_gemm_sm90_store_warp", "sm_90a", Proof.AWAITING_AB,
    "compiled and PTX-checked; its timing against the shipped epilogue not yet run "
    "(bench/notes/2026-12-04-store-warp-epilogue.md)", in_ops=False)
GEMM_SM100 = FamilyStatus(
    "gemm_sm100", "bf16/fp16 grouped GEMM and fused SwiGLU GEMM, Blackwell",
    "sm100.grouped_gemm_sm100_launch", "sm_100a", Proof.COMPILED,
    "no Blackwell GPU here: every configuration compiles, its PTX is checked, ptxas "
    "assembles it without spills, its barrier protocol is model-checked "
    "(csrc_free_kernels/sm100/sm100_protocol.md)", setting="sm100_kernel")
GEMM_FP8_SM90 = FamilyStatus(
    "gemm_fp8_sm90", "FP8 (e4m3) grouped GEMM and fused SwiGLU GEMM",
    "fp8.grouped_gemm_fp8_sm90_launch", "sm_90a", Proof.FAULTED,
    "compiled, PTX- and scale-map-checked and pre-flight checked on the CPU; the fix "
    "after the fault (the scale box's start row) not yet run on a GPU "
    "(bench/notes/2026-12-05-fp8-kernel-first-gpu-run.md)", FP8_RUN,
    setting="fp8_kernels")
QUANTIZE_FP8_SM90 = FamilyStatus(
    "quantize_fp8_sm90", "FP8 activation quantizer", "fp8.quantize_fp8_sm90_launch", "sm_90a",
    Proof.COMPILED, "compiled and pre-flight checked on the CPU; on the H200 at 04b71cd "
    "its launches ran without a fault, their values unchecked", setting="fp8_kernels")

STATUS = (GEMM_SM90, GEMM_DW_SM90, SWIGLU_SM90, ROUTE_SM90, ROUTER_SM90, STORE_WARP_SM90,
          GEMM_SM100, GEMM_FP8_SM90, QUANTIZE_FP8_SM90)
BY_NAME = {f.name: f for f in STATUS}
