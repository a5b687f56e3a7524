"""What ts_moe's FP8 fallback costs in memory and traffic, measured without the memory.

The fallback (``ts_moe/fp8/dequantize_path.py``: the routed experts' weights dequantized
to bf16 in chunks, then ts_moe's bf16 grouped GEMM) runs where no FP8 kernel serves a
call: sm_100, other GPUs, and sm_90's blockwise calls with ts_moe's FP8 kernels switched
off.  :func:`measure` runs it on fake tensors of a case's shapes under
:class:`~bench.memory_meter.MemoryMeter` (no memory, and any host read of a device value
would raise: a sync-free path), beside :func:`whole_stack_gemm`, the fallback's former
shape (every expert dequantized on every call), and returns both against the FP8 weight
bytes.  The fp8 suite attaches it to its ``ts_moe_fp8_fallback`` records.
"""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .memory_meter import MemoryMeter

# the case's recipe -> (tokens' recipe, weights' recipe, the kernel pair's name)
RECIPES = {"blockwise": ("blockwise_1x128", "blockwise_128x128", "blockwise"),
           "rowwise": ("rowwise", "rowwise", "rowwise")}


def whole_stack_gemm(a, b_stored, scale_a, recipe_a, scale_b, recipe_b, offs):
    """Every expert's weights dequantized to bf16 (a matrix at a time), then the bf16
    grouped GEMM: what the fallback did before it took only the routed experts."""
    from ts_moe.fp8.reference import dequantize

    x = dequantize(a, scale_a, recipe_a).to(torch.bfloat16)
    w = torch.empty(b_stored.shape, dtype=torch.bfloat16, device=b_stored.device)
    for e in range(b_stored.shape[0]):
        w[e].copy_(dequantize(b_stored[e], scale_b[e], recipe_b))
    return torch.ops.ts_moe.grouped_gemm(x, w.transpose(-2, -1), offs, None)


def _fake_operands(recipe: str, e: int, n: int, k: int, rows: int):
    from ts_moe.fp8.recipes import Recipe

    act, weight, _ = RECIPES[recipe]
    fp8 = torch.float8_e4m3fn
    return (torch.empty(rows, k, dtype=fp8), torch.empty(Recipe(act).scale_shape((rows, k))),
            torch.empty(e, n, k, dtype=fp8), torch.empty(Recipe(weight).scale_shape((e, n, k))),
            torch.empty(e, dtype=torch.int32))


def dequantize_call(a, b, scale_a, scale_b, offs, pair: str):
    """A call of the dequantize path's backend of ``scaled_grouped_gemm`` (named in the
    path table, ``ts_moe.ops.paths``), bf16 out: the FP8 fallback alone."""
    from ts_moe.fp8.recipes import Pair
    from ts_moe.ops import Op, paths
    from ts_moe.ops.backend import OutputSpec

    backend = paths.TABLE[paths.Path.DEQUANTIZE][Op.SCALED_GROUPED_GEMM]
    pair = Pair(pair)
    spec = OutputSpec((a.shape[0], b.shape[2]), torch.bfloat16)
    config = backend.choose_config(a, b, scale_a, scale_b, offs, spec, None, pair)
    out = a.new_empty(spec.shape, dtype=spec.dtype)
    return lambda: backend.run(a, b, scale_a, scale_b, offs, out, config, pair)


def measure(recipe: str, e: int, n: int, k: int, rows: int) -> dict:
    """The fallback's and the whole stack's peak transient bytes and bytes moved for an
    (E, N, K) weight stack and ``rows`` token rows, with the FP8 weight bytes."""
    act, weight, pair = RECIPES[recipe]
    with FakeTensorMode():
        a, sa, w, sw, offs = _fake_operands(recipe, e, n, k, rows)
        with MemoryMeter() as fallback:
            dequantize_call(a, w.transpose(-2, -1), sa, sw, offs, pair)()
        with MemoryMeter() as whole:
            whole_stack_gemm(a, w, sa, act, sw, weight, offs)
    return {"fallback_transient_bytes": fallback.peak, "fallback_moved_bytes": fallback.moved,
            "whole_stack_transient_bytes": whole.peak, "whole_stack_moved_bytes": whole.moved,
            "fp8_weight_bytes": e * n * k}


def case_fields(case) -> dict:
    """:func:`measure` for a grouped GEMM case (its recipe, E, N, K and M rows)."""
    return measure(case.step, case.E, case.N, case.K, case.M)


def table(records) -> str:
    """The fallback's memory lines of a run's ``ts_moe_fp8_fallback`` records: transient
    bytes and bytes moved, each beside the whole stack's, and the FP8 weight bytes."""
    rows = [r for r in records if r.get("fallback_transient_bytes") is not None]
    if not rows:
        return ""
    mb = 2**20
    lines = ["FP8 fallback (routed experts, in chunks) against dequantizing the whole stack, "
             "MiB:", f"{'case':46s} {'transient':>10s} {'(whole)':>9s} {'moved':>10s} "
                     f"{'(whole)':>10s} {'FP8 weights':>12s}"]
    for r in rows:
        case = f"{r['model']} {r['gemm']} {r.get('step', '')} T={r['T']} {r['routing']}"
        lines.append(f"{case:46s} {r['fallback_transient_bytes'] / mb:10.1f} "
                     f"{r['whole_stack_transient_bytes'] / mb:9.1f} "
                     f"{r['fallback_moved_bytes'] / mb:10.1f} "
                     f"{r['whole_stack_moved_bytes'] / mb:10.1f} "
                     f"{r['fp8_weight_bytes'] / mb:12.1f}")
    return "\n".join(lines)
