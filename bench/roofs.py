"""The machine's roofs, measured in the benchmark's own process, and each
result's distance from the roof that bounds it."""

import functools
import math

import torch

from .timing import measure, nvtx_range

HBM_READ_BYTES = 4 << 30  # far past L2: every byte comes from HBM
GEMM_SIZE = 8192


def measure_roofs(device: torch.device, hbm_bytes: int = HBM_READ_BYTES,
                  gemm_size: int = GEMM_SIZE) -> dict[str, float]:
    """``hbm_read_tbps``: bytes read / time of a sum over ``hbm_bytes`` of fp32;
    ``bf16_dense_tflops``: a ``gemm_size``-cubed bf16 ``torch.mm`` on randn data
    (random bits draw more power than zeros, so this is the clock the GEMMs get)."""
    with nvtx_range("roofs"):
        x = torch.ones(hbm_bytes // 4, dtype=torch.float32, device=device)
        read = measure([x.sum], device, target_ms=200, min_iters=10)
        del x
        a, b = (torch.randn(gemm_size, gemm_size, dtype=torch.bfloat16, device=device)
                for _ in range(2))
        mm = measure([functools.partial(torch.mm, a, b)], device, target_ms=200, min_iters=10)
        del a, b
    if device.type == "cuda":
        torch.cuda.empty_cache()
    roofs = {
        "hbm_read_tbps": hbm_bytes / (read.ms * 1e-3) / 1e12,
        "bf16_dense_tflops": 2 * gemm_size**3 / (mm.ms * 1e-3) / 1e12,
    }
    if device.type == "cuda":
        roofs["fp8_dense_tflops"] = measure_fp8_roof(device, gemm_size)
    return roofs


def measure_fp8_roof(device: torch.device, gemm_size: int = GEMM_SIZE) -> float | None:
    """``fp8_dense_tflops``: a ``gemm_size``-cubed e4m3 ``torch._scaled_mm`` (per-tensor
    scales, bf16 out) on randn data; None where this GPU or torch has none."""
    try:
        with nvtx_range("fp8 roof"):
            a, b = (torch.randn(gemm_size, gemm_size, device=device).to(torch.float8_e4m3fn)
                    for _ in range(2))
            one = torch.ones((), device=device)
            mm = functools.partial(torch._scaled_mm, a, b.t(), one, one,
                                   out_dtype=torch.bfloat16)
            t = measure([mm], device, target_ms=200, min_iters=10)
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 2 * gemm_size**3 / (t.ms * 1e-3) / 1e12


def roof_fraction(ms: float, flops: int, nbytes: int, roofs: dict | None,
                  flop_roof: str = "bf16_dense_tflops"):
    """(fraction, bound): the time the bounding roof allows over the measured
    time (1.0 = at the roof), and which roof ("hbm" or "flop") bounds the case;
    ``flop_roof``: the dense roof the case's flops run at (the fp8 suite:
    ``fp8_dense_tflops``; (None, None) where the run has not measured it)."""
    if not roofs or not ms or not math.isfinite(ms) or not roofs.get(flop_roof):
        return None, None
    t_hbm = nbytes / (roofs["hbm_read_tbps"] * 1e12)
    t_flop = flops / (roofs[flop_roof] * 1e12)
    bound = "hbm" if t_hbm >= t_flop else "flop"
    return max(t_hbm, t_flop) / (ms * 1e-3), bound
