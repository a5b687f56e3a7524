"""Load the expert weights of a Hugging Face Mixtral checkpoint into ts_moe's layouts.

A checkpoint directory holds ``model.safetensors``, or shards listed in
``model.safetensors.index.json``.  Two namings of the MoE tensors exist:

* transformers 4 (and what transformers 5 still writes on save):
  ``model.layers.{L}.block_sparse_moe.gate.weight`` (E, H) and per expert
  ``...block_sparse_moe.experts.{e}.w1.weight`` (I, H) (gate),
  ``w3.weight`` (I, H) (up), ``w2.weight`` (H, I) (down);
* transformers 5 in memory: ``model.layers.{L}.mlp.gate.weight`` (E, H),
  ``...mlp.experts.gate_up_proj`` (E, 2I, H), ``...mlp.experts.down_proj`` (E, H, I).

The directory must be on disk: a Hub id such as ``mistralai/Mixtral-8x7B-v0.1``
is not downloaded here (``huggingface_hub.snapshot_download`` or ``hf download``
fetch one).  Tensors are read straight onto the requested device; by default
that is CUDA when torch sees a GPU and the CPU otherwise (:func:`resolve_device`,
which :meth:`ts_moe.MoE.from_pretrained` shares).
"""

import json
import os
import re
import stat
from contextlib import ExitStack
from pathlib import Path, PurePosixPath

import torch
from safetensors import safe_open


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(block_sparse_moe|mlp)\.(gate|experts)\.")
_V4_EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.")
_V4, _V5 = "block_sparse_moe", "mlp"
_CONFIG_SIZES = ("num_local_experts", "hidden_size", "intermediate_size")


class _Checkpoint:
    """The files of a checkpoint directory that may be opened: regular files
    inside it (after symlinks), or, for a snapshot of the Hugging Face cache
    (``<repo>/snapshots/<revision>``, whose files link to ``<repo>/blobs``), in
    that repository's ``blobs``.  Checked with ``lstat`` before anything opens
    them, so a FIFO, a device or a path out of the directory is a ValueError
    naming the file and the field that named it, never a blocked read."""

    def __init__(self, path: Path):
        self.path = path
        real = Path(os.path.realpath(path))
        self.roots = [real]
        if real.parent.name == "snapshots":
            self.roots.append(real.parent.parent / "blobs")

    def file(self, name: str, what: str) -> Path | None:
        """The checked real path of ``name`` in the directory; None if it does not exist."""
        path = self.path / name
        real = Path(os.path.realpath(path))
        if not any(real.is_relative_to(root) for root in self.roots):
            raise ValueError(f"{what}: {str(path)!r} resolves to {str(real)!r}, outside the "
                             f"checkpoint directory")
        try:
            mode = os.lstat(real).st_mode
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(mode):
            raise ValueError(f"{what}: {str(path)!r} is not a regular file")
        return real

    def json(self, name: str) -> dict | None:
        """A JSON file of the directory, or None if it has none by that name."""
        path = self.file(name, name)
        if path is None:
            return None
        try:
            value = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{self.path / name}: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{self.path / name}: expected a JSON object")
        return value


def _shard_name(index_file: Path, key, shard) -> str:
    """A shard name of the index: a relative path that stays in the directory."""
    field = f"{index_file}: weight_map[{key!r}]"
    if not isinstance(key, str) or not isinstance(shard, str) or not shard:
        raise ValueError(f"{field} must map a key to a file name, got {shard!r}")
    if os.path.isabs(shard) or ".." in PurePosixPath(shard).parts:
        raise ValueError(f"{field} = {shard!r} is not a file inside the checkpoint directory")
    return shard


def _weight_index(ckpt: _Checkpoint) -> tuple[dict[str, str], Path]:
    """Checkpoint key -> the name of the safetensors file holding it, and the file
    that says so (the index, or the single ``model.safetensors``)."""
    index = ckpt.json("model.safetensors.index.json")
    if index is not None:
        index_file = ckpt.path / "model.safetensors.index.json"
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_file}: weight_map must be an object of key -> file name")
        return {key: _shard_name(index_file, key, shard)
                for key, shard in weight_map.items()}, index_file
    single = ckpt.file("model.safetensors", "model.safetensors")
    if single is not None:
        with safe_open(single, framework="pt") as f:
            return {key: "model.safetensors" for key in f.keys()}, ckpt.path / "model.safetensors"
    raise FileNotFoundError(
        f"{ckpt.path} has neither model.safetensors nor model.safetensors.index.json")


def _read_config(ckpt: _Checkpoint) -> dict:
    """config.json (``{}`` without one), its sizes positive ints."""
    config = ckpt.json("config.json") or {}
    for field in _CONFIG_SIZES:
        value = config.get(field)
        if field in config and (isinstance(value, bool) or not isinstance(value, int)
                                or value < 1):
            raise ValueError(f"{ckpt.path / 'config.json'}: {field} must be a positive int, "
                             f"got {value!r}")
    return config


def _expert_count(router_key: str, router_shape: tuple, config: dict, config_file: Path,
                  last_expert: tuple[int, str] | None, index_file: Path) -> int:
    """E of a layer, from its router's header; config.json's ``num_local_experts`` and
    the largest expert index of the index must agree with it."""
    if len(router_shape) != 2 or router_shape[0] < 1:
        raise ValueError(
            f"{router_key}: expected a 2-D (E, H) router with E >= 1, got shape {router_shape}")
    num_experts = router_shape[0]
    if config.get("num_local_experts", num_experts) != num_experts:
        raise ValueError(f"{config_file}: num_local_experts = {config['num_local_experts']}, "
                         f"but the router {router_key} has {num_experts} experts (its shape "
                         f"{router_shape})")
    if last_expert is not None and last_expert[0] >= num_experts:
        raise ValueError(f"{index_file}: key {last_expert[1]!r} names expert {last_expert[0]}, "
                         f"but the router {router_key} has {num_experts} experts")
    return num_experts


def _layer_plan(layer: int, naming: str, num_experts: int):
    """The checkpoint keys of one MoE layer: {"router": key, ...} by naming."""
    prefix = f"model.layers.{layer}.{naming}."
    if naming == _V5:
        return {"router": prefix + "gate.weight",
                "gate_up_proj": prefix + "experts.gate_up_proj",
                "down_proj": prefix + "experts.down_proj"}
    plan = {"router": prefix + "gate.weight"}
    for e in range(num_experts):
        for w in ("w1", "w2", "w3"):
            plan[f"{w}.{e}"] = f"{prefix}experts.{e}.{w}.weight"
    return plan


def _expected_shapes(plan: dict[str, str], shapes: dict[str, tuple], config: dict):
    """Shape of each role in ``plan``; E from the router (checked by :func:`_expert_count`),
    H from config.json or the router, I from config.json or the first gate projection."""
    num_experts, router_hidden = shapes[plan["router"]]
    hidden = config.get("hidden_size", router_hidden)
    if "intermediate_size" in config:
        inter = config["intermediate_size"]
    else:  # from gate_up_proj (E, 2I, H) or w1 (I, H); a wrong rank fails the check below
        shape = shapes[plan.get("gate_up_proj", plan.get("w1.0"))]
        inter = (shape[-2] // 2 if "gate_up_proj" in plan else shape[0]) if len(shape) >= 2 else 0
    expected = {"router": (num_experts, hidden),
                "gate_up_proj": (num_experts, 2 * inter, hidden),
                "down_proj": (num_experts, hidden, inter),
                "w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    return {role: expected[role.split(".")[0]] for role in plan}


def check_experts_range(experts) -> None:
    """``experts``: None or a non-empty ``range`` of expert indices, step 1, else a ValueError."""
    if experts is not None and (not isinstance(experts, range) or experts.step != 1
                                or len(experts) == 0 or experts.start < 0):
        raise ValueError(f"experts must be None or a non-empty range of expert indices "
                         f"(step 1), got {experts!r}")


def selected_layers(layers, present, path) -> list[int]:
    """``layers`` (None: every MoE layer in ``present``; an int; ints) as a list, each an
    MoE layer of the checkpoint at ``path``, else a TypeError/KeyError naming it."""
    if layers is None:
        layers = sorted(present)
    elif isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    else:
        layers = list(layers)
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layers must hold ints, got {layer!r}")
        if layer not in present:
            raise KeyError(f"layer {layer} is not an MoE layer of the checkpoint {path} "
                           f"(its MoE layers: {sorted(present)})")
    return layers


def resolve_device(device) -> torch.device:
    """``device`` as a ``torch.device`` that exists on this machine; None: CUDA when
    torch sees a GPU, else the CPU.

    Checked up front because the failures come late and name no argument:
    safetensors opens a file for ``device="cuda"`` on a machine without CUDA
    and only its first ``get_tensor`` fails (``RuntimeError: pin_memory=True
    requires a CUDA or other accelerator backend``: it stages reads in pinned
    host memory); ``"meta"`` and absent backends (``"xpu"``, ``"mps"``) fail
    inside safetensors or torch.  Each of these is a ValueError naming
    ``device`` here.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
    if device.type == "cpu":
        return device
    if device.type == "meta":
        raise ValueError(f"device {str(device)!r} holds no values: the weights need a real "
                         f"device (pass device='cpu', or None for the default)")
    if device.type == "cuda":
        available, count, what = torch.cuda.is_available, torch.cuda.device_count, "CUDA GPU"
    else:  # another accelerator: torch.xpu, torch.mps, ... (torch.accelerator knows which)
        def available():
            current = torch.accelerator.current_accelerator()
            return current is not None and current.type == device.type

        count, what = torch.accelerator.device_count, f"{device.type} device"
    if not available():
        raise ValueError(f"device {str(device)!r}: torch sees no {what} here "
                         f"(pass device='cpu', or None for the default)")
    if device.index is not None and device.index >= count():
        raise ValueError(f"device {str(device)!r}: there are only {count()} {what}s")
    return device


def load_mixtral_experts(path, layers=None, device=None,
                         experts=None) -> dict[int, dict[str, torch.Tensor]]:
    """Read the MoE weights of a Mixtral checkpoint directory into the fused layouts.

    path: a local checkpoint directory (``model.safetensors`` or a sharded
    index), not a Hub id: download one first, e.g. with
    ``huggingface_hub.snapshot_download("mistralai/Mixtral-8x7B-v0.1",
    allow_patterns=["*.safetensors", "*.json"], local_dir="Mixtral-8x7B")``
    or ``hf download mistralai/Mixtral-8x7B-v0.1 --include "*.safetensors"
    "*.json" --local-dir Mixtral-8x7B``;
    layers: a layer index, an iterable of them, or None for every MoE layer;
    device: where the tensors are created (``safe_open(..., device=...)`` reads
    straight there); None: CUDA when there is a GPU, else the CPU;
    experts: None for all, or a ``range`` of consecutive expert indices (an
    expert-parallel rank's share): only those experts' bytes are read, and
    ``gate_up_proj``/``down_proj`` hold only them (the router stays whole).

    Returns ``{layer: {"router": (E, H), "gate_up_proj": (E, 2I, H),
    "down_proj": (E, H, I)}}`` with the checkpoint's values and dtype: in the
    transformers-4 naming ``gate_up_proj[e]`` is ``w1`` (gate) over ``w3``
    (up) and ``down_proj[e]`` is ``w2``; transformers-5 tensors are taken as
    they are.  Each needed shard is opened once, and only the requested
    layers' tensors are read; every shape and dtype is checked from the
    headers before any data is read.

    The expert count of a layer is its router's first dimension, read from
    the safetensors header before any per-expert key is made: config.json's
    ``num_local_experts`` (a positive int, like ``hidden_size`` and
    ``intermediate_size``) and the expert indices of the index's keys must
    agree with it.  The index's shard names, config.json and the shards are
    opened only if they are regular files inside the directory (a Hugging Face
    cache snapshot's links into its repository's ``blobs`` included).

    Raises ``ValueError`` for a device that does not exist here (before any
    file is read), ``FileNotFoundError`` without a checkpoint or a shard it
    names, ``KeyError`` naming a layer that is not in it or a missing key,
    ``ValueError`` naming a key with the wrong shape or dtype (not
    bf16/fp16/fp32, or not the router's), and ``ValueError`` naming the file
    and the field for a bad config.json size, an expert count that disagrees
    with the router, or a shard name that is not a regular file inside the
    directory (``../x``, an absolute path, a link out of it, a FIFO).
    """
    device = resolve_device(device)
    check_experts_range(experts)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{str(path)!r} is not a local directory: load_mixtral_experts reads a checkpoint "
            f"directory on disk, not a Hugging Face Hub id. Download one first, e.g. "
            f"huggingface_hub.snapshot_download('mistralai/Mixtral-8x7B-v0.1', "
            f"allow_patterns=['*.safetensors', '*.json'], local_dir='Mixtral-8x7B'), or "
            f"`hf download mistralai/Mixtral-8x7B-v0.1 --include '*.safetensors' '*.json' "
            f"--local-dir Mixtral-8x7B`, and pass that directory")
    ckpt = _Checkpoint(path)
    index, index_file = _weight_index(ckpt)
    config = _read_config(ckpt)

    present: dict[int, str] = {}
    last_expert: dict[int, tuple[int, str]] = {}  # per v4 layer: its largest expert index, a key
    for key in index:
        if m := _LAYER_KEY.match(key):
            present.setdefault(int(m.group(1)), m.group(2))
        if m := _V4_EXPERT_KEY.match(key):
            layer, e = int(m.group(1)), int(m.group(2))
            if e >= last_expert.get(layer, (-1,))[0]:
                last_expert[layer] = (e, key)
    layers = selected_layers(layers, present, path)

    with ExitStack() as stack:
        handles = {}

        def handle(key):
            if key not in index:
                raise KeyError(f"key {key!r} is missing from the checkpoint {path}")
            shard = index[key]
            if shard not in handles:
                file = ckpt.file(shard, f"{index_file}: weight_map[{key!r}]")
                if file is None:
                    raise FileNotFoundError(f"{index_file}: weight_map[{key!r}] = {shard!r}, "
                                            f"which is not in {path}")
                handles[shard] = stack.enter_context(
                    safe_open(file, framework="pt", device=str(device)))
            return handles[shard]

        # each layer's expert count from its router's header, checked before any
        # per-expert key is made
        plans = {}
        for layer in layers:
            router = f"model.layers.{layer}.{present[layer]}.gate.weight"
            num_experts = _expert_count(
                router, tuple(handle(router).get_slice(router).get_shape()), config,
                path / "config.json", last_expert.get(layer), index_file)
            plans[layer] = _layer_plan(layer, present[layer], num_experts)
        for plan in plans.values():
            for key in plan.values():
                if key not in index:
                    raise KeyError(f"key {key!r} is missing from the checkpoint {path}")

        headers = {key: handle(key).get_slice(key)
                   for plan in plans.values() for key in plan.values()}
        shapes = {key: tuple(h.get_shape()) for key, h in headers.items()}
        for plan in plans.values():
            router_dtype = headers[plan["router"]].get_dtype()
            for role, shape in _expected_shapes(plan, shapes, config).items():
                key = plan[role]
                dtype = headers[key].get_dtype()
                if dtype not in _DTYPES:
                    raise ValueError(f"{key}: dtype {dtype} is not one of {sorted(_DTYPES)}")
                if dtype != router_dtype:
                    raise ValueError(
                        f"{key}: dtype {dtype} differs from the router's {router_dtype}")
                if shapes[key] != shape:
                    raise ValueError(f"{key}: shape {shapes[key]}, expected {shape}")

        if experts is not None:
            for plan in plans.values():
                total = shapes[plan["router"]][0]
                if experts.stop > total:
                    raise ValueError(f"experts {experts!r} is past the checkpoint's {total} "
                                     f"experts")
        return {layer: _read_layer(plan, handle, shapes, device, experts)
                for layer, plan in plans.items()}


def _read(handle, key: str) -> torch.Tensor:
    return handle(key).get_tensor(key)


def _read_layer(plan: dict[str, str], handle, shapes, device,
                experts=None) -> dict[str, torch.Tensor]:
    router = _read(handle, plan["router"])
    num_experts, hidden = router.shape
    experts = range(num_experts) if experts is None else experts
    if "gate_up_proj" in plan:  # fused tensors: read the experts' slab only
        return {"router": router, **{
            role: handle(plan[role]).get_slice(plan[role])[experts.start:experts.stop].to(device)
            for role in ("gate_up_proj", "down_proj")}}
    inter = shapes[plan["w1.0"]][0]
    gate_up = torch.empty(len(experts), 2 * inter, hidden, dtype=router.dtype, device=device)
    down = torch.empty(len(experts), hidden, inter, dtype=router.dtype, device=device)
    for i, e in enumerate(experts):
        for w, dst in (("w1", gate_up[i, :inter]), ("w3", gate_up[i, inter:]), ("w2", down[i])):
            key = plan[f"{w}.{e}"]
            dst.copy_(handle(key).get_tensor(key))
    return {"router": router, "gate_up_proj": gate_up, "down_proj": down}
