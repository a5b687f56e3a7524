"""FP8 scaling recipes: their names, the scale shapes they imply, and the argument checks
of the FP8 ops (metadata only: no host sync, run before any kernel).

A recipe says how one fp32 scale covers the elements of a matrix ``(..., R, C)``
(leading dims batch: an (E, N, K) weight stack is E matrices):

- ``tensorwise``: one scale per matrix, shape ``(...)`` (a 2-D activation: a 0-d scale;
  an (E, N, K) weight stack: (E,), one per expert);
- ``rowwise``: one per row, ``(..., R)`` (activations: per token; weights: per
  output channel);
- ``blockwise_1x128``: one per row per 128 columns, ``(..., R, ceil(C/128))``
  (activations per token per 128 channels, as DeepSeek-V3 quantizes them);
- ``blockwise_128x128``: one per 128x128 block, ``(..., ceil(R/128), ceil(C/128))``
  (the checkpoints' ``weight_scale_inv``).

Scales are dequantization multipliers, as checkpoints store them: real ~ fp8 x scale.
The names are ``torch.nn.functional.ScalingType``'s (``TensorWise``, ``RowWise``,
``BlockWise1x128``, ``BlockWise128x128``), whose members are accepted too.

The op pairs a recipe for ``a`` (tokens) with one for ``b`` (weights); the
supported pairs are those of :data:`PAIRS`.  The element type is e4m3
(``torch.float8_e4m3fn``, largest finite 448) throughout.
"""

import torch

from ..checks import _check_a_index as check_a_index

BLOCK = 128  # the blockwise recipes' block edge
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TENSORWISE, ROWWISE = "tensorwise", "rowwise"
BLOCKWISE_1X128, BLOCKWISE_128X128 = "blockwise_1x128", "blockwise_128x128"
RECIPES = (TENSORWISE, ROWWISE, BLOCKWISE_1X128, BLOCKWISE_128X128)
# the activation recipes (a 2-D x, one scale layout per token row or per tensor)
ACTIVATION_RECIPES = (BLOCKWISE_1X128, ROWWISE, TENSORWISE)
# (recipe of a, recipe of b) -> the kernel's name for the pair
PAIRS = {(BLOCKWISE_1X128, BLOCKWISE_128X128): "blockwise",
         (ROWWISE, ROWWISE): "rowwise",
         (TENSORWISE, TENSORWISE): "tensorwise"}
# the activation recipe the layer pairs with a weight recipe (a tensorwise weight
# scale is served as rowwise: per-token activations, the weight scale per channel)
ACTIVATION_FOR = {BLOCKWISE_128X128: BLOCKWISE_1X128, ROWWISE: ROWWISE, TENSORWISE: ROWWISE}
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QUANTIZE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
MAX_ROWS = 2**31 - 1  # offs is int32
SCALE_ALIGN = 4  # fp32 elements per 16 bytes: the padded M of an M-major 1x128 scale

_SCALING_TYPE_NAMES = {"TensorWise": TENSORWISE, "RowWise": ROWWISE,
                       "BlockWise1x128": BLOCKWISE_1X128, "BlockWise128x128": BLOCKWISE_128X128}
_ScalingType = getattr(torch.nn.functional, "ScalingType", None)


def recipe_name(recipe, name: str = "recipe") -> str:
    """``recipe`` (one of :data:`RECIPES`, a ``torch.nn.functional.ScalingType`` member,
    or such a member's name) as its name; TypeError or ValueError naming the argument."""
    recipe = recipe_arg(recipe, name)
    if recipe in RECIPES:
        return recipe
    if recipe in _SCALING_TYPE_NAMES:
        return _SCALING_TYPE_NAMES[recipe]
    raise ValueError(f"{name} {recipe!r} is not supported; the recipes: {', '.join(RECIPES)} "
                     f"(or the ScalingType members {', '.join(_SCALING_TYPE_NAMES)})")


def recipe_arg(recipe, name: str = "recipe") -> str:
    """What the ops' schemas take for a recipe: a str as it is, a ScalingType member as its
    name (the op's checks judge it, so that a bad one fails alike eagerly and under
    ``torch.compile``); anything else is a TypeError here."""
    if isinstance(recipe, str):
        return recipe
    if _ScalingType is not None and isinstance(recipe, _ScalingType):
        return recipe.name
    raise TypeError(f"{name} must be a str ({', '.join(RECIPES)}) or a "
                    f"torch.nn.functional.ScalingType, got {type(recipe).__name__}")


def scale_shape(recipe: str, shape) -> tuple:
    """The scale shape of ``recipe`` over a tensor of ``shape`` (..., R, C)."""
    *lead, rows, cols = shape
    lead = tuple(lead)
    if recipe == TENSORWISE:
        return lead
    if recipe == ROWWISE:
        return (*lead, rows)
    if recipe == BLOCKWISE_1X128:
        return (*lead, rows, -(-cols // BLOCK))
    return (*lead, -(-rows // BLOCK), -(-cols // BLOCK))


def scale_strides(recipe: str, shape) -> tuple:
    """The strides of a fresh scale of ``recipe`` for a tensor of ``shape``: the fast
    layout of the kernels.  ``blockwise_1x128``: M-major (stride 1 on the rows, the
    row count padded to 16 bytes), the transpose of a contiguous (..., ceil(C/128),
    Rp) tensor, so that one k-block's scales of a tile of rows are one TMA box;
    the others contiguous."""
    sshape = scale_shape(recipe, shape)
    if recipe == BLOCKWISE_1X128:
        *lead, rows, blocks = sshape
        padded = -(-rows // SCALE_ALIGN) * SCALE_ALIGN
        inner, step = (1, padded), padded * blocks
    else:
        lead, inner, step = sshape, (), 1
    outer = []
    for size in reversed(lead):
        outer.insert(0, step)
        step *= size
    return (*outer, *inner)


def _check_types(**tensors) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_fp8(name: str, t: torch.Tensor) -> None:
    if t.dtype != E4M3:
        hint = (" (e5m2 is not supported: the recipes are e4m3)" if t.dtype == torch.float8_e5m2
                else "")
        raise TypeError(f"{name} must be torch.float8_e4m3fn, got {t.dtype}{hint}")


def _check_scale(name: str, t: torch.Tensor, expected: tuple, recipe: str, what: str) -> None:
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (dequantization multipliers), got {t.dtype}")
    shape = tuple(t.shape)
    ok = shape == expected or (recipe == TENSORWISE and expected == () and shape == (1,))
    if not ok:
        raise ValueError(f"{name} must have shape {expected} for the {recipe} recipe ({what}), "
                         f"got {shape}")


def check_scaled_args(a, b, scale_a, recipe_a, scale_b, recipe_b, offs, out_dtype=None, *,
                      a_index=None, swiglu: bool = False) -> tuple[str, str, str]:
    """Validate a scaled grouped GEMM call; returns the pair's kernel name
    (``blockwise``, ``rowwise``, ``tensorwise``) and the two recipes' names.

    ``a`` (M, K) e4m3; ``b`` (E, K, N) e4m3 (``swiglu``: ``gate_up`` (E, 2I, K)); ``offs``
    int32 (E,); ``scale_a`` / ``scale_b`` fp32 of the shapes their recipes give for
    ``a`` (M rows: the rows of ``a``, before any ``a_index`` gather) and for the
    weights as stored, (E, N, K); ``a_index`` int32 (M',).  Strides are free (the
    fast layouts are documented on the op).  Errors name the argument first.
    """
    b_name = "gate_up" if swiglu else "b"
    _check_types(a=a, **{b_name: b}, scale_a=scale_a, scale_b=scale_b, offs=offs)
    recipe_a = recipe_name(recipe_a, "scale_recipe_a")
    recipe_b = recipe_name(recipe_b, "scale_recipe_b")
    pair = PAIRS.get((recipe_a, recipe_b))
    if pair is None:
        raise ValueError(f"scale_recipe_a/scale_recipe_b: the pair ({recipe_a}, {recipe_b}) is "
                         f"not supported; supported pairs: "
                         + ", ".join(f"({x}, {y})" for x, y in PAIRS))
    for name, t, rank in (("a", a, 2), (b_name, b, 3), ("offs", offs, 1)):
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D, got shape {tuple(t.shape)}")
    _check_fp8("a", a)
    _check_fp8(b_name, b)
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must be int32, got {offs.dtype}")
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, "
                        f"got {out_dtype}")
    device = a.device
    for name, t in ((b_name, b), ("scale_a", scale_a), ("scale_b", scale_b), ("offs", offs)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, a on {device}: one device for all")
    m, k = a.shape
    if swiglu:
        num_experts, n, k_b = b.shape
        if n % 2:
            raise ValueError(f"gate_up must be (E, 2I, K) (gate rows, then as many up rows), "
                             f"got {tuple(b.shape)}: an odd number of rows")
    else:
        num_experts, k_b, n = b.shape
    if k_b != k:
        raise ValueError(f"{b_name}: K mismatch: a is {tuple(a.shape)} (K={k}), {b_name} is "
                         f"{tuple(b.shape)} (K={k_b})")
    if offs.shape[0] != num_experts:
        raise ValueError(f"offs must have one entry per expert: {b_name} has {num_experts} "
                         f"experts, offs has {offs.shape[0]} entries")
    if offs.shape[0] > 1 and offs.stride(0) != 1:
        raise ValueError("offs must be contiguous")
    if m > MAX_ROWS:
        raise ValueError(f"a has {m} rows; at most 2**31 - 1 are supported (offs is int32)")
    if pair == "blockwise" and k % BLOCK:
        raise ValueError(f"a: K = {k} must be a multiple of {BLOCK} for the blockwise recipes")
    _check_scale("scale_a", scale_a, scale_shape(recipe_a, (m, k)), recipe_a,
                 f"a is {tuple(a.shape)}")
    _check_scale("scale_b", scale_b, scale_shape(recipe_b, (num_experts, n, k)), recipe_b,
                 f"the weights are (E, N, K) = {(num_experts, n, k)}")
    if a_index is not None:
        check_a_index(a_index, device)  # grouped_gemm's rules
    return pair, recipe_a, recipe_b


def check_quantize_args(x, recipe) -> str:
    """Validate a :func:`ts_moe.quantize_fp8` call; returns the recipe's name."""
    _check_types(x=x)
    recipe = recipe_name(recipe, "recipe")
    if x.dtype not in QUANTIZE_DTYPES:
        raise TypeError(f"x must be bfloat16, float16, float32 or float64, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims (..., rows, columns), got shape "
                         f"{tuple(x.shape)}")
    return recipe
