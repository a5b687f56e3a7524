"""Every read of a checkpoint's JSON files goes through the one checked reader
(ts_moe.checkpoint._Checkpoint): a regular file inside the checkpoint, opened without
following a link or blocking, checked again on the descriptor it reads, no larger than
JSON_LIMIT and nested no deeper than the parser goes.  A FIFO, a link to /dev/zero, a
file swapped after the check, an oversize or a deeply nested file is a ValueError naming
the file, at once, from MoE.from_pretrained and ExpertParallelMoE.from_pretrained alike."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ts_moe
from ts_moe import checkpoint, loaders
from ts_moe.loaders import load_fp8_experts
from ts_moe.tiny import make_tiny_fp8_checkpoint

from .helpers import FifoWatch

INDEX = "model.safetensors.index.json"
JSON_LIMIT = 64 << 20  # the README's bound on a checkpoint's JSON files

_FROM_PRETRAINED = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import torch.distributed as dist
import ts_moe
from ts_moe.distributed import ExpertParallelMoE

init, paths = sys.argv[1], json.loads(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
results = []
for path in paths:
    for fn in (ts_moe.MoE.from_pretrained, ExpertParallelMoE.from_pretrained):
        start = time.process_time()  # CPU time: a busy machine stretches wall time only
        try:
            fn(path, 0, device="cpu")
            outcome = "no error"
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        results.append([outcome, time.process_time() - start])
dist.destroy_process_group()
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return ts_moe.make_tiny_moe_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", layers=1,
                                           experts=4, shards=2)


@pytest.fixture
def ckpt(source, tmp_path):
    return shutil.copytree(source, tmp_path / "ckpt")


def test_a_fifo_or_dev_zero_config_is_refused_at_once_by_both_layers(source, tmp_path):
    """In a subprocess (a world-1 gloo group for the expert-parallel layer) under a
    timeout and a capped address space: a plain read of either would block forever
    or read until memory runs out."""
    fifo, zero = shutil.copytree(source, tmp_path / "fifo"), shutil.copytree(source,
                                                                              tmp_path / "zero")
    for path in (fifo, zero):
        (path / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    (zero / "config.json").symlink_to("/dev/zero")
    env = dict(os.environ, PYTHONPATH=str(Path(ts_moe.__file__).parents[1]))
    run = subprocess.run([sys.executable, "-c", _FROM_PRETRAINED, str(tmp_path / "init"),
                          json.dumps([str(fifo), str(zero)])],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.splitlines()[-1])
    wants = [rf"{fifo}/config\.json'? is not a regular file"] * 2 + \
            [rf"{zero}/config\.json'? resolves to '/dev/zero', outside the checkpoint"] * 2
    for (outcome, seconds), want in zip(results, wants, strict=True):
        assert outcome.startswith("ValueError: ") and re.search(want, outcome), \
            outcome
        assert seconds < 1.0


def test_config_is_not_read_again_after_the_weights(ckpt, monkeypatch):
    """The settings come from the checked read: a config.json swapped for a FIFO once
    the weights are read is never opened."""
    fifo = []
    real_load = loaders.pretrained_layer

    def load_then_swap(*args, **kwargs):
        weights = real_load(*args, **kwargs)
        (ckpt / "config.json").unlink()
        fifo.append(FifoWatch(ckpt / "config.json"))
        return weights

    monkeypatch.setattr(loaders, "pretrained_layer", load_then_swap)
    try:
        moe = ts_moe.MoE.from_pretrained(ckpt, 0, device="cpu")
    finally:
        for watch in fifo:
            watch.close()
    assert moe.top_k == 2 and not fifo[0].opened


@pytest.mark.parametrize("swap", ["fifo", "link"])
def test_a_file_swapped_after_its_check_is_refused_on_the_descriptor(ckpt, tmp_path,
                                                                     monkeypatch, swap):
    """A FIFO, or a link (here to a FIFO, so that a reader that follows it reads EOF
    instead of blocking the test), put in place between the check and the open: the
    FIFO is opened without blocking and refused on its descriptor, the link not
    followed."""
    real_file = checkpoint._Checkpoint.file
    watches = []

    def check_then_swap(self, name, what):
        real = real_file(self, name, what)
        if name == "config.json" and real is not None:
            real.unlink()
            if swap == "fifo":
                watches.append(FifoWatch(real))
            else:
                watches.append(FifoWatch(tmp_path / "fifo"))
                real.symlink_to(tmp_path / "fifo")
        return real

    monkeypatch.setattr(checkpoint._Checkpoint, "file", check_then_swap)
    match = "is not a regular file" if swap == "fifo" else "cannot be opened"
    try:
        with pytest.raises(ValueError, match=rf"config\.json: .*config\.json'? {match}"):
            ts_moe.load_mixtral_experts(ckpt, device="cpu")
    finally:
        for watch in watches:
            watch.close()
    if swap == "link":  # not followed, so the FIFO behind it never opened
        assert not watches[0].opened


@pytest.mark.parametrize("name", ["config.json", INDEX])
def test_an_oversize_json_file_is_refused_unread(ckpt, name):
    with open(ckpt / name, "r+b") as f:  # sparse: no disk used
        f.truncate(JSON_LIMIT + 1)
    with pytest.raises(ValueError, match=rf"{name}: .*{name}'? holds {JSON_LIMIT + 1} bytes, "
                                         rf"more than the {JSON_LIMIT}"):
        ts_moe.load_mixtral_experts(ckpt, device="cpu")


@pytest.mark.parametrize("name", ["config.json", INDEX])
def test_a_deeply_nested_json_file_is_a_value_error_naming_it(ckpt, tmp_path, name):
    depth = 100_000
    (ckpt / name).write_text("[" * depth + "]" * depth)
    with pytest.raises(ValueError, match=rf"{ckpt / name}: nested too deeply"):
        ts_moe.load_mixtral_experts(ckpt, device="cpu")
    fp8 = make_tiny_fp8_checkpoint(tmp_path / "fp8", naming="mixtral", scheme="channel",
                                   layers=1, hidden=64, intermediate=32)
    (fp8 / name).write_text('{"a": ' * depth + "1" + "}" * depth)
    with pytest.raises(ValueError, match=rf"{fp8 / name}: nested too deeply"):
        load_fp8_experts(fp8, device="cpu")
    with pytest.raises(ValueError, match=rf"{fp8 / name}: nested too deeply"):
        ts_moe.MoE.from_pretrained(fp8, 0, device="cpu")


# ------------------------------------------------------------------ shards
# A shard is checked, then opened once (no link followed, no blocking), checked again on
# its descriptor and read through that descriptor with pread (ts_moe.safetensors_file):
# no name is looked up twice, and no page is mapped.  A case that could block or kill
# the process (safetensors' own reader opened its file with the GIL held, and mapped it)
# runs in a subprocess.

_SWAP_SHARD = r"""
import os, sys
from pathlib import Path
import ts_moe
from ts_moe import checkpoint

ckpt, swap, loads = sys.argv[1], sys.argv[2], int(sys.argv[3])
real_file = checkpoint._Checkpoint.file

def check_then_swap(self, name, what):
    real = real_file(self, name, what)
    if swap == "fifo" and name.endswith(".safetensors") and real is not None:
        real.unlink()
        os.mkfifo(real)  # no writer: a blocking open never returns
    return real

checkpoint._Checkpoint.file = check_then_swap
for _ in range(loads):
    try:
        ts_moe.load_mixtral_experts(ckpt, device="cpu")
        print("no error", flush=True)
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
"""

_EXCHANGE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b = (os.fsencode(p) for p in sys.argv[1:3])
AT_FDCWD, RENAME_EXCHANGE = -100, 2
while True:
    libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)
"""


_TRUNCATE_SHARDS = r"""
import os, sys
from pathlib import Path
import ts_moe
from ts_moe import loaders

ckpt, real_read = Path(sys.argv[1]), loaders._read

def cut_short_then_read(handle, key):
    # another process cuts every shard down to its header once the loader holds them open
    for shard in ckpt.glob("*.safetensors"):
        with open(shard, "rb") as f:
            header = 8 + int.from_bytes(f.read(8), "little")
        os.truncate(shard, header)
    return real_read(handle, key)

loaders._read = cut_short_then_read
try:
    ts_moe.load_mixtral_experts(ckpt, device="cpu")
    print("no error", flush=True)
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
"""


def _load_in_subprocess(ckpt, swap: str, loads: int = 1) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(ts_moe.__file__).parents[1]))
    run = subprocess.run([sys.executable, "-c", _SWAP_SHARD, str(ckpt), swap, str(loads)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


def _shards(ckpt) -> list[Path]:
    return sorted(ckpt.glob("*.safetensors"))


def test_a_shard_swapped_for_a_fifo_after_its_check_is_refused_at_once(ckpt):
    (outcome,) = _load_in_subprocess(ckpt, "fifo")
    assert outcome.startswith("ValueError: ") and re.search(
        rf"{INDEX}: weight_map\[.*\]: '{ckpt}/model-0000\d-of-0000\d\.safetensors' is not a "
        rf"regular file", outcome), outcome


def test_a_shard_exchanged_with_a_fifo_in_a_loop_never_blocks(ckpt):
    """The attack as run: another process exchanges a shard and a FIFO by
    ``renameat2(RENAME_EXCHANGE)`` in a loop while the loader runs; every load
    either reads the shard or refuses the FIFO by name, and returns."""
    shard = _shards(ckpt)[0]
    os.mkfifo(ckpt / "fifo")
    attacker = subprocess.Popen([sys.executable, "-c", _EXCHANGE, str(shard), str(ckpt / "fifo")])
    try:
        outcomes = _load_in_subprocess(ckpt, "none", loads=100)
    finally:
        attacker.kill()
        attacker.wait()
    assert len(outcomes) == 100
    for outcome in outcomes:
        assert outcome == "no error" or (outcome.startswith("ValueError: ") and str(shard) in
                                         outcome and "not a regular file" in outcome), outcome


def test_a_shard_swapped_for_a_link_after_its_check_is_not_followed(ckpt, tmp_path,
                                                                    monkeypatch):
    """A link to a valid shard outside, put in place between the check and the open:
    refused on the open, the file behind it never read."""
    outside = tmp_path / "outside.safetensors"
    real_file = checkpoint._Checkpoint.file
    opened = []

    def check_then_swap(self, name, what):
        real = real_file(self, name, what)
        if name.endswith(".safetensors") and real is not None:
            os.rename(real, outside)
            real.symlink_to(outside)
        return real

    def recording_open(fd, *args, **kwargs):
        opened.append(checkpoint._opened_path(fd))
        return real_shard_file(fd, *args, **kwargs)

    real_shard_file = checkpoint.ShardFile
    monkeypatch.setattr(checkpoint._Checkpoint, "file", check_then_swap)
    monkeypatch.setattr(checkpoint, "ShardFile", recording_open)
    with pytest.raises(ValueError, match=rf"{INDEX}: weight_map\[.*\.safetensors'? cannot be "
                                         rf"opened"):
        ts_moe.load_mixtral_experts(ckpt, device="cpu")
    assert str(outside) not in opened


def test_a_directory_renamed_on_the_way_after_the_check_is_refused(ckpt, tmp_path,
                                                                   monkeypatch):
    """Shards in ``sub/``: ``sub`` replaced by a link to a directory outside holding a
    valid shard of the same name, after the check.  The open follows the directory
    (only the last component is opened without following a link), so the file it
    opened is checked: outside, refused."""
    (ckpt / "sub").mkdir()
    for shard in _shards(ckpt):
        shard.rename(ckpt / "sub" / shard.name)
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"] = {k: f"sub/{v}" for k, v in index["weight_map"].items()}
    (ckpt / INDEX).write_text(json.dumps(index))
    shutil.copytree(ckpt / "sub", tmp_path / "outside")
    real_file = checkpoint._Checkpoint.file

    def check_then_swap(self, name, what):
        real = real_file(self, name, what)
        if name.startswith("sub/") and not (ckpt / "sub").is_symlink():
            os.rename(ckpt / "sub", ckpt / "away")
            (ckpt / "sub").symlink_to(tmp_path / "outside")
        return real

    def recording_open(fd, *args, **kwargs):
        opened.append(checkpoint._opened_path(fd))
        return real_shard_file(fd, *args, **kwargs)

    opened, real_shard_file = [], checkpoint.ShardFile
    monkeypatch.setattr(checkpoint._Checkpoint, "file", check_then_swap)
    monkeypatch.setattr(checkpoint, "ShardFile", recording_open)
    with pytest.raises(ValueError) as refused:
        ts_moe.load_mixtral_experts(ckpt, device="cpu")
    assert not [f for f in opened if f.startswith(f"{tmp_path / 'outside'}/")], opened
    assert re.search(rf"{INDEX}: weight_map\[.*sub/.*\.safetensors'? opened "
                     rf"'{tmp_path / 'outside'}/.*', outside the checkpoint", str(refused.value))


def test_a_shard_cut_short_while_held_open_is_a_value_error_naming_it(ckpt):
    """Shards truncated after the loader opened them and read their headers (a ``cp``
    over a shard while a load runs): each read is a short read, a ValueError naming the
    shard by its path in the checkpoint, not a SIGBUS through a memory map (which
    killed the process) nor ``/proc/self/fd/N``."""
    env = dict(os.environ, PYTHONPATH=str(Path(ts_moe.__file__).parents[1]))
    run = subprocess.run([sys.executable, "-c", _TRUNCATE_SHARDS, str(ckpt)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    (outcome,) = run.stdout.splitlines()
    assert outcome.startswith("ValueError: ") and re.search(
        rf"'{ckpt}/model-0000\d-of-0000\d\.safetensors' ends at byte \d+, before the \d+ "
        rf"bytes of tensor 'model\.layers\.0\.block_sparse_moe\.gate\.weight'", outcome), outcome
    assert "cut short" in outcome and "/proc/self/fd" not in outcome


@pytest.mark.parametrize("damage", ["header", "empty"])
def test_a_malformed_shard_is_a_value_error_naming_it(ckpt, damage):
    shard = _shards(ckpt)[-1]
    if damage == "header":
        shard.write_bytes((16).to_bytes(8, "little") + b"{not json at all}")
    else:
        shard.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"{INDEX}: weight_map\[.*\]: '{shard}' is not a "
                                         rf"valid safetensors file \(.*header"):
        ts_moe.load_mixtral_experts(ckpt, device="cpu")
    single = make_tiny_fp8_checkpoint(ckpt.parent / "single", naming="mixtral",
                                      scheme="channel", layers=1, hidden=64, intermediate=32,
                                      shards=1)
    (single / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(ValueError, match=rf"model\.safetensors: '{single}/model\.safetensors' "
                                         rf"is not a valid safetensors file"):
        load_fp8_experts(single, device="cpu")


def _rewrite_header(shard: Path, edit) -> None:
    """``shard`` with ``edit`` applied to its header (the JSON object), the data as it was."""
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    shard.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:])


@pytest.mark.parametrize("damage, why", [
    ("past the end", r"the tensors hold \d+ bytes of data, the file \d+"),
    ("overlapping", r"tensor '.*' starts at byte \d+ of the data, not at \d+"),
    ("wrong size", r"tensor '.*': data_offsets \[\d+, \d+\] do not hold BF16 of shape"),
    ("unknown dtype", r"the header's entry '.*' is not a dtype of the format"),
])
def test_a_header_whose_offsets_do_not_fit_the_file_is_refused_before_a_read(ckpt, damage,
                                                                              why):
    """The header's promises are checked against the file before any tensor is read
    (as safetensors checks them): offsets past the end, tensors that overlap or do not
    hold their shape's bytes, a dtype the format has not."""
    shard = _shards(ckpt)[0]

    def edit(header):
        first, second, *_, last = sorted((k for k in header if k != "__metadata__"),
                                         key=lambda k: header[k]["data_offsets"])
        if damage == "past the end":  # the last tensor a row longer than the file holds
            begin, end = header[last]["data_offsets"]
            header[last]["data_offsets"][1] += (end - begin) // header[last]["shape"][0]
            header[last]["shape"][0] += 1
        elif damage == "overlapping":
            header[second]["data_offsets"] = [o - 2 for o in header[second]["data_offsets"]]
        elif damage == "wrong size":
            header[first]["shape"][0] += 1
        else:
            header[first]["dtype"] = "BF17"

    _rewrite_header(shard, edit)
    with pytest.raises(ValueError, match=rf"'{shard}' is not a valid safetensors file "
                                         rf"\({why}"):
        ts_moe.load_mixtral_experts(ckpt, device="cpu")
