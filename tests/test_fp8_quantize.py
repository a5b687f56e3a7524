"""ts_moe.quantize_fp8 on the CPU: scales are amax / 448 per group (checked against a
per-group loop), round trips within e4m3's rounding, zero groups, the scales' layout,
validation, opcheck and compile."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ts_moe
from ts_moe.fp8.recipes import E4M3, Recipe
from ts_moe.fp8.reference import dequantize, quantize_reference

# every recipe on activations (2-D) and weights (3-D), sizes not multiples of 128
CASES = [("blockwise_1x128", (37, 300)), ("rowwise", (37, 300)), ("tensorwise", (37, 300)),
         ("blockwise_128x128", (3, 200, 300)), ("rowwise", (3, 200, 96)),
         ("tensorwise", (3, 200, 96)), ("blockwise_1x128", (2, 5, 256)),
         ("blockwise_128x128", (130, 129))]


def _groups(recipe, shape):
    """(scale index, element slices) of every group, by loops (independent of the
    implementation's reshapes)."""
    *lead, rows, cols = shape
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in lead]).reshape(
            -1, len(lead)).tolist() if lead else [[]]:
        idx = tuple(idx)
        if recipe == "tensorwise":
            yield idx, (*idx, slice(None), slice(None))
        elif recipe == "rowwise":
            for r in range(rows):
                yield (*idx, r), (*idx, r, slice(None))
        elif recipe == "blockwise_1x128":
            for r in range(rows):
                for c in range(-(-cols // 128)):
                    yield (*idx, r, c), (*idx, r, slice(128 * c, 128 * c + 128))
        else:
            for r in range(-(-rows // 128)):
                for c in range(-(-cols // 128)):
                    yield (*idx, r, c), (*idx, slice(128 * r, 128 * r + 128),
                                         slice(128 * c, 128 * c + 128))


def _data(shape, dtype, seed=0):
    """randn with a spread of magnitudes per row (so groups differ in scale)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g).mul(100)
    return x.to(dtype)


@pytest.mark.parametrize("recipe,shape", CASES, ids=[f"{r}-{'x'.join(map(str, s))}"
                                                     for r, s in CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scale_is_amax_over_448_and_round_trip_within_e4m3(recipe, shape, dtype):
    x = _data(shape, dtype)
    q, scale = ts_moe.quantize_fp8(x, recipe)
    assert q.dtype == E4M3 and q.shape == x.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.stride() == Recipe(recipe).scale_strides(shape)
    xf = x.float()
    deq = dequantize(q, scale, recipe)
    for s_idx, elems in _groups(recipe, shape):
        group = xf[elems]
        s = scale[s_idx]
        assert s == group.abs().max() / 448  # fp32, one rounding, as the kernel
        # e4m3: 3 mantissa bits (relative rounding <= 2**-4) down to 2**-6; below,
        # subnormal steps of 2**-9 (absolute <= 2**-10): in units of the scale
        err = (deq[elems] - group).abs()
        bound = torch.maximum(group.abs() * 2**-4, s * 2**-10) * (1 + 2**-20)
        assert (err <= bound).all()
        # the largest element of a group maps to 448: nothing saturates early
        assert q[elems].float().abs().max() == 448
    assert torch.isfinite(deq).all()


class NumberDivisors(TorchDispatchMode):
    """Records the divisions by a Python number: torch on CUDA computes ``t / 448.0`` as
    ``t * fl(1 / 448)`` (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu), not the
    correctly rounded quotient the CPU and the quantize kernel (div.rn.f32) give."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.div, torch.ops.aten.div_) and \
                isinstance(args[1], (int, float)):
            self.found.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe,shape", CASES, ids=[f"{r}-{'x'.join(map(str, s))}"
                                                     for r, s in CASES])
def test_divisions_are_true_on_every_device(recipe, shape):
    """The reference quantizer, and the kernel tests' torch reference of the quantizer,
    divide by no Python number (so CUDA gives the CPU's bits) and agree bit for bit; the
    scale is the correctly rounded amax / 448."""
    from .test_fp8_kernel_gpu import quantize_ref

    x = _data(shape, torch.float32, seed=1)
    x[..., :1, :] = 0  # a zero group
    with NumberDivisors() as divisions:
        q, scale = quantize_reference(x, recipe)
        kernel_test = len(shape) == 2 and recipe != "blockwise_128x128" and \
            (recipe != "blockwise_1x128" or shape[1] % 128 == 0)
        if kernel_test:
            rq, rs = quantize_ref(x, recipe)
    assert divisions.found == []
    if kernel_test:
        assert torch.equal(rs, scale) and torch.equal(rq.view(torch.uint8), q.view(torch.uint8))
    for s_idx, elems in _groups(recipe, shape):
        assert scale[s_idx] == (x[elems].abs().max().double() / 448).float()


def test_a_reciprocal_multiply_is_not_amax_over_448():
    """Why the divisor must be a tensor: fl(amax * fl(1 / 448)) misses the correctly
    rounded amax / 448 by one ulp for about half the amaxes (what torch on CUDA
    computes for ``amax / 448.0``)."""
    amax = torch.rand(10000, generator=torch.Generator().manual_seed(2)) * 100
    true = (amax.double() / 448).float()
    assert torch.equal(amax / amax.new_full((), 448.0), true)
    recip = amax * (torch.ones(()) / 448)
    off = recip != true
    assert 0.3 < off.float().mean() < 0.7
    assert ((recip.view(torch.int32) - true.view(torch.int32)).abs() <= 1).all()


@pytest.mark.parametrize("recipe", ["blockwise_1x128", "rowwise", "tensorwise",
                                    "blockwise_128x128"])
def test_zero_groups_give_scale_zero_and_zeros(recipe):
    x = _data((3, 130, 256), torch.bfloat16)
    x[1] = 0  # a whole matrix: every recipe's group
    x[2, :, 128:] = 0  # half of each row: a 1x128 group per row, a 128x128 block
    q, scale = ts_moe.quantize_fp8(x, recipe)
    assert not q.float().isnan().any() and not scale.isnan().any()
    deq = dequantize(q, scale, recipe)
    assert (deq[1] == 0).all() and (deq[2, :, 128:] == 0).all()
    assert (q[1].float() == 0).all()
    zeros = scale[1] if recipe in ("tensorwise", "rowwise") else scale[2, :, 1]
    assert (zeros == 0).all()
    tiny = torch.full((2, 16), 1e-44)  # amax / 448 underflows fp32: a zero scale too
    q, s = ts_moe.quantize_fp8(tiny, "rowwise")
    assert (s == 0).all() and (q.float() == 0).all()


def test_quantized_inputs_feed_the_gemm_without_copies():
    """The 1x128 scale is M-major with the row count padded to 4 (the kernels' TMA
    box layout), the others contiguous, also for a row count that is no multiple of 4."""
    q, s = ts_moe.quantize_fp8(_data((37, 256), torch.bfloat16), "blockwise_1x128")
    assert s.shape == (37, 2) and s.stride() == (1, 40)
    q, s = ts_moe.quantize_fp8(_data((37, 256), torch.bfloat16), F.ScalingType.RowWise)
    assert s.shape == (37,) and s.is_contiguous()
    q, s = ts_moe.quantize_fp8(_data((4, 256, 384), torch.bfloat16), "blockwise_128x128")
    assert s.shape == (4, 2, 3) and s.is_contiguous()


@pytest.mark.parametrize("bad,exc,match", [
    (lambda x: (x.int(), "rowwise"), TypeError, "x must be"),
    (lambda x: (x[0], "rowwise"), ValueError, "x must have at least 2 dims"),
    (lambda x: (x, "per_row"), ValueError, "recipe 'per_row' is not supported"),
    (lambda x: (x, F.ScalingType.BlockWise1x16), ValueError, "recipe 'BlockWise1x16'"),
    (lambda x: (x, 3), TypeError, "recipe must be a str"),
    (lambda x: ([1.0], "rowwise"), TypeError, "x must be a torch.Tensor"),
])
def test_bad_input_named(bad, exc, match):
    args = bad(torch.randn(4, 128))
    with pytest.raises(exc, match=match):
        ts_moe.quantize_fp8(*args)
    if isinstance(args[0], torch.Tensor) and isinstance(args[1], (str, F.ScalingType)):
        with pytest.raises(exc, match=match):  # the fake kernel alike
            ts_moe.quantize_fp8(args[0].to("meta"), args[1])


@pytest.mark.parametrize("recipe,shape", CASES[:5], ids=[r for r, _ in CASES[:5]])
def test_opcheck_and_compile(recipe, shape):
    x = _data(shape, torch.bfloat16)
    torch.library.opcheck(torch.ops.ts_moe.quantize_fp8.default, (x, recipe))
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: ts_moe.quantize_fp8(t, recipe), backend="aot_eager",
                             fullgraph=True, dynamic=True)
    (q, s), (q2, s2) = compiled(x), ts_moe.quantize_fp8(x, recipe)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    assert s.stride() == s2.stride()


@pytest.mark.parametrize("recipe,shape", [
    ("rowwise", (2, 0, 16)), ("tensorwise", (2, 0, 16)), ("blockwise_128x128", (2, 0, 16)),
    ("blockwise_1x128", (2, 0, 128)), ("rowwise", (3, 2, 0, 16)), ("rowwise", (0, 4, 16)),
    ("rowwise", (2, 3, 0)), ("tensorwise", (2, 3, 0)), ("rowwise", (0, 16))])
def test_empty_matrices_quantize_as_the_fake_kernel_says(recipe, shape):
    """Empty tensors are accepted, as by the other ops: the eager call gives the shapes and
    layouts of the meta kernel (and so of a compiled call), zero scales for the empty
    groups."""
    x = torch.ones(shape)
    q, s = ts_moe.quantize_fp8(x, recipe)
    for got, want in zip((q, s), ts_moe.quantize_fp8(x.to("meta"), recipe)):
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    assert not s.any()
    torch.library.opcheck(torch.ops.ts_moe.quantize_fp8.default, (x, recipe))
    torch._dynamo.reset()
    q2, s2 = torch.compile(lambda t: ts_moe.quantize_fp8(t, recipe), backend="aot_eager",
                           fullgraph=True)(x)
    assert (q2.shape, q2.stride(), s2.shape, s2.stride()) == (q.shape, q.stride(), s.shape,
                                                              s.stride())
    assert torch.equal(s2, s)
