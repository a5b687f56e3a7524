"""CPU: the model of the sm_90 FP8 kernels' arithmetic (tests/fp8_accumulation_model.py)
is the documented 14-bit accumulation, and the GPU tests' float64 tolerances cover it:
the GEMM's fp32 output, and the FP8 layer on the GPU test's own inputs (the float64
reference re-quantizes an intermediate that the truncations move)."""

import pytest
import torch

from .fp8_accumulation_model import (FP32_OUT_ROW_TOL, LAYER_ROW_TOL, LAYER_TOL, fp8_gemm,
                                     fp8_layer_rows, wgmma_k128)
from .test_fp8_layer import fp8_layer, reference64

FP8 = torch.float8_e4m3fn
TRUNCATIONS = ("rz", "floor")


def rows_rel_err(out, ref):
    return (out.double() - ref).norm(dim=1) / ref.norm(dim=1)


def test_the_model_keeps_14_bits():
    """A sum whose terms fit 14 bits below the largest is exact; a term 2**-14 of the
    largest is dropped (toward zero, or to -2**-13 of it toward -inf); ``exact`` is the
    float64 product."""
    w = torch.zeros(1, 128, dtype=torch.float64)
    w[0, :3] = 1.0
    for small, rz, floor in ((2.0**-13, 2.0**-13, 2.0**-13), (2.0**-14, 0.0, 0.0),
                             (-(2.0**-14), 0.0, -(2.0**-13))):
        a = torch.zeros(1, 128, dtype=torch.float64)
        a[0, :3] = torch.tensor([1.0, 0.5, small])
        assert wgmma_k128(a, w, "exact").item() == 1.5 + small
        assert wgmma_k128(a, w, "rz").item() == 1.5 + rz
        assert wgmma_k128(a, w, "floor").item() == 1.5 + floor
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 128, generator=g).to(FP8).double()
    b = torch.randn(16, 128, generator=g).to(FP8).double()
    assert torch.equal(wgmma_k128(a, b, "exact"), a @ b.T)


@pytest.mark.parametrize("mode", TRUNCATIONS)
def test_fp32_output_tolerance_covers_the_model(mode):
    """test_fp8_kernel_gpu.test_output_dtypes' problem (K = 512, N = 256, blockwise
    scales in [0.05, 0.1]): the truncations' row error is inside FP32_OUT_ROW_TOL, and
    it is theirs (fp32-faithful accumulation: 1e-6)."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(96, 512, generator=g).to(FP8)
    w = torch.randn(256, 512, generator=g).to(FP8)
    sa = (torch.rand(96, 4, generator=g) + 0.5) * 0.1
    sw = ((torch.rand(2, 4, generator=g) + 0.5) * 0.1).repeat_interleave(128, 0)
    ref = (a.double() * sa.double().repeat_interleave(128, 1)) @ \
        (w.double() * sw.double().repeat_interleave(128, 1)).T
    assert rows_rel_err(fp8_gemm(a, w, sa, sw, True, "exact"), ref).max() <= 1e-6
    err = rows_rel_err(fp8_gemm(a, w, sa, sw, True, mode), ref)
    assert 2.0**-16 < err.median() and err.max() <= FP32_OUT_ROW_TOL


@pytest.mark.parametrize("recipe", ["blockwise_128x128", "rowwise", "tensorwise"])
def test_layer_tolerance_covers_the_model(recipe):
    """test_fp8_gpu.test_layer_on_cuda_and_its_decode_graph's inputs through the model:
    every row inside LAYER_ROW_TOL and the whole inside LAYER_TOL for both truncations;
    with fp32-faithful accumulation the 1e-2 of the CPU layer tests holds."""
    data = fp8_layer(recipe, T=16, H=1024, I=512, E=8)
    ref = reference64(*data, 2, recipe)
    exact = fp8_layer_rows(*data, 2, recipe, "exact")
    assert rows_rel_err(exact, ref).max() <= 1e-2
    for mode in TRUNCATIONS:
        out = fp8_layer_rows(*data, 2, recipe, mode)
        assert rows_rel_err(out, ref).max() <= LAYER_ROW_TOL
        assert ((out.double() - ref).norm() / ref.norm()).item() <= LAYER_TOL
