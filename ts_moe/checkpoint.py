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
import operator
import os
import stat
from contextlib import ExitStack
from pathlib import Path, PurePosixPath

import torch

from .safetensors_file import ShardFile

# a layer or expert index in a key: canonical decimal, short enough to convert at once
# (a key with a longer or zero-padded one names no layer or expert and is ignored)
INDEX_NUMBER = r"(0|[1-9]\d{0,17})"
# config.json's expert count (by model type), hidden size and expert intermediate size
# (moe_intermediate_size where the model also has dense MLPs, whose size intermediate_size is)
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
INTER_FIELDS = ("moe_intermediate_size", "intermediate_size")
_CONFIG_SIZES = (*EXPERT_FIELDS, "hidden_size", *INTER_FIELDS)
JSON_LIMIT = 64 << 20  # bytes of a config.json or an index (DeepSeek-V3's index: 9 MB)
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO never blocks
_PROC_FD = os.path.isdir("/proc/self/fd")  # where the kernel names an open file (Linux)


def _opened_path(fd: int) -> str | None:
    """The path of the file open at ``fd`` as the kernel names it, or None where it
    does not say (no ``/proc``)."""
    if not _PROC_FD:
        return None
    return os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")


class _Checkpoint:
    """The files of a checkpoint directory that may be opened: regular files
    inside it (after symlinks), or, for a snapshot of the Hugging Face cache
    (``<repo>/snapshots/<revision>``, whose files link to ``<repo>/blobs``), in
    that repository's ``blobs``.  Checked with ``lstat`` before anything opens
    them, so a FIFO, a device or a path out of the directory is a ValueError
    naming the file and the field that named it, never a blocked read.

    Every file is then opened once (:meth:`open`: no link followed, no
    blocking), checked again on that descriptor (``fstat``, and on Linux the
    path ``/proc/self/fd`` gives it), and read only through it: the JSON
    files no further than :data:`JSON_LIMIT`, the shards with ``pread``
    (:meth:`safetensors`, :class:`ts_moe.safetensors_file.ShardFile`), never
    through a memory map.  So a file swapped after the check (a FIFO, a link,
    a directory on the way renamed) cannot block the process, exhaust its
    memory, or redirect a read out of the directory, and a shard cut short
    while it is read is a ValueError naming it, not a SIGBUS from a mapped
    page past its new end."""

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
        if not self.inside(real):
            raise ValueError(f"{what}: {str(path)!r} resolves to {str(real)!r}, outside the "
                             f"checkpoint directory")
        try:
            mode = os.lstat(real).st_mode
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(mode):
            raise ValueError(f"{what}: {str(path)!r} is not a regular file")
        return real

    def inside(self, real) -> bool:
        """Whether the resolved path ``real`` lies in the directory (or its blobs)."""
        return any(Path(real).is_relative_to(root) for root in self.roots)

    def open(self, name: str, what: str) -> int | None:
        """A descriptor of ``name`` (checked as :meth:`file`), opened without following
        a link and without blocking, and checked again on that descriptor; None if it
        does not exist.  The caller closes it."""
        real = self.file(name, what)
        if real is None:
            return None
        path = str(self.path / name)
        try:
            fd = os.open(real, _OPEN_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(f"{what}: {path!r} cannot be opened ({exc.strerror})") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{what}: {path!r} is not a regular file")
            opened = _opened_path(fd)
            if opened is not None and not self.inside(opened):
                raise ValueError(f"{what}: {path!r} opened {opened!r}, outside the checkpoint "
                                 f"directory")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read(self, name: str, what: str, limit: int) -> bytes | None:
        """The bytes of ``name`` (opened as :meth:`open`), at most ``limit`` of them,
        else a ValueError naming it; None if it does not exist."""
        fd = self.open(name, what)
        if fd is None:
            return None
        path = str(self.path / name)
        with open(fd, "rb") as f:
            size = os.fstat(fd).st_size
            if size > limit:
                raise ValueError(f"{what}: {path!r} holds {size} bytes, more than the "
                                 f"{limit} it may")
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"{what}: {path!r} holds more than the {limit} bytes it may")
        return data

    def safetensors(self, name: str, what: str, stack: ExitStack,
                    device: str = "cpu") -> ShardFile | None:
        """The safetensors file ``name`` open for reading onto ``device`` (its descriptor
        of :meth:`open` closed by ``stack``), its header read and checked; None if it
        does not exist.  A bad header is a ValueError naming the file and ``what``."""
        fd = self.open(name, what)
        if fd is None:
            return None
        stack.callback(os.close, fd)
        return ShardFile(fd, str(self.path / name), what, device)

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
    if not isinstance(key, str) or not isinstance(shard, str) or not shard or "\0" in shard:
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
        names = {}  # each shard name checked once: an index names a few shards many times
        for key, shard in weight_map.items():
            if not isinstance(key, str) or not isinstance(shard, str) or shard not in names:
                names[shard] = _shard_name(index_file, key, shard)
        return weight_map, index_file
    with ExitStack() as stack:
        single = ckpt.safetensors("model.safetensors", "model.safetensors", stack)
        if single is not None:
            return ({key: "model.safetensors" for key in single.keys()},
                    ckpt.path / "model.safetensors")
    raise FileNotFoundError(
        f"{ckpt.path} has neither model.safetensors nor model.safetensors.index.json")


def shard_opener(ckpt: _Checkpoint, index: dict[str, str], index_file: Path, device,
                 stack: ExitStack):
    """``handle(key)``: the open safetensors file holding ``key``, each shard opened
    once (on ``stack``, straight onto ``device``) and only as a regular file inside
    the checkpoint (:meth:`_Checkpoint.safetensors`); KeyError naming a key the
    index lacks, FileNotFoundError naming the index entry of a shard that is not
    there, ValueError naming it for a shard that is not a valid safetensors file."""
    handles = {}

    def handle(key):
        if key not in index:
            raise KeyError(f"key {key!r} is missing from the checkpoint {ckpt.path}")
        shard = index[key]
        if shard not in handles:
            field = f"{index_file}: weight_map[{key!r}]"
            handles[shard] = ckpt.safetensors(shard, field, stack, str(device))
            if handles[shard] is None:
                raise FileNotFoundError(f"{field} = {shard!r}, which is not in {ckpt.path}")
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


def _layer_index(layer) -> int | None:
    """``layer`` as an int (a Python or NumPy integer, a 0-d integer tensor), or None."""
    if isinstance(layer, bool) or not hasattr(type(layer), "__index__"):
        return None
    try:
        return operator.index(layer)
    except TypeError:  # a NumPy bool, a tensor of more than one element
        return None


def selected_layers(layers, present, path) -> list[int]:
    """``layers`` (None: every MoE layer in ``present``; an integer; an iterable of
    them) as a list of ints, each an MoE layer of the checkpoint at ``path``, else a
    TypeError/KeyError naming ``layers``."""
    if layers is None:
        return sorted(present)
    single = _layer_index(layers)
    if single is not None:
        layers = [single]
    else:
        try:
            layers = list(layers)
        except TypeError:
            raise TypeError(f"layers must be None, an int or an iterable of ints, got "
                            f"{type(layers).__name__} {layers!r}") from None
    selected = []
    for layer in layers:
        index = _layer_index(layer)
        if index is None:
            raise TypeError(f"layers must hold ints, got {type(layer).__name__} {layer!r}")
        if index not in present:
            raise KeyError(f"layer {index} is not an MoE layer of the checkpoint {path} "
                           f"(its MoE layers: {sorted(present)})")
        selected.append(index)
    return selected


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
