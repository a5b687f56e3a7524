"""The tiny-checkpoint makers write only into the directory they are given, never
through a link planted there: root making a checkpoint in a directory another user
prepared must not overwrite what that user's links point at."""

import os

import pytest
import torch

import ts_moe
from ts_moe.tiny import make_tiny_checkpoint, make_tiny_mixtral

NAMES = ("config.json", "model.safetensors", "model.safetensors.index.json",
         "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _plant_links(out, victim):
    """Every name a maker writes, a link to ``victim``; the victim's bytes."""
    out.mkdir()
    victim.write_bytes(b"precious")
    for name in NAMES:
        (out / name).symlink_to(victim)


def _unlink_leftovers(out):
    """The planted links of names this checkpoint does not use (the loader refuses them)."""
    for name in NAMES:
        if (out / name).is_symlink():
            (out / name).unlink()


@pytest.mark.parametrize("shards", [1, 2])
def test_a_planted_link_is_replaced_not_written_through(tmp_path, shards):
    out, victim = tmp_path / "prepared", tmp_path / "victim"
    _plant_links(out, victim)
    make_tiny_checkpoint(out, layers=1, experts=4, shards=shards)
    assert victim.read_bytes() == b"precious"
    written = [n for n in NAMES if not (out / n).is_symlink()]
    assert "config.json" in written and all((out / n).is_file() for n in written)
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]
    _unlink_leftovers(out)
    weights = ts_moe.load_mixtral_experts(out, device="cpu")
    assert weights[0]["router"].shape == (4, 64)


def test_make_tiny_mixtral_writes_no_link_either(tmp_path):
    pytest.importorskip("transformers")
    out, victim = tmp_path / "prepared", tmp_path / "victim"
    _plant_links(out, victim)
    make_tiny_mixtral(out, layers=1, experts=4, shards=1)
    assert victim.read_bytes() == b"precious"
    assert not (out / "config.json").is_symlink() and (out / "generation_config.json").is_file()
    _unlink_leftovers(out)
    weights = ts_moe.load_mixtral_experts(out, device="cpu")
    assert weights[0]["gate_up_proj"].dtype == torch.bfloat16


def test_an_out_dir_that_is_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").symlink_to(elsewhere)
    with pytest.raises(ValueError, match=rf"out_dir '{tmp_path / 'out'}' is a symlink"):
        make_tiny_checkpoint(tmp_path / "out", layers=1)
    assert os.listdir(elsewhere) == []
