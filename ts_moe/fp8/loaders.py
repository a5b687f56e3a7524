"""Load the experts of FP8 MoE checkpoints (Mixtral, Qwen3-MoE, DeepSeek-V3 namings) into
the FP8 layer's layouts, lazily and per layer, as :mod:`ts_moe.loaders` does for bf16.

What a release holds, per expert linear (``w1``/``w3``/``w2`` in Mixtral's naming,
``gate_proj``/``up_proj``/``down_proj`` in Qwen3-MoE's and DeepSeek-V3's): an e4m3
``weight`` and its scale, read with config.json's ``quantization_config``:

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
from pathlib import Path

import torch

from ..loaders import (INDEX_NUMBER, _weight_index, check_experts_range, config_intermediate,
                       expert_count, local_checkpoint, read_config, resolve_device,
                       selected_layers, shard_opener)
from .recipes import BLOCK, Recipe

_EXPERT = re.compile(rf"model\.layers\.{INDEX_NUMBER}\.(block_sparse_moe|mlp)\.experts\."
                     rf"{INDEX_NUMBER}\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_ROLES = {"block_sparse_moe": {"gate": "w1", "up": "w3", "down": "w2"},
          "mlp": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}}
_FLOAT = {"BF16", "F16", "F32"}


def _field(source, name: str, value, want: str) -> ValueError:
    return ValueError(f"{source}: quantization_config{name} must be {want}, got {value!r}")


def fp8_scheme(config: dict, source="config.json") -> str | None:
    """The FP8 weight scheme config.json declares: ``blockwise``, ``channel``, ``tensor``,
    or None (no quantization_config).  ValueError naming ``source`` (the file) and the
    field for a quantization ts_moe does not serve (another method, block size or
    format) or a field of the wrong type."""
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
            return "tensor"
        if not (isinstance(block, list) and len(block) == 2
                and all(type(b) is int for b in block)):
            raise _field(source, ".weight_block_size", block, "a list of two ints")
        if block != [BLOCK, BLOCK]:
            raise ValueError(f"{source}: quantization_config.weight_block_size {block}: only "
                             f"[{BLOCK}, {BLOCK}] is served")
        return "blockwise"
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
                return w["strategy"]
        raise ValueError(f"{source}: quantization_config: compressed-tensors without 8-bit "
                         f"float weights of strategy channel or tensor is not served")
    raise ValueError(f"{source}: quantization_config.quant_method {method!r} is not an FP8 "
                     f"format ts_moe serves (fp8, compressed-tensors)")


def _expected_scale(scheme: str, n: int, k: int) -> tuple[tuple, ...]:
    if scheme == "blockwise":
        return ((-(-n // BLOCK), -(-k // BLOCK)),)
    if scheme == "channel":
        return ((n, 1), (n,))
    return ((), (1,))


def _plan(layer: int, block: str, scheme: str, experts: range) -> dict:
    """Checkpoint keys of one layer: router, and per expert and role (weight, scale)."""
    prefix = f"model.layers.{layer}.{block}."
    scale = "weight_scale_inv" if scheme == "blockwise" else "weight_scale"
    plan = {"router": prefix + "gate.weight"}
    for e in experts:
        for role, name in _ROLES[block].items():
            base = f"{prefix}experts.{e}.{name}."
            plan[(role, e)] = (base + "weight", base + scale)
    return plan


def load_fp8_experts(path, layers=None, device=None,
                     experts=None) -> dict[int, dict[str, torch.Tensor]]:
    """Read the FP8 experts of a checkpoint directory into the FP8 layer's layouts.

    ``layers``, ``device``, ``experts``: as :func:`ts_moe.load_mixtral_experts` (a
    local directory; None: every MoE layer; None: CUDA when there is one, else the
    CPU; a ``range`` of experts for an expert-parallel rank).  Returns ``{layer:
    {"router": (E, H), "gate_up_proj": (E, 2I, H) e4m3 (gate rows, then up),
    "gate_up_proj_scale", "down_proj": (E, H, I) e4m3, "down_proj_scale",
    "scale_recipe"}}``,
    ready for :meth:`ts_moe.MoE.from_weights` and :func:`ts_moe.experts_forward`.
    Scales, fp32: blockwise (E, 2I/128, H/128) and (E, H/128, I/128) (I a multiple of
    128, so that gate and up blocks stack); per channel (E, 2I) and (E, H); per
    tensor, each linear's one scale spread over its channels (gate and up keep their
    own), the same shapes.  E is the router's first dimension, read from its header
    before any per-expert key is made; config.json's expert count and the expert
    indices of the keys must agree with it (:func:`ts_moe.loaders.expert_count`).
    Every key, shape and dtype is checked from the headers before any data is read;
    each shard is opened once, only the layers asked for are read.  Errors: as
    :func:`ts_moe.load_mixtral_experts`, and ValueError naming the file and the
    field for a config.json without an FP8 ``quantization_config`` ts_moe serves.
    """
    device = resolve_device(device)
    ckpt = local_checkpoint(path, "load_fp8_experts")
    path, config_file = ckpt.path, ckpt.path / "config.json"
    config = read_config(ckpt)
    scheme = fp8_scheme(config, config_file)
    if scheme is None:
        raise ValueError(f"{config_file} has no quantization_config: not an FP8 "
                         f"checkpoint (bf16 Mixtral: ts_moe.load_mixtral_experts)")
    check_experts_range(experts)
    index, index_file = _weight_index(ckpt)
    present: dict[int, tuple[str, dict[int, str]]] = {}  # layer: (block, expert -> a key)
    for key in index:
        if m := _EXPERT.match(key):
            present.setdefault(int(m.group(1)), (m.group(2), {}))[1].setdefault(
                int(m.group(3)), key)
    layers = selected_layers(layers, present, path)

    with ExitStack() as stack:
        handle = shard_opener(ckpt, index, index_file, device, stack)
        plans = {}
        for layer in layers:  # E from the router's header, before any per-expert key
            block, found = present[layer]
            prefix = f"model.layers.{layer}.{block}."
            router = prefix + "gate.weight"
            count = expert_count(
                router, tuple(handle(router).get_slice(router).get_shape()), path / index[router],
                config, config_file, index_file, found,
                lambda e: f"{prefix}experts.{e}.{_ROLES[block]['gate']}.weight")
            if experts is not None and experts.stop > count:
                raise ValueError(f"experts {experts!r} is past the checkpoint's {count} experts")
            plans[layer] = _plan(layer, block, scheme, experts or range(count))
        keys = [k for plan in plans.values() for v in plan.values()
                for k in ((v,) if isinstance(v, str) else v)]
        for key in keys:
            if key not in index:
                raise KeyError(f"key {key!r} is missing from the checkpoint {path}")
        headers = {key: handle(key).get_slice(key) for key in keys}
        shapes = {key: tuple(h.get_shape()) for key, h in headers.items()}
        dtypes = {key: h.get_dtype() for key, h in headers.items()}
        for plan in plans.values():
            _check_layer(plan, shapes, dtypes, config, config_file, scheme)
        return {layer: _read_layer(plan, handle, shapes, scheme, device)
                for layer, plan in plans.items()}


def _check_layer(plan: dict, shapes: dict, dtypes: dict, config: dict, config_file: Path,
                 scheme: str) -> None:
    router = plan["router"]
    if len(shapes[router]) != 2 or dtypes[router] not in _FLOAT:
        raise ValueError(f"{router}: expected a 2-D bf16/fp16/fp32 (E, H) router, got shape "
                         f"{shapes[router]} and dtype {dtypes[router]}")
    hidden = shapes[router][1]
    if config.get("hidden_size", hidden) != hidden:
        raise ValueError(f"{config_file}: hidden_size = {config['hidden_size']}, but the router "
                         f"{router} has shape {shapes[router]}")
    first_gate = next(v[0] for k, v in plan.items() if k != "router" and k[0] == "gate")
    inter = config_intermediate(config)
    if inter is None:
        inter = shapes[first_gate][0]
    if scheme == "blockwise" and inter % BLOCK:
        raise ValueError(f"intermediate size {inter}: blockwise gate and up scales stack into "
                         f"one gate_up scale only for a multiple of {BLOCK}")
    for key, keys in plan.items():
        if key == "router":
            continue
        weight, scale = keys
        n, k = (hidden, inter) if key[0] == "down" else (inter, hidden)
        if dtypes[weight] != "F8_E4M3" or shapes[weight] != (n, k):
            raise ValueError(f"{weight}: expected F8_E4M3 of shape {(n, k)}, got "
                             f"{dtypes[weight]} of shape {shapes[weight]}")
        expected = _expected_scale(scheme, n, k)
        if dtypes[scale] not in _FLOAT or shapes[scale] not in expected:
            raise ValueError(f"{scale}: expected a float scale of shape "
                             f"{' or '.join(map(str, expected))} ({scheme}), got "
                             f"{dtypes[scale]} of shape {shapes[scale]}")


def _read_layer(plan: dict, handle, shapes: dict, scheme: str, device) -> dict:
    def read(key):
        return handle(key).get_tensor(key)

    router = read(plan["router"])
    hidden = router.shape[1]
    experts = sorted({k[1] for k in plan if k != "router"})
    inter = shapes[plan[("gate", experts[0])][0]][0]
    e4m3 = torch.float8_e4m3fn
    gate_up = torch.empty(len(experts), 2 * inter, hidden, dtype=e4m3, device=device)
    down = torch.empty(len(experts), hidden, inter, dtype=e4m3, device=device)
    if scheme == "blockwise":
        rows = -(-inter // BLOCK)
        gu_scale = torch.empty(len(experts), 2 * rows, -(-hidden // BLOCK), device=device)
        down_scale = torch.empty(len(experts), -(-hidden // BLOCK), rows, device=device)
    else:
        gu_scale = torch.empty(len(experts), 2 * inter, device=device)
        down_scale = torch.empty(len(experts), hidden, device=device)
    for i, e in enumerate(experts):
        for role, w_dst, s_dst in (
                ("gate", gate_up[i, :inter], gu_scale[i, :gu_scale.shape[1] // 2]),
                ("up", gate_up[i, inter:], gu_scale[i, gu_scale.shape[1] // 2:]),
                ("down", down[i], down_scale[i])):
            weight, scale = plan[(role, e)]
            w_dst.copy_(read(weight))
            s = read(scale).float()
            s_dst.copy_(s if scheme == "blockwise" else s.reshape(-1).expand(s_dst.shape))
    return {"router": router, "gate_up_proj": gate_up, "gate_up_proj_scale": gu_scale,
            "down_proj": down, "down_proj_scale": down_scale,
            "scale_recipe": Recipe.BLOCKWISE_128X128 if scheme == "blockwise" else Recipe.ROWWISE}


def pretrained_layer(path, layer: int, device=None) -> dict | None:
    """Layer ``layer`` of an FP8 checkpoint for :meth:`ts_moe.MoE.from_pretrained`, or None
    where config.json declares no quantization (a bf16 checkpoint).  Whether the layer
    reproduces the model's block is :mod:`ts_moe.pretrained`'s to say."""
    ckpt = local_checkpoint(path, "MoE.from_pretrained")
    if fp8_scheme(read_config(ckpt), ckpt.path / "config.json") is None:
        return None
    return load_fp8_experts(path, layers=[layer], device=device)[layer]
