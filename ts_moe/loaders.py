"""Load the experts of a Hugging Face MoE checkpoint into the layer's layouts, bf16 or FP8,
lazily and per layer, through one plan (:func:`_load`): the checkpoint's naming, the
layers asked for, each layer's expert count from its router and the experts asked for,
every key checked against the index and every shape and dtype against the headers before
any data is read, each shard opened once, through the checked reads of
:mod:`ts_moe.checkpoint`.  The formats differ only in the tensors read per expert
(:class:`Bf16Format`: the weight; :class:`Fp8Format`: the e4m3 weight and its scale).

Namings, per layer ``L`` and expert ``e``:

* ``block_sparse_moe`` (Mixtral; transformers 4, and what transformers 5 still writes
  on save): the router ``model.layers.{L}.block_sparse_moe.gate.weight`` (E, H) and per
  expert ``...experts.{e}.w1`` (gate, (I, H)), ``w3`` (up, (I, H)), ``w2`` (down,
  (H, I));
* ``mlp`` (Qwen3-MoE, DeepSeek-V3): ``model.layers.{L}.mlp.gate.weight`` and per expert
  ``...mlp.experts.{e}.gate_proj``, ``up_proj``, ``down_proj``;
* ``mlp`` stacked (transformers 5 in memory; bf16): ``...mlp.experts.gate_up_proj``
  (E, 2I, H) and ``...mlp.experts.down_proj`` (E, H, I).

FP8 releases hold per expert linear an e4m3 ``weight`` and its scale, as config.json's
``quantization_config`` says (:func:`fp8_scheme`):

- ``{"quant_method": "fp8", "weight_block_size": [128, 128]}``: ``weight_scale_inv``
  (ceil(N/128), ceil(K/128)) per 128x128 block (DeepSeek-V3, Qwen ``-FP8``);
- ``compressed-tensors`` with float weights of strategy ``channel``: ``weight_scale``
  (N, 1) (llm-compressor FP8-dynamic); strategy ``tensor``: a one-element one;
- ``{"quant_method": "fp8"}`` without a block size: ``weight_scale`` per tensor (AutoFP8).

Scales are dequantization multipliers in every format (``weight_scale_inv`` is named
for the quantizer's view; the checkpoints multiply by it).  Static activation scales
(``input_scale``) are not read: the layer quantizes activations per token.  The
experts of DeepSeek-V3 are loaded as any others; its router (sigmoid scores, a
score bias, expert groups) is not the layer's softmax top-k, so serve its experts
through :func:`ts_moe.experts_forward` with its own routing.
"""

import re
from contextlib import ExitStack
from typing import NamedTuple

import torch

from .checkpoint import (INDEX_NUMBER, check_experts_range, config_intermediate, expert_count,
                         local_checkpoint, read_config, resolve_device, selected_layers,
                         shard_opener, weight_index)
from .fp8.recipes import BLOCK, NamedEnum, Recipe

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_LAYER_KEY = re.compile(rf"model\.layers\.{INDEX_NUMBER}\.(block_sparse_moe|mlp)\.(gate|experts)\.")
_EXPERT_KEY = re.compile(
    rf"model\.layers\.{INDEX_NUMBER}\.(block_sparse_moe|mlp)\.experts\.{INDEX_NUMBER}\.")
ROLES = {"block_sparse_moe": ("w1", "w3", "w2"), "mlp": ("gate_proj", "up_proj", "down_proj")}


class LayerPlan(NamedTuple):
    """The keys of one MoE layer: its router, then the experts asked for, stacked
    (``(gate_up_proj, down_proj)``) or per expert (``{(role, e): keys}``, role
    ``gate``, ``up`` or ``down``, the keys the format reads per linear)."""

    router: str
    experts: range
    stacked: tuple[str, str] | None
    per_expert: dict

    def keys(self) -> list[str]:
        return [self.router, *(self.stacked or ()),
                *(k for keys in self.per_expert.values() for k in keys)]

    def first(self, role: str) -> str:
        """The first (weight) key of ``role`` of the first expert asked for."""
        return self.per_expert[(role, self.experts.start)][0]


def _layer_plan(layer: int, block: str, stacked: bool, fmt, start: int, stop: int,
                index: dict, index_file) -> LayerPlan:
    """The plan of layer ``layer``'s experts ``start .. stop - 1``, each key checked
    against the index as it is made: a KeyError naming the first missing one costs
    no more than the keys before it (not a plan of every expert first)."""
    prefix = f"model.layers.{layer}.{block}."

    def present(*keys: str) -> tuple:
        for key in keys:
            if key not in index:
                raise KeyError(f"key {key!r} is missing from {index_file}")
        return keys

    if stacked:
        return LayerPlan(prefix + "gate.weight", range(start, stop),
                         present(prefix + "experts.gate_up_proj", prefix + "experts.down_proj"),
                         {})
    per_expert = {}
    for e in range(start, stop):
        for role, name in zip(("gate", "up", "down"), ROLES[block]):
            per_expert[(role, e)] = present(*fmt.expert_keys(f"{prefix}experts.{e}.{name}."))
    return LayerPlan(prefix + "gate.weight", range(start, stop), None, per_expert)


def _load(path, layers, device, experts, format_of, caller: str) -> dict:
    """The plan, for every format (module docstring); ``format_of(config, config_file)``
    the checkpoint's format."""
    device = resolve_device(device)
    check_experts_range(experts)
    ckpt = local_checkpoint(path, caller)
    path, config_file = ckpt.path, ckpt.path / "config.json"
    config = read_config(ckpt)
    fmt = format_of(config, config_file)
    index, index_file = weight_index(ckpt)
    present: dict[int, str] = {}
    expert_keys: dict[int, dict[int, str]] = {}  # per layer: expert index -> a key naming it
    for key in index:
        if m := _LAYER_KEY.match(key):
            present.setdefault(int(m.group(1)), m.group(2))
        if m := _EXPERT_KEY.match(key):
            expert_keys.setdefault(int(m.group(1)), {}).setdefault(int(m.group(3)), key)
    layers = selected_layers(layers, present, path)

    with ExitStack() as stack:
        handle = shard_opener(ckpt, index, index_file, device, stack)
        plans = {}
        for layer in layers:  # E from the router's header, before any per-expert key
            block = present[layer]
            prefix = f"model.layers.{layer}.{block}."
            stacked = fmt.stacks and block == "mlp" and layer not in expert_keys
            router = prefix + "gate.weight"
            count = expert_count(
                router, tuple(handle(router).get_slice(router).get_shape()), path / index[router],
                config, config_file, index_file, None if stacked else expert_keys.get(layer, {}),
                lambda e: f"{prefix}experts.{e}.{ROLES[block][0]}.weight")
            if experts is not None and experts.stop > count:
                raise ValueError(f"experts {experts!r} is past the checkpoint's {count} experts")
            chosen = experts or range(count)
            plans[layer] = _layer_plan(layer, block, stacked, fmt, chosen.start, chosen.stop,
                                       index, index_file)
        keys = [key for plan in plans.values() for key in plan.keys()]
        headers = {key: handle(key).get_slice(key) for key in keys}
        shapes = {key: tuple(h.get_shape()) for key, h in headers.items()}
        dtypes = {key: h.get_dtype() for key, h in headers.items()}
        for plan in plans.values():
            fmt.check(plan, shapes, dtypes, config, config_file)
        return {layer: fmt.read(plan, handle, shapes, device) for layer, plan in plans.items()}


def _read(handle, key: str) -> torch.Tensor:
    return handle(key).get_tensor(key)


# ------------------------------------------------------------------ bf16
class Bf16Format:
    """Experts in the router's float dtype (bf16, fp16, fp32), read as they are."""

    stacks = True  # takes the stacked naming too

    @staticmethod
    def expert_keys(base: str) -> tuple[str]:
        return (base + "weight",)

    @staticmethod
    def check(plan: LayerPlan, shapes: dict, dtypes: dict, config: dict, config_file) -> None:
        """Every shape from E (the router's), H (config.json's, else the router's) and I
        (config.json's, else the first gate's); one float dtype, the router's."""
        num_experts, router_hidden = shapes[plan.router]
        hidden = config.get("hidden_size", router_hidden)
        inter = config_intermediate(config)
        if inter is None:  # from gate_up_proj (E, 2I, H) or a gate (I, H); a wrong rank fails below
            shape = shapes[plan.stacked[0] if plan.stacked else plan.first("gate")]
            inter = (shape[-2] // 2 if plan.stacked else shape[0]) if len(shape) >= 2 else 0
        expected = {plan.router: (num_experts, hidden)}
        if plan.stacked:
            expected[plan.stacked[0]] = (num_experts, 2 * inter, hidden)
            expected[plan.stacked[1]] = (num_experts, hidden, inter)
        for (role, _), (key,) in plan.per_expert.items():
            expected[key] = (hidden, inter) if role == "down" else (inter, hidden)
        router_dtype = dtypes[plan.router]
        for key, shape in expected.items():
            dtype = dtypes[key]
            if dtype not in _DTYPES:
                raise ValueError(f"{key}: dtype {dtype} is not one of {sorted(_DTYPES)}")
            if dtype != router_dtype:
                raise ValueError(f"{key}: dtype {dtype} differs from the router's {router_dtype}")
            if shapes[key] != shape:
                raise ValueError(f"{key}: shape {shapes[key]}, expected {shape}")

    @staticmethod
    def read(plan: LayerPlan, handle, shapes: dict, device) -> dict:
        router = _read(handle, plan.router)
        experts = plan.experts
        if plan.stacked:  # read the experts' slab only
            return {"router": router, **{
                name: handle(key).get_slice(key)[experts.start:experts.stop].to(device)
                for name, key in zip(("gate_up_proj", "down_proj"), plan.stacked)}}
        hidden, inter = router.shape[1], shapes[plan.first("gate")][0]
        gate_up = torch.empty(len(experts), 2 * inter, hidden, dtype=router.dtype, device=device)
        down = torch.empty(len(experts), hidden, inter, dtype=router.dtype, device=device)
        for i, e in enumerate(experts):
            for role, dst in (("gate", gate_up[i, :inter]), ("up", gate_up[i, inter:]),
                              ("down", down[i])):
                dst.copy_(_read(handle, plan.per_expert[(role, e)][0]))
        return {"router": router, "gate_up_proj": gate_up, "down_proj": down}


# ------------------------------------------------------------------- FP8
class Fp8Scheme(NamedEnum):
    """How a release stores its experts' FP8 scales (module docstring)."""

    BLOCKWISE = "blockwise"
    CHANNEL = "channel"
    TENSOR = "tensor"

    @property
    def recipe(self) -> Recipe:
        """The recipe of each linear's scale as stored."""
        return _STORED[self]

    @property
    def scale_key(self) -> str:
        return "weight_scale_inv" if self is Fp8Scheme.BLOCKWISE else "weight_scale"


_STORED = {Fp8Scheme.BLOCKWISE: Recipe.BLOCKWISE_128X128, Fp8Scheme.CHANNEL: Recipe.ROWWISE,
           Fp8Scheme.TENSOR: Recipe.TENSORWISE}
_FLOAT = {"BF16", "F16", "F32"}


def _field(source, name: str, value, want: str) -> ValueError:
    return ValueError(f"{source}: quantization_config{name} must be {want}, got {value!r}")


def fp8_scheme(config: dict, source="config.json") -> Fp8Scheme | None:
    """The FP8 weight scheme config.json declares, or None (no quantization_config).
    ValueError naming ``source`` (the file) and the field for a quantization ts_moe
    does not serve (another method, block size or format) or a field of the wrong type."""
    q = config.get("quantization_config")
    if q is None or q == {}:
        return None
    if not isinstance(q, dict):
        raise _field(source, "", q, "an object")
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"{source}: quantization_config.fmt {q['fmt']!r}: only e4m3 is "
                             f"served")
        block = q.get("weight_block_size")
        if block is None:
            return Fp8Scheme.TENSOR
        if not (isinstance(block, list) and len(block) == 2
                and all(type(b) is int for b in block)):
            raise _field(source, ".weight_block_size", block, "a list of two ints")
        if block != [BLOCK, BLOCK]:
            raise ValueError(f"{source}: quantization_config.weight_block_size {block}: only "
                             f"[{BLOCK}, {BLOCK}] is served")
        return Fp8Scheme.BLOCKWISE
    if method == "compressed-tensors":
        groups = q.get("config_groups", {})
        if not isinstance(groups, dict):
            raise _field(source, ".config_groups", groups, "an object of groups")
        for name, group in groups.items():
            if not isinstance(group, dict):
                raise _field(source, f".config_groups[{name!r}]", group, "an object")
            w = group.get("weights") or {}
            if not isinstance(w, dict):
                raise _field(source, f".config_groups[{name!r}].weights", w, "an object")
            if w.get("type") == "float" and type(w.get("num_bits")) is int and \
                    w["num_bits"] == 8 and w.get("strategy") in ("channel", "tensor"):
                return Fp8Scheme(w["strategy"])
        raise ValueError(f"{source}: quantization_config: compressed-tensors without 8-bit "
                         f"float weights of strategy channel or tensor is not served")
    raise ValueError(f"{source}: quantization_config.quant_method {method!r} is not an FP8 "
                     f"format ts_moe serves (fp8, compressed-tensors)")


class Fp8Format:
    """e4m3 experts with their scales of ``scheme``, stacked as the layer takes them:
    blockwise (E, 2I/128, H/128) and (E, H/128, I/128) (I a multiple of 128, so that
    gate and up blocks stack); per channel (E, 2I) and (E, H); per tensor, each linear's
    one scale spread over its channels (gate and up keep their own), the same shapes:
    the ``ROWWISE`` recipe."""

    stacks = False

    def __init__(self, scheme: Fp8Scheme):
        self.scheme = scheme

    def expert_keys(self, base: str) -> tuple[str, str]:
        return base + "weight", base + self.scheme.scale_key

    def _scale_shapes(self, n: int, k: int) -> tuple[tuple, ...]:
        if self.scheme is Fp8Scheme.BLOCKWISE:
            return ((-(-n // BLOCK), -(-k // BLOCK)),)
        if self.scheme is Fp8Scheme.CHANNEL:
            return ((n, 1), (n,))
        return ((), (1,))

    def check(self, plan: LayerPlan, shapes: dict, dtypes: dict, config: dict,
              config_file) -> None:
        router = plan.router
        if len(shapes[router]) != 2 or dtypes[router] not in _FLOAT:
            raise ValueError(f"{router}: expected a 2-D bf16/fp16/fp32 (E, H) router, got "
                             f"shape {shapes[router]} and dtype {dtypes[router]}")
        hidden = shapes[router][1]
        if config.get("hidden_size", hidden) != hidden:
            raise ValueError(f"{config_file}: hidden_size = {config['hidden_size']}, but the "
                             f"router {router} has shape {shapes[router]}")
        inter = config_intermediate(config)
        if inter is None:
            inter = shapes[plan.first("gate")][0]
        if self.scheme is Fp8Scheme.BLOCKWISE and inter % BLOCK:
            raise ValueError(f"intermediate size {inter}: blockwise gate and up scales stack "
                             f"into one gate_up scale only for a multiple of {BLOCK}")
        for (role, _), (weight, scale) in plan.per_expert.items():
            n, k = (hidden, inter) if role == "down" else (inter, hidden)
            if dtypes[weight] != "F8_E4M3" or shapes[weight] != (n, k):
                raise ValueError(f"{weight}: expected F8_E4M3 of shape {(n, k)}, got "
                                 f"{dtypes[weight]} of shape {shapes[weight]}")
            expected = self._scale_shapes(n, k)
            if dtypes[scale] not in _FLOAT or shapes[scale] not in expected:
                raise ValueError(f"{scale}: expected a float scale of shape "
                                 f"{' or '.join(map(str, expected))} ({self.scheme}), got "
                                 f"{dtypes[scale]} of shape {shapes[scale]}")

    def read(self, plan: LayerPlan, handle, shapes: dict, device) -> dict:
        router = _read(handle, plan.router)
        hidden, inter = router.shape[1], shapes[plan.first("gate")][0]
        n = len(plan.experts)
        e4m3 = torch.float8_e4m3fn
        gate_up = torch.empty(n, 2 * inter, hidden, dtype=e4m3, device=device)
        down = torch.empty(n, hidden, inter, dtype=e4m3, device=device)
        blockwise = self.scheme is Fp8Scheme.BLOCKWISE
        if blockwise:
            rows = -(-inter // BLOCK)
            gu_scale = torch.empty(n, 2 * rows, -(-hidden // BLOCK), device=device)
            down_scale = torch.empty(n, -(-hidden // BLOCK), rows, device=device)
        else:
            gu_scale = torch.empty(n, 2 * inter, device=device)
            down_scale = torch.empty(n, hidden, device=device)
        half = gu_scale.shape[1] // 2
        for i, e in enumerate(plan.experts):
            for role, w_dst, s_dst in (("gate", gate_up[i, :inter], gu_scale[i, :half]),
                                       ("up", gate_up[i, inter:], gu_scale[i, half:]),
                                       ("down", down[i], down_scale[i])):
                weight, scale = plan.per_expert[(role, e)]
                w_dst.copy_(_read(handle, weight))
                s = _read(handle, scale).float()
                s_dst.copy_(s if blockwise else s.reshape(-1).expand(s_dst.shape))
        return {"router": router, "gate_up_proj": gate_up, "gate_up_proj_scale": gu_scale,
                "down_proj": down, "down_proj_scale": down_scale,
                "scale_recipe": Recipe.BLOCKWISE_128X128 if blockwise else Recipe.ROWWISE}


def _bf16_format(config: dict, config_file) -> Bf16Format:
    return Bf16Format()


def _fp8_format(config: dict, config_file) -> Fp8Format:
    scheme = fp8_scheme(config, config_file)
    if scheme is None:
        raise ValueError(f"{config_file} has no quantization_config: not an FP8 checkpoint "
                         f"(bf16 Mixtral: ts_moe.load_mixtral_experts)")
    return Fp8Format(scheme)


# --------------------------------------------------------------- the public
def load_mixtral_experts(path, layers=None, device=None,
                         experts=None) -> dict[int, dict[str, torch.Tensor]]:
    """Read the MoE weights of a bf16/fp16/fp32 checkpoint directory (Mixtral's namings,
    or Qwen3-MoE's) into the fused layouts.

    path: a local checkpoint directory (``model.safetensors`` or a sharded
    index), not a Hub id: download one first, e.g. with
    ``huggingface_hub.snapshot_download("mistralai/Mixtral-8x7B-v0.1",
    allow_patterns=["*.safetensors", "*.json"], local_dir="Mixtral-8x7B")``
    or ``hf download mistralai/Mixtral-8x7B-v0.1 --include "*.safetensors"
    "*.json" --local-dir Mixtral-8x7B``;
    layers: a layer index (an int, or a NumPy integer), an iterable of them, or
    None for every MoE layer;
    device: where the tensors are created (each read into host memory, then
    copied there); None: CUDA when there is a GPU, else the CPU;
    experts: None for all, or a ``range`` of consecutive expert indices (an
    expert-parallel rank's share): only those experts' bytes are read, and
    ``gate_up_proj``/``down_proj`` hold only them (the router stays whole).

    Returns ``{layer: {"router": (E, H), "gate_up_proj": (E, 2I, H),
    "down_proj": (E, H, I)}}`` with the checkpoint's values and dtype: per expert,
    ``gate_up_proj[e]`` is the gate (``w1``) over the up projection (``w3``) and
    ``down_proj[e]`` the down one (``w2``); transformers-5 stacks are taken as
    they are.  Each needed shard is opened once, and only the requested
    layers' tensors are read; every shape and dtype is checked from the
    headers before any data is read.

    The expert count of a layer is its router's first dimension, read from
    the safetensors header before any per-expert key is made
    (:func:`ts_moe.checkpoint.expert_count`): config.json's expert count
    (``num_local_experts``, ``num_experts`` or ``n_routed_experts``: a positive
    int, like ``hidden_size`` and ``intermediate_size`` /
    ``moe_intermediate_size``) must equal it, and the expert indices of the
    index's keys must be exactly ``0 .. E-1``.  The index's shard names,
    config.json and the shards are opened only if they are regular files inside
    the directory (a Hugging Face cache snapshot's links into its repository's
    ``blobs`` included), each opened once and read through that descriptor
    (:class:`ts_moe.checkpoint._Checkpoint`); the JSON files are read no
    further than :data:`ts_moe.checkpoint.JSON_LIMIT` bytes.

    Raises ``ValueError`` for a device that does not exist here (before any
    file is read), ``FileNotFoundError`` without a checkpoint or a shard it
    names, ``KeyError`` naming a layer that is not in it or a missing key,
    ``ValueError`` naming a key with the wrong shape or dtype (not
    bf16/fp16/fp32, or not the router's), and ``ValueError`` naming the file
    and the field for a bad config.json size, an expert count that disagrees
    with the router, a JSON file that is not valid (or too large, or nested
    too deeply), a shard name that is not a regular file inside the
    directory (``../x``, an absolute path, a link out of it, a FIFO, a NUL
    byte), or a shard that is not a valid safetensors file or is cut short
    while it is read.
    """
    return _load(path, layers, device, experts, _bf16_format, "load_mixtral_experts")


def load_fp8_experts(path, layers=None, device=None,
                     experts=None) -> dict[int, dict[str, torch.Tensor]]:
    """Read the FP8 experts of a checkpoint directory into the layer's layouts.

    ``layers``, ``device``, ``experts``: as :func:`load_mixtral_experts`.  Returns
    ``{layer: {"router": (E, H), "gate_up_proj": (E, 2I, H) e4m3 (gate rows, then up),
    "gate_up_proj_scale", "down_proj": (E, H, I) e4m3, "down_proj_scale",
    "scale_recipe"}}``, ready for :meth:`ts_moe.MoE.from_weights` and
    :func:`ts_moe.experts_forward`; the scales and their recipe as
    :class:`Fp8Format` stacks them.  Checks and errors: as
    :func:`load_mixtral_experts` (every key, shape and dtype from the headers before
    any data is read; E the router's), and ValueError naming the file and the field
    for a config.json without an FP8 ``quantization_config`` ts_moe serves.
    """
    return _load(path, layers, device, experts, _fp8_format, "load_fp8_experts")


def pretrained_layer(path, layer: int, device=None) -> dict:
    """Layer ``layer`` of a checkpoint for :meth:`ts_moe.MoE.from_pretrained`: FP8 where
    config.json declares a quantization, bf16 otherwise.  Whether the layer reproduces
    the model's block is :mod:`ts_moe.pretrained`'s to say."""
    ckpt = local_checkpoint(path, "MoE.from_pretrained")
    fp8 = fp8_scheme(read_config(ckpt), ckpt.path / "config.json") is not None
    return (load_fp8_experts if fp8 else load_mixtral_experts)(path, layers=[layer],
                                                               device=device)[layer]
