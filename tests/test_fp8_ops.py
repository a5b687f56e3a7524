"""ts_moe.scaled_grouped_gemm on the CPU: the reference path against a float64 reference
on the same quantized inputs, grouped_gemm's rules for offs and a_index, validation
that is the same eagerly, in the fake kernel and under torch.compile, and no backward."""

import pytest
import torch
import torch.nn.functional as F

import ts_moe
from ts_moe import scaled_grouped_gemm_swiglu
from ts_moe.fp8.recipes import E4M3, RECIPES, Pair, Recipe
from ts_moe.fp8.reference import dequantize
from ts_moe.reference import segment_ends

from .helpers import rel_err

PAIRS = [("blockwise_1x128", "blockwise_128x128"), ("rowwise", "rowwise"),
         ("tensorwise", "tensorwise")]


def _offs(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def problem(m=45, k=256, n=200, counts=(9, 0, 20, 13), pair=PAIRS[0], seed=0):
    """Quantized random operands: a (M, K), the weights (E, N, K) as stored and b its
    (E, K, N) view, their scales; offs of ``counts`` (rows past their sum: the tail).
    N = 200 is not a multiple of 128: a partial last scale block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).add(0.1)
    w = torch.randn(len(counts), n, k, generator=g) * k**-0.5
    xq, sx = ts_moe.quantize_fp8(x, pair[0])
    wq, sw = ts_moe.quantize_fp8(w, pair[1])
    return xq, wq, sx, sw, _offs(counts)


def ref64(a, w, sa, ra, sw, rw, offs, a_index=None):
    """float64: rows dequantized (gathered, zero out of range), per segment end."""
    x = dequantize(a, sa, ra, torch.float64)
    if a_index is not None:
        idx = a_index.long()
        ok = (idx >= 0) & (idx < a.shape[0])
        x = torch.where(ok[:, None], x[idx.clamp(0, a.shape[0] - 1)], 0)
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(segment_ends(offs, x.shape[0]).tolist()):
        if end > start:  # one expert's (N, K) at a time: DeepSeek-V3 sizes stay small
            out[start:end] = x[start:end] @ dequantize(w[e], sw[e], rw, torch.float64).t()
        start = end
    return out


def assert_rows_close(out, ref, tol=1e-2):
    """Relative error <= tol overall and in every row whose reference is not zero;
    rows whose reference is zero are exactly zero."""
    assert rel_err(out, ref) <= tol
    norms = ref.norm(dim=1)
    live = norms > 0
    row_err = (out.double() - ref).norm(dim=1)[live] / norms[live]
    assert row_err.numel() == 0 or row_err.max().item() <= tol
    assert (out[~live] == 0).all()


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
@pytest.mark.parametrize("counts", [(9, 0, 20, 13), (0, 0, 0, 45), (1, 0, 0, 0), (0, 0, 0, 0)],
                         ids=["ragged", "one_expert", "one_row", "no_rows"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_matches_float64_on_the_same_quantized_inputs(pair, counts, out_dtype):
    a, w, sa, sw, offs = problem(counts=counts, pair=pair)
    out = ts_moe.scaled_grouped_gemm(a, w.transpose(-2, -1), sa, pair[0], sw, pair[1], offs,
                                     out_dtype=out_dtype)
    assert out.shape == (45, 200) and out.dtype == out_dtype
    ref = ref64(a, w, sa, pair[0], sw, pair[1], offs)
    assert ref.abs().sum() > 0 or sum(counts) == 0
    assert_rows_close(out, ref, 1e-2 if out_dtype == torch.bfloat16 else 1e-5)
    assert (out[sum(counts):] == 0).all()


def test_recipes_as_scaling_types():
    a, w, sa, sw, offs = problem()
    by_name = ts_moe.scaled_grouped_gemm(a, w.mT, sa, "blockwise_1x128", sw,
                                         "blockwise_128x128", offs)
    by_type = ts_moe.scaled_grouped_gemm(a, w.mT, sa, F.ScalingType.BlockWise1x128, sw,
                                         F.ScalingType.BlockWise128x128, offs)
    assert torch.equal(by_name, by_type)


def test_recipe_is_one_value():
    """ScalingType is the public spelling; its members, their names and ts_moe's names all
    parse to one Recipe (a str: the kernels' plain name), each pair to one Pair; the
    weights' recipe names the activation recipe the layer pairs with it."""
    for member in RECIPES:
        st = member.scaling_type
        assert Recipe.parse(st) is Recipe.parse(st.name) is Recipe.parse(member.value) is member
        assert member == member.value and getattr(F.ScalingType, st.name) == st
    # the kernels' pairs (PAIRS), then MXFP8, which the references and the fallback serve
    assert [Pair.of(Recipe.parse(a), Recipe.parse(b)) for a, b in PAIRS] + [Pair.MX] == \
        list(Pair)
    assert [(p.a, p.b) for p in Pair] == [tuple(map(Recipe, pair)) for pair in PAIRS] + [
        (Recipe.MX_1X32, Recipe.MX_1X32)]
    assert Pair.BLOCKWISE == "blockwise" and Recipe.BLOCKWISE_128X128.activation is \
        Recipe.BLOCKWISE_1X128
    assert Recipe.TENSORWISE.activation is Recipe.ROWWISE is Recipe.ROWWISE.activation
    with pytest.raises(ValueError, match="scale_recipe_a/scale_recipe_b"):
        Pair.of(Recipe.ROWWISE, Recipe.TENSORWISE)


def test_invalid_offs_read_as_segment_ends():
    """Decreasing, too large and negative ends: grouped_gemm's reading, cummax(clamp)."""
    a, w, sa, sw, _ = problem(m=30)
    for offs in (torch.tensor([9, 4, 50, -3], dtype=torch.int32),
                 torch.tensor([-5, 7, 7, 2], dtype=torch.int32)):
        out = ts_moe.scaled_grouped_gemm(a, w.mT, sa, PAIRS[0][0], sw, PAIRS[0][1], offs)
        ends = segment_ends(offs, 30)
        assert_rows_close(out, ref64(a, w, sa, *PAIRS[0][:1], sw, PAIRS[0][1],
                                     ends.to(torch.int32)))
        assert (out[int(ends[-1]):] == 0).all()


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_a_index_gathers_rows_and_their_scales(pair):
    """Each slot reads its token's row and scale; indices outside [0, M) read zero rows
    (and give zero output rows), duplicates give equal rows."""
    a, w, sa, sw, _ = problem(m=20, pair=pair)
    g = torch.Generator().manual_seed(5)
    a_index = torch.randint(0, 20, (40,), generator=g, dtype=torch.int32)
    a_index[:6] = torch.tensor([-1, 20, 2**31 - 1, -(2**31), 5, 5], dtype=torch.int32)
    offs = _offs([12, 0, 17, 8])  # 3 tail rows
    out = ts_moe.scaled_grouped_gemm(a, w.mT, sa, pair[0], sw, pair[1], offs, a_index=a_index)
    assert out.shape == (40, 200)
    assert_rows_close(out, ref64(a, w, sa, pair[0], sw, pair[1], offs, a_index))
    assert (out[:4] == 0).all() and torch.equal(out[4], out[5]) and out[4].abs().sum() > 0
    assert (out[37:] == 0).all()


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_swiglu_form_matches_float64(pair):
    a, w, sa, sw, offs = problem(n=256, pair=pair)  # gate_up (E, 2I, K), I = 128
    a_index = torch.randint(-1, 46, (50,), generator=torch.Generator().manual_seed(1),
                            dtype=torch.int32)
    offs = _offs([10, 0, 25, 12])
    h = scaled_grouped_gemm_swiglu(a, w, sa, pair[0], sw, pair[1], offs, a_index=a_index)
    ref = ref64(a, w, sa, pair[0], sw, pair[1], offs, a_index)
    assert h.shape == (50, 128) and h.dtype == torch.bfloat16
    assert_rows_close(h, F.silu(ref[:, :128]) * ref[:, 128:])


def test_any_readable_strides_give_the_same_result():
    """M-major a, N-major b, row-major 1x128 scales, strided weight scales: read as
    they are (copied to the fast layout where a kernel needs it), same values."""
    a, w, sa, sw, offs = problem()
    fast = ts_moe.scaled_grouped_gemm(a, w.mT, sa, *PAIRS[0][:1], sw, PAIRS[0][1], offs)
    a_mmajor = a.t().contiguous().t()
    b_nmajor = w.mT.contiguous()
    sa_rows = sa.contiguous()
    sw_strided = torch.empty(sw.shape[0], sw.shape[1], 2 * sw.shape[2])[:, :, ::2].copy_(sw)
    other = ts_moe.scaled_grouped_gemm(a_mmajor, b_nmajor, sa_rows, PAIRS[0][0], sw_strided,
                                       PAIRS[0][1], offs)
    assert sa.stride() != sa_rows.stride() and b_nmajor.stride(1) != 1
    assert torch.equal(fast, other)


def test_tensorwise_scale_a_may_have_one_element():
    a, w, sa, sw, offs = problem(pair=PAIRS[2])
    assert sa.shape == ()
    out = ts_moe.scaled_grouped_gemm(a, w.mT, sa, "tensorwise", sw, "tensorwise", offs)
    one = ts_moe.scaled_grouped_gemm(a, w.mT, sa.reshape(1), "tensorwise", sw, "tensorwise", offs)
    assert torch.equal(out, one)


# ------------------------------------------------------------------ validation
def _outcome(fn, *args, **kwargs):
    """("ok", result) or ("error", type name, first word of the message), unwrapping
    dynamo's wrapper as tests/test_ops_semantics.py does."""
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - compared, not swallowed
        while type(exc).__module__.startswith("torch._dynamo"):
            exc = exc.__cause__ or exc.__context__
        return ("error", type(exc).__name__, str(exc).split()[0].rstrip(":"))


def _call(a, b, sa, ra, sb, rb, offs, out_dtype=torch.bfloat16, a_index=None):
    return ts_moe.scaled_grouped_gemm(a, b, sa, ra, sb, rb, offs, out_dtype=out_dtype,
                                      a_index=a_index)


def _bad_cases():
    a, w, sa, sw, offs = problem(m=20, counts=(5, 5, 5, 5))
    b = w.mT
    ok = dict(a=a, b=b, sa=sa, ra="blockwise_1x128", sb=sw, rb="blockwise_128x128", offs=offs)
    a_r, w_r, sa_r, sw_r, _ = problem(m=20, k=96, counts=(5, 5, 5, 5), pair=PAIRS[1])
    return {
        "a_bf16": (dict(ok, a=a.bfloat16()), "TypeError", "a"),
        "a_e5m2": (dict(ok, a=a.float().to(torch.float8_e5m2)), "TypeError", "a"),
        "b_e5m2": (dict(ok, b=b.float().to(torch.float8_e5m2)), "TypeError", "b"),
        "a_3d": (dict(ok, a=a[None]), "ValueError", "a"),
        "scale_a_fp16": (dict(ok, sa=sa.half()), "TypeError", "scale_a"),
        "scale_a_shape": (dict(ok, sa=sa[:, :1]), "ValueError", "scale_a"),
        "scale_b_shape": (dict(ok, sb=sw[:, :1]), "ValueError", "scale_b"),
        "rowwise_scale_for_blockwise": (dict(ok, sa=sa[:, 0]), "ValueError", "scale_a"),
        "pair": (dict(ok, rb="rowwise"), "ValueError", "scale_recipe_a/scale_recipe_b"),
        "recipe_name": (dict(ok, ra="blockwise"), "ValueError", "scale_recipe_a"),
        "recipe_type": (dict(ok, rb=5), "TypeError", "scale_recipe_b"),
        "nvfp4_recipe": (dict(ok, ra=F.ScalingType.BlockWise1x16), "ValueError",
                         "scale_recipe_a"),
        "k_blockwise": (dict(a=a_r, b=w_r.mT, sa=torch.ones(20, 1), ra="blockwise_1x128",
                             sb=torch.ones(4, 2, 1), rb="blockwise_128x128", offs=offs),
                        "ValueError", "a"),
        "offs_int64": (dict(ok, offs=offs.long()), "TypeError", "offs"),
        "offs_length": (dict(ok, offs=offs[:3]), "ValueError", "offs"),
        "k_mismatch": (dict(ok, b=b[:, :128]), "ValueError", "b"),
        "out_dtype": (dict(ok, out_dtype=torch.int8), "TypeError", "out_dtype"),
        "a_index_int64": (dict(ok, a_index=torch.arange(4)), "TypeError", "a_index"),
        "a_index_2d": (dict(ok, a_index=torch.zeros(2, 2, dtype=torch.int32)), "ValueError",
                       "a_index"),
        "scale_not_tensor": (dict(ok, sa=1.0), "TypeError", "scale_a"),
    }


BAD = _bad_cases()


# what the dispatcher cannot carry (a recipe that is no str, an argument that is no
# tensor) is named by the Python function before the op: under fullgraph=True dynamo
# reports such an error as an "observed exception" carrying it (checked apart)
BEFORE_THE_OP = ("recipe_type", "scale_not_tensor")


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_the_argument_everywhere(case):
    """The same error type naming the same argument: eager CPU, the fake kernel (meta
    tensors) and torch.compile(fullgraph=True)."""
    kw, exc, name = BAD[case]
    eager = _outcome(_call, **kw)
    assert eager == ("error", exc, name), eager
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    assert _outcome(_call, **meta) == eager
    torch._dynamo.reset()
    fullgraph = case not in BEFORE_THE_OP
    compiled = torch.compile(_call, backend="aot_eager", fullgraph=fullgraph, dynamic=True)
    assert _outcome(compiled, **kw) == eager
    if not fullgraph:
        torch._dynamo.reset()
        compiled = torch.compile(_call, backend="aot_eager", fullgraph=True, dynamic=True)
        with pytest.raises(Exception, match=f"{exc}.*{name} must be"):
            compiled(**kw)


# --------------------------------------------------------- torch.library, compile
# opcheck's test_schema compares inputs before and after with torch.allclose, which
# has no float8 kernel on the CPU: the inputs' bytes are compared here instead
OPCHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_opcheck_and_inputs_untouched(pair):
    a, w, sa, sw, offs = problem(pair=pair, n=128)
    a_index = torch.randint(-2, 47, (30,), dtype=torch.int32)
    before = [t.view(torch.uint8).clone() if t.dtype == E4M3 else t.clone()
              for t in (a, w, sa, sw, offs)]
    for kwargs in ({}, {"a_index": a_index}, {"out_dtype": torch.float32}):
        torch.library.opcheck(torch.ops.ts_moe.scaled_grouped_gemm.default,
                              (a, w.mT, sa, pair[0], sw, pair[1], offs), kwargs,
                              test_utils=OPCHECK)
        torch.library.opcheck(torch.ops.ts_moe.scaled_grouped_gemm_swiglu.default,
                              (a, w, sa, pair[0], sw, pair[1], offs), kwargs, test_utils=OPCHECK)
    after = [t.view(torch.uint8) if t.dtype == E4M3 else t for t in (a, w, sa, sw, offs)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_compile_fullgraph_matches_eager(pair):
    """Quantize and GEMM in one compiled graph, recipes as ScalingType members too."""
    types = {"blockwise_1x128": F.ScalingType.BlockWise1x128, "rowwise": F.ScalingType.RowWise,
             "tensorwise": F.ScalingType.TensorWise}

    def fn(x, wq, sw, offs, a_index):
        xq, sx = ts_moe.quantize_fp8(x, types[pair[0]])
        return ts_moe.scaled_grouped_gemm(xq, wq.mT, sx, types[pair[0]], sw, pair[1], offs,
                                          a_index=a_index)

    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 256, generator=g).bfloat16()
    _, wq, _, sw, _ = problem(pair=pair)
    offs, a_index = _offs([10, 0, 20, 15]), torch.randint(-1, 25, (48,), dtype=torch.int32)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x, wq, sw, offs, a_index), fn(x, wq, sw, offs, a_index))


# ------------------------------------------------------------------ no backward
def test_no_backward_eager_and_compiled():
    """A forward on inputs that need a gradient runs (inference without no_grad); a
    gradient through it raises NotImplementedError naming the op, in eager and
    compiled graphs; under no_grad nothing requires grad."""
    a, w, sa, sw, offs = problem(pair=PAIRS[1])
    x = torch.randn(45, 256, requires_grad=True)

    def fn(x):
        xq, sx = ts_moe.quantize_fp8(x, "rowwise")
        return ts_moe.scaled_grouped_gemm(xq, w.mT, sx, "rowwise", sw, "rowwise", offs)

    torch._dynamo.reset()
    for f in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
        out = f(x)
        assert out.requires_grad
        with pytest.raises(NotImplementedError, match="ts_moe.scaled_grouped_gemm has no "
                                                      "backward"):
            out.float().sum().backward()
    with pytest.raises(NotImplementedError, match="ts_moe.quantize_fp8 has no backward"):
        torch.autograd.grad(ts_moe.quantize_fp8(x, "rowwise")[1].sum(), x)
    scale = sw.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="scaled_grouped_gemm has no backward"):
        ts_moe.scaled_grouped_gemm(a, w.mT, sa, "rowwise", scale, "rowwise", offs).sum().backward()
    with torch.no_grad():
        assert not fn(x).requires_grad


# ------------------------------------------------------------------ the hot path
def test_hot_path_never_takes_a_call_the_full_check_refuses():
    """Once a valid call of each pair has taught it the spellings, the metadata check
    (:func:`ts_moe.fp8.recipes.scaled_call_ready`) passes a call only where
    :func:`check_scaled_args` passes it, with the same pair: the valid calls (plain,
    gathered, the SwiGLU form) and every bad case of this file, each also gathered."""
    from ts_moe.fp8.recipes import check_scaled_args, remember_ready, scaled_call_ready

    index = torch.tensor([3, -1, 7, 19], dtype=torch.int32)
    for pair in PAIRS:
        a, w, sa, sw, offs = problem(pair=pair)
        args = (a, w.mT, sa, pair[0], sw, pair[1], offs, None)
        remember_ready(pair[0], pair[1], check_scaled_args(*args))
        assert scaled_call_ready(*args) is check_scaled_args(*args)
        assert scaled_call_ready(*args, a_index=index) is check_scaled_args(*args, a_index=index)
        gate_up = (a, w, sa, pair[0], sw, pair[1], offs, None)
        assert scaled_call_ready(*gate_up, swiglu=True) is check_scaled_args(*gate_up,
                                                                             swiglu=True)
    refused = 0
    for case, (kw, _, _) in BAD.items():
        if case in BEFORE_THE_OP:
            continue  # the Python function names those before the op
        args = (kw["a"], kw["b"], kw["sa"], kw["ra"], kw["sb"], kw["rb"], kw["offs"],
                kw.get("out_dtype", torch.bfloat16))
        for a_index in (kw.get("a_index"), index):
            try:
                want = check_scaled_args(*args, a_index=a_index)
            except (TypeError, ValueError):
                want = None
                refused += 1
            assert scaled_call_ready(*args, a_index=a_index) is want, (case, a_index)
    assert refused >= len(BAD) - len(BEFORE_THE_OP)


def test_the_ops_take_the_hot_path_and_still_refuse_bad_input():
    """A valid call teaches the spelling; a later bad call with it still raises the
    full check's error (the hot path declines it)."""
    a, w, sa, sw, offs = problem()
    ts_moe.scaled_grouped_gemm(a, w.mT, sa, "blockwise_1x128", sw, "blockwise_128x128", offs)
    for case in ("scale_a_shape", "scale_b_shape", "offs_length", "k_mismatch", "a_3d"):
        kw, exc, name = BAD[case]
        assert _outcome(_call, **kw) == ("error", exc, name)
