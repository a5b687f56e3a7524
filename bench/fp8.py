"""The ``fp8`` suite: FP8 expert GEMMs against ts_moe's bf16 kernel and torch's FP8 paths.

A case is a grouped_gemm case (model, gemm, T, routing) whose ``step`` is its scaling
recipe (:data:`bench.cases.FP8_RECIPES`): ``blockwise`` (tokens per 128 channels,
weights per 128x128 block: DeepSeek-V3, Qwen ``-FP8``) or ``rowwise`` (per token, per
channel: FP8-dynamic releases).  Every backend of a case gets the same
:class:`Fp8Inputs`: random bf16 tokens and weights (scaled by fan-in) quantized once
by :func:`ts_moe.quantize_fp8` with the case's recipe, the weights K-major (the
``.transpose(-2, -1)`` view of the (E, N, K) checkpoint stack), and the bf16 values
those stand for.  Each backend is checked against a float64 reference on the same
quantized inputs (:func:`reference_fp8`) before it is timed.

Backends (:func:`fp8_backends`): ``ts_moe_fp8`` (:func:`ts_moe.scaled_grouped_gemm`;
on a GPU only where it runs ts_moe's FP8 kernel), ``ts_moe_fp8_fallback`` (ts_moe's
dequantize fallback, its records with its transient bytes and bytes moved), ``ts_moe_bf16`` (ts_moe's bf16
kernel on the dequantized values: the same case in bf16), ``torch_scaled_grouped_mm``
(``torch._scaled_grouped_mm``, rowwise cases), ``F_scaled_grouped_mm``
(``torch.nn.functional.scaled_grouped_mm`` with BlockWise1x128 / BlockWise128x128,
blockwise cases, where the installed torch accepts them), ``dequant_grouped_mm``
(the operands dequantized to bf16 in every call, then torch's ``grouped_mm``: what
serving FP8 weights costs without an FP8 grouped GEMM), and ``reference``.

Records count FP8 bytes (:func:`bench.cases.fp8_traffic`; the bf16 backend's TB/s is
then an effective rate) and judge every backend against the dense FP8 roof
(``fp8_dense_tflops``, a ``torch._scaled_mm`` measured in the same run).  Blockwise
cases need K in whole 128-blocks: :func:`fp8_cases` leaves out those that are not
(the CPU smoke model cpu-qwen3's down GEMM, I = 64).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import backends as gemm_backends
from . import fp8_fallback
from .backends import Bind, Factory, GemmInputs, Unavailable, _require_cuda
from .cases import FP8_BLOCK, FP8_RECIPES, Case, make_case, model_named

DEFAULT_BACKENDS = ("ts_moe_fp8", "ts_moe_fp8_fallback", "ts_moe_bf16",
                    "torch_scaled_grouped_mm", "F_scaled_grouped_mm", "dequant_grouped_mm")
# the case's recipe -> (recipe of the tokens, recipe of the weights)
RECIPES = {"blockwise": ("blockwise_1x128", "blockwise_128x128"),
           "rowwise": ("rowwise", "rowwise")}


@dataclass
class Fp8Inputs:
    """``a`` (M, K) e4m3 tokens sorted by expert and ``scale_a``; ``b`` (E, K, N) e4m3,
    K-major, and ``scale_b`` over the stored (E, N, K); ``offs`` int32 row ends;
    ``a_bf16`` / ``b_bf16``: the bf16 values they stand for (b K-major too)."""

    a: torch.Tensor
    scale_a: torch.Tensor
    b: torch.Tensor
    scale_b: torch.Tensor
    offs: torch.Tensor
    a_bf16: torch.Tensor
    b_bf16: torch.Tensor
    recipe: str
    counts: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (self.a, self.scale_a, self.b,
                                                          self.scale_b, self.a_bf16,
                                                          self.b_bf16))

    def clone(self) -> "Fp8Inputs":
        def keep(t):  # a copy in t's own strides (b K-major, an M-major scale)
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                       device=t.device).copy_(t)
        return Fp8Inputs(keep(self.a), keep(self.scale_a), keep(self.b), keep(self.scale_b),
                         self.offs, keep(self.a_bf16), keep(self.b_bf16), self.recipe,
                         self.counts)


def fp8_cases(models, Ts, gemms, routings, base_seed: int = 0) -> list[Case]:
    """Every model x gemm x recipe x routing x T (T ascending innermost); a blockwise
    case only where K is whole 128-blocks."""
    out = []
    for m in models:
        model = model_named(m)
        for g in gemms:
            for recipe in FP8_RECIPES:
                for r in routings:
                    for t in sorted(Ts):
                        case = make_case(model, g, t, r, base_seed, "kmajor", recipe)
                        if recipe != "blockwise" or case.K % FP8_BLOCK == 0:
                            out.append(case)
    return out


def make_fp8_inputs(case: Case, device: torch.device) -> Fp8Inputs:
    """Seeded random bf16 operands (as the grouped_gemm suite's, K-major weights),
    quantized with the case's recipe."""
    import ts_moe
    from ts_moe.fp8.reference import dequantize

    g = torch.Generator(device).manual_seed(case.seed)
    kw = {"generator": g, "device": device, "dtype": torch.bfloat16}
    act, weight = RECIPES[case.step]
    a, scale_a = ts_moe.quantize_fp8(torch.randn(case.M, case.K, **kw), act)
    w, scale_b = ts_moe.quantize_fp8(
        torch.randn(case.E, case.N, case.K, **kw).mul_(case.K**-0.5), weight)
    w_bf16 = torch.empty(w.shape, dtype=torch.bfloat16, device=device)
    for e in range(case.E):  # one expert's fp32 temporaries at a time
        w_bf16[e] = dequantize(w[e], scale_b[e], weight, torch.bfloat16)
    offs = torch.tensor(case.counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return Fp8Inputs(a, scale_a, w.transpose(-2, -1), scale_b, offs,
                     dequantize(a, scale_a, act, torch.bfloat16), w_bf16.transpose(-2, -1),
                     case.step, case.counts)


def reference_fp8(inp: Fp8Inputs, out_dtype=torch.float32) -> torch.Tensor:
    """float64 per expert on the quantized inputs (the operands dequantized exactly),
    zeros past the last expert; ``out_dtype`` fp32 (the check) or bf16."""
    from ts_moe.fp8.reference import dequantize

    act, weight = RECIPES[inp.recipe]
    m, n = inp.a.shape[0], inp.b.shape[2]
    out = torch.zeros(m, n, dtype=out_dtype, device=inp.a.device)
    tokens = act != "tensorwise"
    start = 0
    for e, rows in enumerate(inp.counts):
        if rows:
            end = start + rows
            x = dequantize(inp.a[start:end], inp.scale_a[start:end] if tokens else inp.scale_a,
                           act, torch.float64)
            w = dequantize(inp.b[e].transpose(0, 1), inp.scale_b[e], weight, torch.float64)
            out[start:end] = (x @ w.t()).to(out_dtype)
        start += rows
    return out


def reference(case: Case, device: torch.device) -> Bind:
    """The float64 reference, bf16 out."""
    return lambda inp: lambda: reference_fp8(inp, torch.bfloat16)


def ts_moe_fp8(case: Case, device: torch.device) -> Bind:
    """:func:`ts_moe.scaled_grouped_gemm` with the case's recipe, ts_moe's FP8 kernels
    turned on (:func:`ts_moe.use_fp8_kernels`, whatever the settings say); on a
    CUDA device where it would not run them (its fallback would be timed): unavailable."""
    import ts_moe
    from ts_moe.fp8.recipes import Pair, Recipe
    from ts_moe.ops import Op, paths
    from ts_moe.ops.backend import OutputSpec, first_taker

    act, weight = RECIPES[case.step]

    def bind(inp: Fp8Inputs):
        if device.type == "cuda":
            paths.use_fp8_kernels(True)
            kernel = paths.TABLE[paths.Path.KERNEL_SM90].get(Op.SCALED_GROUPED_GEMM)
            taken, config = first_taker(
                paths.backends(Op.SCALED_GROUPED_GEMM, paths.device_capability(inp.a)),
                inp.a, inp.b, inp.scale_a, inp.scale_b, inp.offs,
                OutputSpec((case.M, case.N), torch.bfloat16), None,
                Pair.of(Recipe(act), Recipe(weight)))
            if kernel is None or taken is not kernel:
                raise Unavailable(f"no ts_moe FP8 kernel here (the op takes "
                                  f"{type(taken).__name__})")
        return lambda: ts_moe.scaled_grouped_gemm(inp.a, inp.b, inp.scale_a, act, inp.scale_b,
                                                  weight, inp.offs)
    return bind


def ts_moe_bf16(case: Case, device: torch.device) -> Bind:
    """ts_moe's bf16 ``grouped_gemm`` on the dequantized values: the grouped_gemm suite's
    ``ts_moe`` backend (unavailable on a GPU without the kernel) on them."""
    bind = gemm_backends.ts_moe(case, device)
    return lambda inp: bind(GemmInputs(inp.a_bf16, inp.b_bf16, inp.offs, inp.counts))


def torch_scaled_grouped_mm(case: Case, device: torch.device) -> Bind:
    """``torch._scaled_grouped_mm`` (rowwise; its CUTLASS kernel runs on sm_90)."""
    _require_cuda(device, "torch._scaled_grouped_mm")
    fn = getattr(torch, "_scaled_grouped_mm", None)
    if fn is None:
        raise Unavailable(f"torch {torch.__version__} has no _scaled_grouped_mm")
    return lambda inp: lambda: fn(inp.a, inp.b, inp.scale_a, inp.scale_b, offs=inp.offs,
                                  out_dtype=torch.bfloat16)


torch_scaled_grouped_mm.applies = lambda case: case.step == "rowwise"


def F_scaled_grouped_mm(case: Case, device: torch.device) -> Bind:  # noqa: N802 (torch's name)
    """``torch.nn.functional.scaled_grouped_mm`` with the blockwise recipes, where the
    installed torch runs them (tried once per input copy at bind; a refusal:
    unavailable, with torch's reason)."""
    _require_cuda(device, "F.scaled_grouped_mm")
    scaling = getattr(F, "ScalingType", None)
    if scaling is None or not hasattr(F, "scaled_grouped_mm"):
        raise Unavailable(f"torch {torch.__version__} has no F.scaled_grouped_mm")

    def bind(inp: Fp8Inputs):
        def run():
            return F.scaled_grouped_mm(inp.a, inp.b, inp.scale_a, scaling.BlockWise1x128,
                                       inp.scale_b, scaling.BlockWise128x128, offs=inp.offs,
                                       output_dtype=torch.bfloat16)
        try:
            run()
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            raise Unavailable(f"torch {torch.__version__} refuses blockwise scaled_grouped_mm: "
                              f"{first}") from None
        return run
    return bind


F_scaled_grouped_mm.applies = lambda case: case.step == "blockwise"


def dequant_grouped_mm(case: Case, device: torch.device) -> Bind:
    """Every call: tokens and weights dequantized to bf16 (in place over a bf16 cast,
    scales broadcast per block, channel or token), then torch's ``grouped_mm``."""
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise Unavailable(f"torch {torch.__version__} has no grouped_mm")
    blockwise = case.step == "blockwise"
    if blockwise and case.N % FP8_BLOCK:
        raise Unavailable("the in-place block broadcast needs N in whole 128-blocks")

    def bind(inp: Fp8Inputs):
        stored = inp.b.transpose(-2, -1)  # (E, N, K) contiguous
        e, n, k = stored.shape
        m = inp.a.shape[0]
        sa = inp.scale_a.to(torch.bfloat16)
        sb = inp.scale_b.to(torch.bfloat16)

        def run():
            a = inp.a.to(torch.bfloat16)
            w = stored.to(torch.bfloat16)
            if blockwise:
                a.view(m, k // FP8_BLOCK, FP8_BLOCK).mul_(sa[:, :, None])
                w.view(e, n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK).mul_(
                    sb[:, :, None, :, None])
            else:
                a.mul_(sa[:, None])
                w.mul_(sb[:, :, None])
            return fn(a, w.transpose(-2, -1), offs=inp.offs)
        return run
    return bind


def ts_moe_fp8_fallback(case: Case, device: torch.device) -> Bind:
    """ts_moe's FP8 fallback, where no FP8 kernel serves a call (sm_100, other GPUs,
    sm_90 with the FP8 kernels switched off): the routed experts' weights
    dequantized to bf16 in chunks, then ts_moe's bf16 grouped GEMM.  Its records carry
    the transient bytes and bytes moved, and the whole stack's, against the FP8 weight
    bytes (:mod:`bench.fp8_fallback`)."""
    pair = fp8_fallback.RECIPES[case.step][2]
    return lambda inp: fp8_fallback.dequantize_call(inp.a, inp.b, inp.scale_a, inp.scale_b,
                                                    inp.offs, pair)


ts_moe_fp8_fallback.fields = fp8_fallback.case_fields


def fp8_backends() -> dict[str, Factory]:
    """Backend name -> factory for the fp8 suite."""
    return {"ts_moe_fp8": ts_moe_fp8, "ts_moe_fp8_fallback": ts_moe_fp8_fallback,
            "ts_moe_bf16": ts_moe_bf16,
            "torch_scaled_grouped_mm": torch_scaled_grouped_mm,
            "F_scaled_grouped_mm": F_scaled_grouped_mm,
            "dequant_grouped_mm": dequant_grouped_mm, "reference": reference}
