"""FP8 scaling recipes as one value, :class:`Recipe`, and the argument checks of the FP8
ops, which parse a call's recipes into it (metadata only: no host sync, run before any
kernel).

A recipe says how one fp32 scale covers the elements of a matrix ``(..., R, C)``
(leading dims batch: an (E, N, K) weight stack is E matrices):

- ``TENSORWISE``: one scale per matrix, shape ``(...)`` (a 2-D activation: a 0-d scale;
  an (E, N, K) weight stack: (E,), one per expert);
- ``ROWWISE``: one per row, ``(..., R)`` (activations: per token; weights: per
  output channel);
- ``BLOCKWISE_1X128``: one per row per 128 columns, ``(..., R, ceil(C/128))``
  (activations per token per 128 channels, as DeepSeek-V3 quantizes them);
- ``BLOCKWISE_128X128``: one per 128x128 block, ``(..., ceil(R/128), ceil(C/128))``
  (the checkpoints' ``weight_scale_inv``);
- ``MX_1X32``: MXFP8, an e8m0 (power of two) scale per row per 32 columns,
  ``(..., R, ceil(C/32))`` (OCP Microscaling v1.0); served by the references and the
  dequantize fallback (no FP8 kernel takes it yet).

Each recipe is a format descriptor (:attr:`Recipe.format`,
``csrc_free_kernels.common.formats``): element and scale types, the block one scale
covers, the scale's layout.  Shapes, strides, checks, the references and the fallback
read the descriptor, as the kernels' scale layouts do.

Scales are dequantization multipliers, as checkpoints store them: real ~ fp8 x scale.
The public spelling is ``torch.nn.functional.ScalingType`` (``TensorWise``, ``RowWise``,
``BlockWise1x128``, ``BlockWise128x128``, ``BlockWise1x32``); :meth:`Recipe.parse` takes a member, its name,
a :class:`Recipe` or ts_moe's name (``"blockwise_1x128"``, ...).  It runs once where a
call enters ts_moe: in the FP8 ops' kernels and fake kernels (their schemas carry a
recipe as a string), in the layer's expert-weights value and in the loaders (which read
it from config.json); everything below takes the parsed value.

The scaled GEMM pairs a recipe for ``a`` (tokens) with one for ``b`` (weights); the
supported pairs are the members of :class:`Pair`.  Both are ``str`` enums: a member *is*
its name, so the kernels (``csrc_free_kernels``, which does not import ts_moe) take the
parsed value as the plain name they know (``"blockwise"``, ``"rowwise"``,
``"tensorwise"`` for the GEMM's pairs; the activation recipes' names for the quantizer).
The element type is e4m3 (``torch.float8_e4m3fn``, largest finite 448) throughout.
"""

import enum
import functools

import torch

from ..checks import _check_a_index as check_a_index
from ..ops.kernels import FORMATS, ScaleFormat

BLOCK = FORMATS["blockwise_128x128"].block[1]  # the blockwise recipes' block edge
E4M3 = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QUANTIZE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
MAX_ROWS = 2**31 - 1  # offs is int32
_ScalingType = getattr(torch.nn.functional, "ScalingType", None)


class NamedEnum(str, enum.Enum):
    """An enum whose members are their names as strings (``str()``, f-strings, ``==`` a
    str): Python 3.10's stand-in for ``enum.StrEnum``."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Recipe(NamedEnum):
    """How one fp32 scale covers a matrix (module docstring); a member is its name."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE_1X128 = "blockwise_1x128"
    BLOCKWISE_128X128 = "blockwise_128x128"
    MX_1X32 = "mx_1x32"

    @classmethod
    def parse(cls, value, name: str = "recipe") -> "Recipe":
        """``value`` (a :class:`Recipe`, a ``torch.nn.functional.ScalingType`` member, or
        either's name) as a :class:`Recipe`; TypeError or ValueError naming ``name``."""
        if isinstance(value, cls):
            return value
        if _ScalingType is not None and isinstance(value, _ScalingType):
            value = value.name
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str ({', '.join(cls)}) or a "
                            f"torch.nn.functional.ScalingType, got {type(value).__name__}")
        recipe = _BY_NAME.get(value)
        if recipe is None:
            raise ValueError(f"{name} {value!r} is not supported; the recipes: "
                             f"{', '.join(cls)} (or the ScalingType members "
                             f"{', '.join(_SCALING_NAMES.values())})")
        return recipe

    @property
    def scaling_type(self):
        """This recipe's ``torch.nn.functional.ScalingType`` member (None where torch
        has no ``ScalingType``)."""
        return None if _ScalingType is None else getattr(_ScalingType, _SCALING_NAMES[self])

    @property
    def format(self) -> ScaleFormat:
        """This recipe's format descriptor: element and scale types, block, layout."""
        return FORMATS[self.value]

    @property
    def scale_dtype(self) -> torch.dtype:
        """The torch dtype of this recipe's scales (fp32, or e8m0 for MX)."""
        return getattr(torch, self.format.scale)

    @property
    def activation(self) -> "Recipe":
        """The activation recipe paired with this weight recipe: per token per 128
        channels for blockwise weights, MX with MX, per token otherwise (a per-expert
        weight scale is then served per channel)."""
        return {Recipe.BLOCKWISE_128X128: Recipe.BLOCKWISE_1X128,
                Recipe.MX_1X32: Recipe.MX_1X32}.get(self, Recipe.ROWWISE)

    def scale_shape(self, shape) -> tuple:
        """The scale shape of this recipe over a tensor of ``shape`` (..., R, C)."""
        return self.format.scale_shape(shape)

    def scale_strides(self, shape) -> tuple:
        """The strides of a fresh scale of this recipe for a tensor of ``shape``: the
        kernels' fast layout (:meth:`ScaleFormat.scale_strides`: ``BLOCKWISE_1X128``
        M-major, its rows padded to 16 bytes, so that one k-block's scales of a tile of
        rows are one TMA box; the others contiguous)."""
        return self.format.scale_strides(shape)


_SCALING_NAMES = {Recipe.TENSORWISE: "TensorWise", Recipe.ROWWISE: "RowWise",
                  Recipe.BLOCKWISE_1X128: "BlockWise1x128",
                  Recipe.BLOCKWISE_128X128: "BlockWise128x128",
                  Recipe.MX_1X32: "BlockWise1x32"}
_BY_NAME = {**{r.value: r for r in Recipe}, **{n: r for r, n in _SCALING_NAMES.items()}}
RECIPES = tuple(Recipe)
WEIGHT_RECIPES = (Recipe.BLOCKWISE_128X128, Recipe.ROWWISE, Recipe.TENSORWISE)


class Pair(NamedEnum):
    """A supported pair of recipes of the scaled GEMM, ``a``'s (tokens) and ``b``'s
    (weights); a member is the FP8 kernel's name for it."""

    BLOCKWISE = "blockwise"
    ROWWISE = "rowwise"
    TENSORWISE = "tensorwise"
    MX = "mx"

    @property
    def a(self) -> Recipe:
        return _RECIPES_OF[self][0]

    @property
    def b(self) -> Recipe:
        return _RECIPES_OF[self][1]

    @classmethod
    def of(cls, recipe_a: Recipe, recipe_b: Recipe) -> "Pair":
        """The pair of two parsed recipes, or a ValueError naming both arguments."""
        pair = _PAIR_OF.get((recipe_a, recipe_b))
        if pair is None:
            raise ValueError(f"scale_recipe_a/scale_recipe_b: the pair ({recipe_a}, {recipe_b}) "
                             f"is not supported; supported pairs: "
                             + ", ".join(f"({p.a}, {p.b})" for p in cls))
        return pair


_RECIPES_OF = {Pair.BLOCKWISE: (Recipe.BLOCKWISE_1X128, Recipe.BLOCKWISE_128X128),
               Pair.ROWWISE: (Recipe.ROWWISE, Recipe.ROWWISE),
               Pair.TENSORWISE: (Recipe.TENSORWISE, Recipe.TENSORWISE),
               Pair.MX: (Recipe.MX_1X32, Recipe.MX_1X32)}
_PAIR_OF = {recipes: pair for pair, recipes in _RECIPES_OF.items()}


def schema_recipe(value, name: str) -> str:
    """What the ops' schemas take for a recipe: a str (a :class:`Recipe` included) as
    it is, a ScalingType member as its name; the op parses it (so that a bad one fails
    alike eagerly and under ``torch.compile``); anything else is a TypeError here."""
    if isinstance(value, Recipe):
        return value.value
    if isinstance(value, str):
        return value
    if _ScalingType is not None and isinstance(value, _ScalingType):
        return value.name
    raise TypeError(f"{name} must be a str ({', '.join(Recipe)}) or a "
                    f"torch.nn.functional.ScalingType, got {type(value).__name__}")


# ------------------------------------------------------------------ checks
def _check_types(**tensors) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_fp8(name: str, t: torch.Tensor) -> None:
    if t.dtype != E4M3:
        hint = (" (e5m2 is not supported: the recipes are e4m3)" if t.dtype == torch.float8_e5m2
                else "")
        raise TypeError(f"{name} must be torch.float8_e4m3fn, got {t.dtype}{hint}")


def check_scale(name: str, t, expected: tuple, recipe: Recipe, what: str) -> None:
    """``t`` a scale of the recipe's scale type and of shape ``expected`` (a tensorwise
    0-d one may be (1,))."""
    _check_types(**{name: t})
    if t.dtype != recipe.scale_dtype:
        raise TypeError(f"{name} must be {str(recipe.scale_dtype).split('.')[-1]} for the "
                        f"{recipe} recipe (dequantization multipliers), got {t.dtype}")
    shape = tuple(t.shape)
    ok = shape == expected or (recipe is Recipe.TENSORWISE and expected == () and shape == (1,))
    if not ok:
        raise ValueError(f"{name} must have shape {expected} for the {recipe} recipe ({what}), "
                         f"got {shape}")


def check_scaled_args(a, b, scale_a, recipe_a, scale_b, recipe_b, offs, out_dtype=None, *,
                      a_index=None, swiglu: bool = False) -> Pair:
    """Validate a scaled grouped GEMM call; returns its recipes, parsed, as a :class:`Pair`.

    ``a`` (M, K) e4m3; ``b`` (E, K, N) e4m3 (``swiglu``: ``gate_up`` (E, 2I, K)); ``offs``
    int32 (E,); ``scale_a`` / ``scale_b`` fp32 of the shapes their recipes give for
    ``a`` (M rows: the rows of ``a``, before any ``a_index`` gather) and for the
    weights as stored, (E, N, K); ``a_index`` int32 (M',).  Strides are free (the
    fast layouts are documented on the op).  Errors name the argument first.
    """
    b_name = "gate_up" if swiglu else "b"
    _check_types(a=a, **{b_name: b}, scale_a=scale_a, scale_b=scale_b, offs=offs)
    pair = Pair.of(Recipe.parse(recipe_a, "scale_recipe_a"),
                   Recipe.parse(recipe_b, "scale_recipe_b"))
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
    k_block = pair.a.format.block[1]
    if k_block is not None and k % k_block:
        raise ValueError(f"a: K = {k} must be a multiple of {k_block} for the {pair} recipes")
    check_scale("scale_a", scale_a, pair.a.scale_shape((m, k)), pair.a, f"a is {tuple(a.shape)}")
    check_scale("scale_b", scale_b, pair.b.scale_shape((num_experts, n, k)), pair.b,
                f"the weights are (E, N, K) = {(num_experts, n, k)}")
    if a_index is not None:
        check_a_index(a_index, device)  # grouped_gemm's rules
    return pair


_READY_PAIRS: dict = {}  # (scale_recipe_a, scale_recipe_b) as a call spelled them -> Pair


def scaled_call_ready(a, b, scale_a, recipe_a, scale_b, recipe_b, offs, out_dtype=None, *,
                      a_index=None, swiglu: bool = False) -> Pair | None:
    """The call's :class:`Pair` where :func:`check_scaled_args` would pass it, judged
    from metadata alone for the recipe spellings it has passed before; None otherwise
    (then the full check runs and names what is wrong).  The FP8 ops' hot path: a
    decode call validated in ~10 us of Python on the CPU machine takes ~2 us here
    (bench/notes/2026-12-06-fp8-decode-floor.md).  Never True where the full check
    raises: pinned against it by ``tests/test_fp8_ops.py``."""
    try:
        pair = _READY_PAIRS.get((recipe_a, recipe_b))
    except TypeError:  # an unhashable spelling: the full check says what it is
        return None
    if pair is None:
        return None
    scale_a_type, scale_b_type, k_block = _pair_facts(pair)
    if (a.dtype is not E4M3 or b.dtype is not E4M3 or offs.dtype is not torch.int32
            or scale_a.dtype is not scale_a_type or scale_b.dtype is not scale_b_type
            or not (out_dtype is None or out_dtype in OUT_DTYPES)):
        return None
    shape_a, shape_b, shape_o = a.shape, b.shape, offs.shape
    if len(shape_a) != 2 or len(shape_b) != 3 or len(shape_o) != 1:
        return None
    m, k = shape_a
    num_experts, n, k_b = shape_b if swiglu else (shape_b[0], shape_b[2], shape_b[1])
    if (k_b != k or shape_o[0] != num_experts or m > MAX_ROWS or (swiglu and n % 2)
            or (num_experts > 1 and offs.stride(0) != 1)
            or (k_block is not None and k % k_block)
            or (scale_a.shape, scale_b.shape) != _scale_shapes(pair, m, k, num_experts, n)):
        return None
    device = a.get_device()
    if not (b.get_device() == scale_a.get_device() == scale_b.get_device()
            == offs.get_device() == device):
        return None
    if a_index is not None:  # grouped_gemm's rules (ts_moe.checks)
        index = a_index.shape
        if (a_index.dtype is not torch.int32 or len(index) != 1 or index[0] > MAX_ROWS
                or a_index.get_device() != device):
            return None
    return pair


@functools.cache
def _pair_facts(pair: Pair) -> tuple:
    """(scale_a's dtype, scale_b's dtype, the K block of a's scales or None)."""
    return pair.a.scale_dtype, pair.b.scale_dtype, pair.a.format.block[1]


@functools.lru_cache(maxsize=4096)
def _scale_shapes(pair: Pair, m: int, k: int, num_experts: int, n: int) -> tuple:
    return pair.a.scale_shape((m, k)), pair.b.scale_shape((num_experts, n, k))


def remember_ready(recipe_a, recipe_b, pair: Pair) -> None:
    """After a full check passed: calls spelling the recipes so may take the hot path."""
    try:
        _READY_PAIRS.setdefault((recipe_a, recipe_b), pair)
    except TypeError:
        pass


def check_quantize_args(x, recipe) -> Recipe:
    """Validate a :func:`ts_moe.quantize_fp8` call; returns the recipe, parsed."""
    _check_types(x=x)
    recipe = Recipe.parse(recipe, "recipe")
    if x.dtype not in QUANTIZE_DTYPES:
        raise TypeError(f"x must be bfloat16, float16, float32 or float64, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims (..., rows, columns), got shape "
                         f"{tuple(x.shape)}")
    return recipe
