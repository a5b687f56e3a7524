"""Reading a Hugging Face checkpoint directory safely: the checked reader
(:class:`_Checkpoint`), the weight index and the shards, config.json's sizes, a layer's
expert count from its router, and the loaders' argument checks.  The loaders
(:mod:`ts_moe.loaders`) build their one plan on these.

A checkpoint directory holds ``model.safetensors``, or shards listed in
``model.safetensors.index.json``.  The directory must be on disk: a Hub id such as
``mistralai/Mixtral-8x7B-v0.1`` is not downloaded here (``huggingface_hub.snapshot_download``
or ``hf download`` fetch one).  Tensors are read straight onto the requested device; by
default that is CUDA when torch sees a GPU and the CPU otherwise (:func:`resolve_device`,
which :meth:`ts_moe.MoE.from_pretrained` shares).
"""

import json
import os
import stat
from contextlib import ExitStack
from pathlib import Path, PurePosixPath

import torch
from safetensors import safe_open

# a layer or expert index in a key: canonical decimal, short enough to convert at once
# (a key with a longer or zero-padded one names no layer or expert and is ignored)
INDEX_NUMBER = r"(0|[1-9]\d{0,17})"
# config.json's expert count (by model type), hidden size and expert intermediate size
# (moe_intermediate_size where the model also has dense MLPs, whose size intermediate_size is)
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
INTER_FIELDS = ("moe_intermediate_size", "intermediate_size")
_CONFIG_SIZES = (*EXPERT_FIELDS, "hidden_size", *INTER_FIELDS)
JSON_LIMIT = 64 << 20  # bytes of a config.json or an index (DeepSeek-V3's index: 9 MB)


class _Checkpoint:
    """The files of a checkpoint directory that may be opened: regular files
    inside it (after symlinks), or, for a snapshot of the Hugging Face cache
    (``<repo>/snapshots/<revision>``, whose files link to ``<repo>/blobs``), in
    that repository's ``blobs``.  Checked with ``lstat`` before anything opens
    them, so a FIFO, a device or a path out of the directory is a ValueError
    naming the file and the field that named it, never a blocked read; the JSON
    files are read through one descriptor, checked again (``fstat``) and read
    no further than :data:`JSON_LIMIT`, so a file swapped or grown after the
    check cannot block or exhaust memory either."""

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

    def read(self, name: str, what: str, limit: int) -> bytes | None:
        """The bytes of ``name`` (checked as :meth:`file`), at most ``limit`` of them,
        else a ValueError naming it; None if it does not exist.  Opened without
        following a link and without blocking, and checked again on the descriptor
        that is read."""
        real = self.file(name, what)
        if real is None:
            return None
        path = str(self.path / name)
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(f"{what}: {path!r} cannot be opened ({exc.strerror})") from None
        with open(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{what}: {path!r} is not a regular file")
            if info.st_size > limit:
                raise ValueError(f"{what}: {path!r} holds {info.st_size} bytes, more than the "
                                 f"{limit} it may")
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"{what}: {path!r} holds more than the {limit} bytes it may")
        return data

    def json(self, name: str) -> dict | None:
        """A JSON file of the directory, or None if it has none by that name."""
        data = self.read(name, name, JSON_LIMIT)
        if data is None:
            return None
        try:
            value = json.loads(data)
        except RecursionError:
            raise ValueError(f"{self.path / name}: nested too deeply to parse") from None
        except ValueError as exc:  # bad JSON or UTF-8, an integer of too many digits
            raise ValueError(f"{self.path / name}: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{self.path / name}: expected a JSON object")
        return value


def local_checkpoint(path, loader: str = "load_mixtral_experts") -> _Checkpoint:
    """``path`` as a checkpoint directory on disk, else a FileNotFoundError saying how
    to download one (a Hub id is not a directory)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{str(path)!r} is not a local directory: {loader} reads a checkpoint "
            f"directory on disk, not a Hugging Face Hub id. Download one first, e.g. "
            f"huggingface_hub.snapshot_download('mistralai/Mixtral-8x7B-v0.1', "
            f"allow_patterns=['*.safetensors', '*.json'], local_dir='Mixtral-8x7B'), or "
            f"`hf download mistralai/Mixtral-8x7B-v0.1 --include '*.safetensors' '*.json' "
            f"--local-dir Mixtral-8x7B`, and pass that directory")
    return _Checkpoint(path)


def _shard_name(index_file: Path, key, shard) -> str:
    """A shard name of the index: a relative path that stays in the directory."""
    field = f"{index_file}: weight_map[{key!r}]"
    if not isinstance(key, str) or not isinstance(shard, str) or not shard:
        raise ValueError(f"{field} must map a key to a file name, got {shard!r}")
    if os.path.isabs(shard) or ".." in PurePosixPath(shard).parts:
        raise ValueError(f"{field} = {shard!r} is not a file inside the checkpoint directory")
    return shard


def weight_index(ckpt: _Checkpoint) -> tuple[dict[str, str], Path]:
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


def shard_opener(ckpt: _Checkpoint, index: dict[str, str], index_file: Path, device,
                 stack: ExitStack):
    """``handle(key)``: the open safetensors file holding ``key``, each shard opened
    once (on ``stack``, straight onto ``device``) and only as a regular file inside
    the checkpoint; KeyError naming a key the index lacks, FileNotFoundError naming
    the index entry of a shard that is not there."""
    handles = {}

    def handle(key):
        if key not in index:
            raise KeyError(f"key {key!r} is missing from the checkpoint {ckpt.path}")
        shard = index[key]
        if shard not in handles:
            file = ckpt.file(shard, f"{index_file}: weight_map[{key!r}]")
            if file is None:
                raise FileNotFoundError(f"{index_file}: weight_map[{key!r}] = {shard!r}, "
                                        f"which is not in {ckpt.path}")
            handles[shard] = stack.enter_context(
                safe_open(file, framework="pt", device=str(device)))
        return handles[shard]

    return handle


def is_positive_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def read_config(ckpt: _Checkpoint) -> dict:
    """config.json (``{}`` without one), its expert counts and sizes positive ints."""
    config = ckpt.json("config.json") or {}
    for field in _CONFIG_SIZES:
        if field in config and not is_positive_int(config[field]):
            raise ValueError(f"{ckpt.path / 'config.json'}: {field} must be a positive int, "
                             f"got {config[field]!r}")
    return config


def config_intermediate(config: dict) -> int | None:
    """The experts' intermediate size config.json declares (:data:`INTER_FIELDS`), or None."""
    return next((config[f] for f in INTER_FIELDS if f in config), None)


def expert_count(router_key: str, router_shape: tuple, router_file, config: dict,
                 config_file: Path, index_file: Path, expert_keys: dict[int, str] | None = None,
                 key_of=None) -> int:
    """E of a layer, from its router's safetensors header, checked before anything
    proportional to it is built.

    The router must be (E, H) with E and H at least 1 (so that its bytes in the
    file bound E); every expert count config.json declares (:data:`EXPERT_FIELDS`)
    must equal E; ``expert_keys`` (expert index -> a key of the index naming it,
    for a naming with per-expert keys; None for stacked experts) must name
    exactly the experts ``0 .. E-1``.  ValueError naming the file and the field
    otherwise, or a KeyError naming ``key_of(e)`` for the first missing expert
    ``e``."""
    if len(router_shape) != 2 or min(router_shape) < 1:
        raise ValueError(f"{router_file}: {router_key}: expected a 2-D (E, H) router with "
                         f"E >= 1 experts and H >= 1, got shape {router_shape}")
    num_experts = router_shape[0]
    for field in EXPERT_FIELDS:
        if config.get(field, num_experts) != num_experts:
            raise ValueError(f"{config_file}: {field} = {config[field]}, but the router "
                             f"{router_key} has {num_experts} experts (its shape "
                             f"{router_shape})")
    if expert_keys is not None:
        last = max(expert_keys, default=-1)
        if last >= num_experts:
            raise ValueError(f"{index_file}: key {expert_keys[last]!r} names expert {last}, "
                             f"but the router {router_key} has {num_experts} experts")
        if len(expert_keys) < num_experts:  # one of 0 .. len(expert_keys) is missing
            missing = next(e for e in range(num_experts) if e not in expert_keys)
            raise KeyError(f"key {key_of(missing)!r} is missing from {index_file}: the router "
                           f"{router_key} has {num_experts} experts")
    return num_experts


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
