"""Benchmark cases: model shapes, token routing, and the work each case must do.

A case is one problem size: a model's expert shapes, a token count ``T``, a
routing of the ``M = T * top_k`` token-expert pairs onto the ``E`` experts,
and which GEMM of the expert MLP it is (``gate_up``: N = 2I, K = H;
``down``: N = H, K = I; ``layer``: the whole expert MLP; ``block``: the whole
MoE block, router GEMM and top-k included, whose routing is the router's own:
see :mod:`bench.moe_block`).  The training suite's cases also name a
``step``: a GEMM's ``fwd``, ``dA`` (input gradient) or ``dW`` (weight
gradient), or the layer's ``fwd+bwd``.  Everything here is
plain Python and CPU torch, so the case list is the same on every machine.
"""

import math
import zlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Model:
    """The MoE block of one model: experts, hidden size, expert intermediate size, top-k."""

    name: str
    experts: int
    hidden: int
    inter: int
    top_k: int


MODELS = {
    m.name: m
    for m in (
        Model("mixtral-8x7b", experts=8, hidden=4096, inter=14336, top_k=2),
        Model("qwen3-30b-a3b", experts=128, hidden=2048, inter=768, top_k=8),
        Model("deepseek-v3", experts=256, hidden=7168, inter=2048, top_k=8),
    )
}

# CPU smoke suite (a machine without CUDA): the three models' shapes scaled down
# so that a run of the plain-torch reference path ends in well under two minutes
SMOKE_MODELS = {
    m.name: m
    for m in (
        Model("cpu-mixtral", experts=8, hidden=256, inter=512, top_k=2),
        Model("cpu-qwen3", experts=16, hidden=128, inter=64, top_k=4),
    )
}
SMOKE_T = (16, 128)

GEMMS = ("gate_up", "down")
ROUTINGS = ("uniform", "skewed")
GEMM_T = (16, 128, 1024, 4096, 16384)
LAYER_T = (1, 16, 128, 1024, 4096, 16384)
# the moe_block suite (router + top-k + experts): decode-sized T first; its routing
# is the router's top-k of the case's tokens (one routing, named BLOCK_ROUTING)
BLOCK_T = (1, 16, 64, 128, 1024, 4096)
BLOCK_QUICK_T = (1, 16, 128)
BLOCK_ROUTING = "router"
WEIGHT_LAYOUTS = ("nmajor", "kmajor")

# --quick: about two minutes on an H200
QUICK_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b")
QUICK_T = (16, 1024, 16384)
QUICK_ROUTINGS = ("uniform",)

# the training suite: each GEMM's three steps, and the whole layer forward + backward
TRAIN_T = (4096, 16384)
TRAIN_QUICK_T = (4096,)
GEMM_STEPS = ("fwd", "dA", "dW")
LAYER_STEP = "fwd+bwd"
TRAIN_GEMMS = (*GEMMS, "layer")

# Popularity of the expert of rank r is proportional to r**-ZIPF_EXPONENT in
# skewed routing: with top-8 of 128 experts the hottest expert gets ~1/8 of
# all rows, the coldest a handful, as in a router that has collapsed onto a
# few favourites.
ZIPF_EXPONENT = 1.0


@dataclass(frozen=True)
class Case:
    """One benchmark problem.  ``counts[e]`` is the number of rows routed to expert ``e``."""

    model: Model
    gemm: str
    T: int
    routing: str
    seed: int
    counts: tuple[int, ...]
    weight_layout: str = "nmajor"
    step: str | None = None  # training suite: fwd, dA, dW (a GEMM), fwd+bwd (the layer)

    @property
    def E(self) -> int:
        return self.model.experts

    @property
    def M(self) -> int:
        return self.T * self.model.top_k

    @property
    def N(self) -> int:
        """Output columns of the GEMM (the layer's output width for ``layer``)."""
        return 2 * self.model.inter if self.gemm == "gate_up" else self.model.hidden

    @property
    def K(self) -> int:
        """Reduction length of the GEMM (the layer's input width for ``layer``)."""
        return self.model.inter if self.gemm == "down" else self.model.hidden

    @property
    def touched_experts(self) -> int:
        return sum(1 for c in self.counts if c > 0)

    def key(self) -> dict:
        """The fields that identify the case in results (``step`` only where there is one)."""
        key = {"model": self.model.name, "gemm": self.gemm, "T": self.T, "routing": self.routing}
        if self.step is not None:
            key["step"] = self.step
        return key

    def describe(self) -> str:
        """Short text with the shape, for progress lines and NVTX ranges.  A step's
        M, N, K are those of the forward GEMM it belongs to."""
        m = self.model
        if self.gemm in ("layer", "block"):
            dims = f"M={self.M} H={m.hidden} I={m.inter} E={self.E} k={m.top_k}"
        else:
            dims = f"M={self.M} N={self.N} K={self.K} E={self.E}"
        gemm = self.gemm if self.step is None else f"{self.gemm} {self.step}"
        return f"{m.name} {gemm} T={self.T} {self.routing} {dims}"


def case_seed(base_seed: int, model: str, T: int, routing: str) -> int:
    """A seed per (model, T, routing), stable across processes (``hash`` of a str is not).

    The GEMM is not part of it: gate_up and down of one batch see the same routing.
    """
    return zlib.crc32(f"{base_seed}:{model}:{T}:{routing}".encode())


def route(T: int, top_k: int, experts: int, routing: str, seed: int) -> torch.Tensor:
    """(T, top_k) int64 expert ids: each token picks ``top_k`` distinct experts.

    Sampling without replacement by Gumbel top-k: token scores are
    ``log p_e + Gumbel noise`` and the top ``top_k`` win, which draws each
    token's set in proportion to the popularities ``p``.  ``uniform``: all
    experts equally popular.  ``skewed``: Zipf popularities over a seeded
    random ranking of the experts (so the hot experts are not always the first).
    """
    if top_k > experts:
        raise ValueError(f"top_k={top_k} > experts={experts}")
    g = torch.Generator().manual_seed(seed)
    if routing == "uniform":
        log_p = torch.zeros(experts)
    elif routing == "skewed":
        rank = torch.randperm(experts, generator=g).double() + 1.0
        log_p = (-ZIPF_EXPONENT * rank.log()).float()
    else:
        raise ValueError(f"unknown routing {routing!r}; expected one of {ROUTINGS}")
    u = torch.rand(T, experts, generator=g).clamp_(min=1e-20, max=1.0 - 1e-7)
    gumbel = -(-u.log()).log()
    return (log_p + gumbel).topk(top_k, dim=1).indices


def expert_counts(topk_ids: torch.Tensor, experts: int) -> tuple[int, ...]:
    """Rows per expert of a routing."""
    return tuple(torch.bincount(topk_ids.flatten(), minlength=experts).tolist())


def model_named(name: str) -> Model:
    """A model of :data:`MODELS` or :data:`SMOKE_MODELS`."""
    return MODELS[name] if name in MODELS else SMOKE_MODELS[name]


def make_case(model: Model, gemm: str, T: int, routing: str, base_seed: int = 0,
              weight_layout: str = "nmajor", step: str | None = None) -> Case:
    """The case with its routing drawn from the seed."""
    seed = case_seed(base_seed, model.name, T, routing)
    counts = expert_counts(route(T, model.top_k, model.experts, routing, seed), model.experts)
    return Case(model, gemm, T, routing, seed, counts, weight_layout, step)


def gemm_cases(models, Ts, gemms, routings, base_seed: int = 0,
               weight_layout: str = "nmajor") -> list[Case]:
    """The grouped_gemm suite: every model x gemm x routing x T, T ascending innermost."""
    return [make_case(model_named(m), g, t, r, base_seed, weight_layout)
            for m in models for g in gemms for r in routings for t in sorted(Ts)]


def layer_cases(models, Ts, routings, base_seed: int = 0) -> list[Case]:
    """The moe_layer suite: the whole expert MLP of each model at each T."""
    return [make_case(model_named(m), "layer", t, r, base_seed, "hf")
            for m in models for r in routings for t in sorted(Ts)]


def training_cases(models, Ts, gemms, routings, steps=GEMM_STEPS, base_seed: int = 0,
                   weight_layout: str = "nmajor") -> list[Case]:
    """The training suite: per model, each GEMM's steps (``fwd``, ``dA``, ``dW``)
    x routing x T, then the layer's ``fwd+bwd`` (``gemms`` naming ``layer``)
    x routing x T; T ascending innermost."""
    out = []
    for m in models:
        model = model_named(m)
        for g in gemms:
            if g == "layer":
                out += [make_case(model, "layer", t, r, base_seed, "hf", LAYER_STEP)
                        for r in routings for t in sorted(Ts)]
            else:
                out += [make_case(model, g, t, r, base_seed, weight_layout, s)
                        for s in steps for r in routings for t in sorted(Ts)]
    return out


def flops(case: Case) -> int:
    """Multiply-adds x 2 of the useful work (padding rows of a tile are not counted).
    A GEMM's ``dA`` and ``dW`` do the work of its forward; the layer's ``fwd+bwd``
    three times its forward (each GEMM's dA and dW).  The ``block``: the layer's
    forward and the router GEMM (T x E x H)."""
    m = case.model
    if case.gemm == "block":
        return 2 * case.M * 3 * m.inter * m.hidden + 2 * case.T * m.experts * m.hidden
    if case.gemm == "layer":
        # gate_up (2I x H) and down (H x I) for each of the M rows
        forward = 2 * case.M * (2 * m.inter * m.hidden + m.hidden * m.inter)
        return 3 * forward if case.step == LAYER_STEP else forward
    return 2 * case.M * case.N * case.K


# the fp8 suite: a case's step is its scaling recipe (bench.fp8); its bytes count e4m3
# operands, their fp32 scales and the bf16 output, its roof the dense FP8 one
FP8_RECIPES = ("blockwise", "rowwise")
FP8_BLOCK = 128


def fp8_traffic(case: Case) -> dict[str, int]:
    """Bytes an FP8 grouped GEMM must move: the touched experts' e4m3 weights and their
    scales (per 128x128 block, or per channel), the e4m3 tokens and theirs (per 128
    channels, or per token), the bf16 output."""
    def blocks(n):
        return -(-n // FP8_BLOCK)

    if case.step == "blockwise":
        w_scales, a_scales = blocks(case.N) * blocks(case.K), case.M * blocks(case.K)
    else:
        w_scales, a_scales = case.N, case.M
    return {"weights": case.touched_experts * (case.K * case.N + 4 * w_scales),
            "act_in": case.M * case.K + 4 * a_scales,
            "out": case.M * case.N * 2}


def traffic(case: Case) -> dict[str, int]:
    """Bytes that must cross HBM at least once (bf16): weights of the experts
    that got rows, activations in, results out.  Untouched experts are free,
    except in a weight gradient, which is written (zeros) for every expert.

    Steps: ``dA`` reads dy (M, N) and the weights, writes (M, K); ``dW`` reads
    x (M, K) and dy (M, N), writes (E, K, N); the layer's ``fwd+bwd`` reads the
    weights, x and the output's gradient, writes the weights' gradients, the
    output and x's gradient.  The ``block`` also reads the router (E, H)."""
    m = case.model
    touched = case.touched_experts
    if case.step in FP8_RECIPES:
        return fp8_traffic(case)
    if case.gemm == "block":
        rows = case.T * m.hidden * 2
        return {"weights": touched * 3 * m.inter * m.hidden * 2,
                "router": m.experts * m.hidden * 2, "act_in": rows, "out": rows}
    if case.gemm == "layer":
        weights = touched * 3 * m.inter * m.hidden * 2
        rows = case.T * m.hidden * 2
        if case.step == LAYER_STEP:
            return {"weights": weights, "act_in": 2 * rows, "out": 2 * rows,
                    "weight_grads": case.E * 3 * m.inter * m.hidden * 2}
        return {"weights": weights, "act_in": rows, "out": rows}
    if case.step == "dA":
        return {"weights": touched * case.K * case.N * 2,
                "act_in": case.M * case.N * 2,
                "out": case.M * case.K * 2}
    if case.step == "dW":
        return {"weights": 0,
                "act_in": case.M * (case.K + case.N) * 2,
                "out": case.E * case.K * case.N * 2}
    return {"weights": touched * case.K * case.N * 2,
            "act_in": case.M * case.K * 2,
            "out": case.M * case.N * 2}


def bytes_moved(case: Case) -> int:
    return sum(traffic(case).values())


def weight_bytes(case: Case) -> int:
    """The weights one call must stream from HBM: the touched experts' (and the
    router's, for a ``block``); the weight-streaming floor's bytes."""
    t = traffic(case)
    return t["weights"] + t.get("router", 0)


def skew(counts) -> float:
    """Busiest expert's rows over the mean rows per expert (1.0 = perfectly even)."""
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else math.nan
