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
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(block_sparse_moe|mlp)\.(gate|experts)\.")
_V4, _V5 = "block_sparse_moe", "mlp"


def _weight_index(path: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        return {key: path / shard for key, shard in weight_map.items()}
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {key: single for key in f.keys()}
    raise FileNotFoundError(
        f"{path} has neither model.safetensors nor model.safetensors.index.json")


def _layer_plan(layer: int, naming: str, index: dict[str, Path], num_experts: int | None):
    """The checkpoint keys of one MoE layer: {"router": key, ...} by naming."""
    prefix = f"model.layers.{layer}.{naming}."
    if naming == _V5:
        return {"router": prefix + "gate.weight",
                "gate_up_proj": prefix + "experts.gate_up_proj",
                "down_proj": prefix + "experts.down_proj"}
    if num_experts is None:  # no config.json: count the experts present
        found = {int(m.group(1)) for key in index
                 if (m := re.fullmatch(re.escape(prefix) + r"experts\.(\d+)\.w[123]\.weight", key))}
        num_experts = max(found) + 1 if found else 1
    plan = {"router": prefix + "gate.weight"}
    for e in range(num_experts):
        for w in ("w1", "w2", "w3"):
            plan[f"{w}.{e}"] = f"{prefix}experts.{e}.{w}.weight"
    return plan


def _expected_shapes(plan: dict[str, str], shapes: dict[str, tuple], config: dict):
    """Shape of each role in ``plan``; E and H from config.json or the router, I from config.json
    or the first gate projection."""
    router_shape = shapes[plan["router"]]
    if len(router_shape) != 2:
        raise ValueError(
            f"{plan['router']}: expected a 2-D (E, H) router, got shape {router_shape}")
    num_experts = config.get("num_local_experts", router_shape[0])
    hidden = config.get("hidden_size", router_shape[1])
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

    Raises ``ValueError`` for a device that does not exist here (before any
    file is read), ``FileNotFoundError`` without a checkpoint, ``KeyError`` naming a
    layer that is not in it or a missing key, ``ValueError`` naming a key with
    the wrong shape or dtype (not bf16/fp16/fp32, or not the router's).
    """
    device = resolve_device(device)
    if experts is not None and (not isinstance(experts, range) or experts.step != 1
                                or len(experts) == 0 or experts.start < 0):
        raise ValueError(f"experts must be None or a non-empty range of expert indices "
                         f"(step 1), got {experts!r}")
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{str(path)!r} is not a local directory: load_mixtral_experts reads a checkpoint "
            f"directory on disk, not a Hugging Face Hub id. Download one first, e.g. "
            f"huggingface_hub.snapshot_download('mistralai/Mixtral-8x7B-v0.1', "
            f"allow_patterns=['*.safetensors', '*.json'], local_dir='Mixtral-8x7B'), or "
            f"`hf download mistralai/Mixtral-8x7B-v0.1 --include '*.safetensors' '*.json' "
            f"--local-dir Mixtral-8x7B`, and pass that directory")
    index = _weight_index(path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}

    present: dict[int, str] = {}
    for key in index:
        if m := _LAYER_KEY.match(key):
            present.setdefault(int(m.group(1)), m.group(2))
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
            raise KeyError(f"layer {layer} is not in the checkpoint {path} "
                           f"(its MoE layers: {sorted(present)})")

    plans = {layer: _layer_plan(layer, present[layer], index, config.get("num_local_experts"))
             for layer in layers}
    for plan in plans.values():
        for key in plan.values():
            if key not in index:
                raise KeyError(f"key {key!r} is missing from the checkpoint {path}")

    with ExitStack() as stack:
        handles = {}

        def handle(key):
            shard = index[key]
            if shard not in handles:
                handles[shard] = stack.enter_context(
                    safe_open(shard, framework="pt", device=str(device)))
            return handles[shard]

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
