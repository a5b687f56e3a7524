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
        start = time.perf_counter()
        try:
            fn(path, 0, device="cpu")
            outcome = "no error"
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        results.append([outcome, time.perf_counter() - start])
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
