"""The experts a layer runs, as one value: :class:`ExpertWeights` (bf16, fp16 or fp32
stacks; float64 runs the references) or :class:`Fp8ExpertWeights` (e4m3 stacks with
their scales and recipe).  The layer's forward (:mod:`ts_moe.block`) is written once
over it: it checks the value against the tokens, then calls its two GEMMs in slot
order, :meth:`~ExpertWeights.gate_up` (GEMM 1 and the SwiGLU) and
:meth:`~ExpertWeights.down` (GEMM 2).  :func:`expert_weights` is the one place a call's
tensors become the one or the other; :mod:`ts_moe.decode_graphs` keys a graph on the
value's :attr:`~ExpertWeights.tensors` (read in place) and :attr:`~ExpertWeights.kind`.

Layouts are transformers 5's: ``gate_up_proj`` (E, 2I, H) with the gate rows first,
``down_proj`` (E, H, I).  FP8 scales are dequantization multipliers of the weights as
stored, of one weight recipe each (:class:`ts_moe.fp8.recipes.Recipe`):

- ``BLOCKWISE_128X128``: (E, ceil(N/128), ceil(K/128)) (DeepSeek-V3, Qwen3 ``-FP8``:
  the stacked ``weight_scale_inv``); activations are then quantized per token per 128
  channels, so H and I must be multiples of 128;
- ``ROWWISE``: (E, N), one per output channel (llm-compressor FP8-dynamic);
- ``TENSORWISE``: (E,), one per expert (AutoFP8 Mixtral), served as per-channel scales
  (the same values) with per-token activations.

The FP8 experts' GEMMs::

    x_fp8, sx = quantize_fp8(x, act)             (T, H): the token rows once
    h = scaled_grouped_gemm_swiglu(x_fp8, gate_up, sx, ..., a_index=token)
                                                 (T*k, I) in x's dtype
    h_fp8, sh = quantize_fp8(h, act)             the SwiGLU output, for the down GEMM
    y = scaled_grouped_gemm(h_fp8, down^T, sh, ...)

``act`` is ``blockwise_1x128`` for blockwise weights, else ``rowwise``
(:attr:`Recipe.activation`): dynamic activation scales always (a checkpoint's static
``input_scale`` is not used: per token is at least as accurate).  No backward (FP8
training is not supported).
"""

import torch

from .checks import DTYPES
from .fp8.recipes import BLOCK, E4M3, WEIGHT_RECIPES, Recipe
from .ops.quantize import quantize_fp8
from .ops.scaled import scaled_grouped_gemm, scaled_grouped_gemm_swiglu
from .ops import grouped_gemm, grouped_gemm_swiglu
from .reference import SlotOrder, acc_dtype, swiglu

SIZE_MULTIPLE = 8  # 16-byte rows of the bf16 activations the layer permutes
FP8_SIZE_MULTIPLE = 16  # 16-byte e4m3 rows
FP8_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_tensor(name, t, rank):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D, got shape {tuple(t.shape)}")


def check_layer_sizes(**sizes) -> None:
    """H and I of a layer: positive multiples of 8, named in the error."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
        if value % SIZE_MULTIPLE:
            raise ValueError(
                f"{name} = {value} must be a multiple of {SIZE_MULTIPLE} (the grouped GEMMs "
                f"read 16-byte rows of the layer's activations)")


def _stacks_match(x, gate_up_proj, down_proj, x_name) -> tuple[int, int, int]:
    """(E, H, I) of 3-D stacks (E, 2I, H) and (E, H, I) for x (T, H), on x's device."""
    check_tensor("gate_up_proj", gate_up_proj, 3)
    check_tensor("down_proj", down_proj, 3)
    num_experts, two_inter, hidden = gate_up_proj.shape
    if hidden != x.shape[-1] or two_inter % 2:
        raise ValueError(
            f"gate_up_proj must be (E, 2I, H) with H = {x.shape[-1]} ({x_name}'s last dim), "
            f"got {tuple(gate_up_proj.shape)}")
    return num_experts, hidden, two_inter // 2


def _check_down(down_proj, num_experts, hidden, inter, gate_up_proj) -> None:
    if tuple(down_proj.shape) != (num_experts, hidden, inter):
        raise ValueError(
            f"down_proj must be (E, H, I) = {(num_experts, hidden, inter)} to match "
            f"gate_up_proj {tuple(gate_up_proj.shape)}, got {tuple(down_proj.shape)}")


class ExpertWeights:
    """bf16/fp16/fp32 expert stacks (module docstring): the layer's GEMMs are
    ``ts_moe.grouped_gemm_swiglu`` and ``ts_moe.grouped_gemm``, which train."""

    __slots__ = ("gate_up_proj", "down_proj")
    kind = None  # what a decode graph keys on besides the tensors

    def __init__(self, gate_up_proj, down_proj):
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj

    @property
    def tensors(self) -> tuple:
        """The tensors the GEMMs read, in place (a decode graph keys on their addresses)."""
        return self.gate_up_proj, self.down_proj

    @property
    def num_experts(self) -> int:
        """E, or 0 where ``gate_up_proj`` is no stack (the forward's check says so)."""
        g = self.gate_up_proj
        return g.shape[0] if isinstance(g, torch.Tensor) and g.dim() else 0

    @property
    def scale_recipe(self):
        """The weights' recipes (gate_up's, down's); None: no scales."""
        return None

    def parameters(self) -> dict:
        """The module parameters that hold the experts, by name."""
        return {"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj}

    def input_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype tokens of ``dtype`` are given to the experts in: the weights'."""
        return self.gate_up_proj.dtype

    def check(self, x: torch.Tensor, x_name: str) -> None:
        """Shapes (E, 2I, H) and (E, H, I) for x (T, H); one float dtype and device."""
        if x.dtype not in DTYPES:
            raise TypeError(f"{x_name} must be bfloat16, float16, float32 or float64, "
                            f"got {x.dtype}")
        num_experts, hidden, inter = _stacks_match(x, self.gate_up_proj, self.down_proj, x_name)
        check_layer_sizes(hidden_size=hidden, intermediate_size=inter)
        _check_down(self.down_proj, num_experts, hidden, inter, self.gate_up_proj)
        for name, t in (("gate_up_proj", self.gate_up_proj), ("down_proj", self.down_proj)):
            if t.dtype != x.dtype:
                raise TypeError(f"{name} must have {x_name}'s dtype {x.dtype}, got {t.dtype}")
            if t.device != x.device:
                raise ValueError(f"{name} is on {t.device} but {x_name} is on {x.device}")

    def gate_up(self, x: torch.Tensor, slots: SlotOrder, fused: bool) -> torch.Tensor:
        """GEMM 1 and the SwiGLU: (T*k, I) in x's dtype, the token rows gathered by the
        GEMM (``fused=False``: the GEMM to fp32, fp64 for fp64, and the activation apart,
        one rounding)."""
        if fused:
            return grouped_gemm_swiglu(x, self.gate_up_proj, slots.offs,
                                       a_index=slots.token_index)
        return swiglu(grouped_gemm(x, self.gate_up_proj.transpose(-2, -1), slots.offs,
                                   acc_dtype(x.dtype), a_index=slots.token_index), x.dtype)

    def down(self, h: torch.Tensor, slots: SlotOrder) -> torch.Tensor:
        """GEMM 2: (T*k, H).  The kernel ahead (gate_up's) wrote h only: the down weights
        may start streaming under its tail (eager; a compiled graph orders kernels
        itself)."""
        return grouped_gemm(h, self.down_proj.transpose(-2, -1), slots.offs,
                            prefetch_weights=not torch.compiler.is_compiling())


class Fp8ExpertWeights(ExpertWeights):
    """e4m3 expert stacks with their fp32 scales and the weights' recipes (module
    docstring); ``recipes`` parsed: (gate_up's, down's) weight :class:`Recipe`."""

    __slots__ = ("gate_up_scale", "down_scale", "recipes")

    def __init__(self, gate_up_proj, down_proj, gate_up_scale, down_scale,
                 recipes: tuple[Recipe, Recipe]):
        super().__init__(gate_up_proj, down_proj)
        self.gate_up_scale, self.down_scale, self.recipes = gate_up_scale, down_scale, recipes

    @property
    def kind(self):
        return self.recipes

    @property
    def tensors(self) -> tuple:
        return self.gate_up_proj, self.gate_up_scale, self.down_proj, self.down_scale

    @property
    def scale_recipe(self):
        return self.recipes

    def parameters(self) -> dict:
        return {"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj,
                "gate_up_proj_scale": self.gate_up_scale, "down_proj_scale": self.down_scale}

    def input_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype  # quantized per token, whatever its float dtype

    def check(self, x: torch.Tensor, x_name: str) -> None:
        """e4m3 stacks (E, 2I, H) and (E, H, I) for x (T, H) of bf16, fp16 or fp32, H and I
        multiples of 16 (of 128 with blockwise scales), each scale of its recipe's shape."""
        if x.dtype not in FP8_X_DTYPES:
            raise TypeError(f"{x_name} must be bfloat16, float16 or float32 with FP8 experts, "
                            f"got {x.dtype}")
        for name, t in (("gate_up_proj", self.gate_up_proj), ("down_proj", self.down_proj)):
            if isinstance(t, torch.Tensor) and t.dtype != E4M3:
                raise TypeError(f"{name} must be torch.float8_e4m3fn with its scales given, "
                                f"got {t.dtype}")
        num_experts, hidden, inter = _stacks_match(x, self.gate_up_proj, self.down_proj, x_name)
        for name, t in (("gate_up_proj", self.gate_up_proj), ("down_proj", self.down_proj)):
            if t.device != x.device:
                raise ValueError(f"{name} is on {t.device} but {x_name} is on {x.device}")
        _check_down(self.down_proj, num_experts, hidden, inter, self.gate_up_proj)
        for name, size in (("hidden_size", hidden), ("intermediate_size", inter)):
            if size % FP8_SIZE_MULTIPLE:
                raise ValueError(f"{name} = {size} must be a multiple of {FP8_SIZE_MULTIPLE} "
                                 f"(16-byte e4m3 rows)")
        for name, scale, weight, recipe in (
                ("gate_up_scale", self.gate_up_scale, self.gate_up_proj, self.recipes[0]),
                ("down_scale", self.down_scale, self.down_proj, self.recipes[1])):
            _check_scale(name, scale, weight, recipe)
        if Recipe.BLOCKWISE_128X128 in self.recipes:
            for name, size in (("hidden_size", hidden), ("intermediate_size", inter)):
                if size % BLOCK:
                    raise ValueError(f"{name} = {size} must be a multiple of {BLOCK} with "
                                     f"blockwise scales (activations are quantized per 128 "
                                     f"channels)")

    def gate_up(self, x: torch.Tensor, slots: SlotOrder, fused: bool) -> torch.Tensor:
        scale, recipe = _as_used(self.gate_up_scale, self.recipes[0], self.gate_up_proj)
        act = recipe.activation
        xq, sx = quantize_fp8(x, act)
        if fused:
            return scaled_grouped_gemm_swiglu(xq, self.gate_up_proj, sx, act, scale, recipe,
                                              slots.offs, out_dtype=x.dtype,
                                              a_index=slots.token_index)
        return swiglu(scaled_grouped_gemm(xq, self.gate_up_proj.transpose(-2, -1), sx, act,
                                          scale, recipe, slots.offs, out_dtype=torch.float32,
                                          a_index=slots.token_index), x.dtype)

    def down(self, h: torch.Tensor, slots: SlotOrder) -> torch.Tensor:
        scale, recipe = _as_used(self.down_scale, self.recipes[1], self.down_proj)
        act = recipe.activation
        hq, sh = quantize_fp8(h, act)
        return scaled_grouped_gemm(hq, self.down_proj.transpose(-2, -1), sh, act, scale, recipe,
                                   slots.offs, out_dtype=h.dtype)


def _check_scale(name: str, scale, weight: torch.Tensor, recipe: Recipe) -> None:
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (the fp32 scales of the e4m3 "
                        f"weights), got {type(scale).__name__}")
    expected = recipe.scale_shape(weight.shape)
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(scale.shape)}; for weights of shape "
                         f"{tuple(weight.shape)} and the {recipe} recipe it must be {expected}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scale.dtype}")
    if scale.device != weight.device:
        raise ValueError(f"{name} is on {scale.device}, its weights on {weight.device}")


def _as_used(scale: torch.Tensor, recipe: Recipe, weight: torch.Tensor):
    """(scale, recipe) the GEMM takes: a per-expert scale becomes per channel (a view)."""
    if recipe is Recipe.TENSORWISE:
        return scale[:, None].expand(weight.shape[:2]), Recipe.ROWWISE
    return scale, recipe


def parse_scale_recipe(value) -> tuple[Recipe, Recipe]:
    """``scale_recipe``: one weight recipe for both stacks, or a (gate_up's, down's) pair,
    each a ``torch.nn.functional.ScalingType`` member, a :class:`Recipe` or either's
    name; parsed, or a TypeError / ValueError naming ``scale_recipe``."""
    if value is None:
        raise TypeError("scale_recipe must name the FP8 weights' recipe (TensorWise, RowWise "
                        "or BlockWise128x128, or a (gate_up, down) pair of them), got None")
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2:
        raise ValueError(f"scale_recipe must be one recipe or a (gate_up, down) pair, got "
                         f"{len(pair)} of them")
    recipes = tuple(Recipe.parse(r, "scale_recipe") for r in pair)
    for recipe in recipes:
        if recipe not in WEIGHT_RECIPES:
            what = ("an activation recipe" if recipe is Recipe.BLOCKWISE_1X128 else
                    "not a weight recipe of the layer (the scaled ops take it)")
            raise ValueError(f"scale_recipe {recipe!s} is {what}; the weights' recipes: "
                             f"{', '.join(WEIGHT_RECIPES)}")
    return recipes


def expert_weights(gate_up_proj, down_proj, gate_up_scale=None, down_scale=None,
                   scale_recipe=None) -> ExpertWeights:
    """The experts of a call: FP8 where scales or a recipe are given or the weights are
    e4m3 (then all three are needed; the recipe parsed here), bf16/fp16/fp32 otherwise.
    Nothing else is checked here: the forward checks the value against its tokens."""
    if (gate_up_scale is None and down_scale is None and scale_recipe is None
            and not (isinstance(gate_up_proj, torch.Tensor) and gate_up_proj.dtype == E4M3)):
        return ExpertWeights(gate_up_proj, down_proj)
    return Fp8ExpertWeights(gate_up_proj, down_proj, gate_up_scale, down_scale,
                            parse_scale_recipe(scale_recipe))
