"""The tiny-checkpoint makers write only into the directory they are given, never
through a link another user planted there or anywhere on its path: root making a
checkpoint in a directory another user could redirect must not overwrite what that
user's links point at.  And they write it whole (ts_moe.publish): an earlier
checkpoint's index and shards do not survive beside the new files, and a write cut
short leaves the old checkpoint as it was.

As in tests/test_kernel_cache.py, root plays both users: a chown to an unused uid
stands in for the other one."""

import json
import os

import pytest
import torch

import ts_moe
from ts_moe import publish
from ts_moe.tiny import make_tiny_checkpoint, make_tiny_mixtral

from .test_kernel_cache import OTHER_UID, needs_root

NAMES = ("config.json", "model.safetensors", "model.safetensors.index.json",
         "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"


def _plant_links(out, victim):
    """Every name a maker writes, a link to ``victim``; the victim's bytes."""
    out.mkdir()
    victim.write_bytes(b"precious")
    for name in NAMES:
        (out / name).symlink_to(victim)


def _listing(path) -> dict:
    """Every name under ``path`` with its bytes (files) or target (links)."""
    return {str(p.relative_to(path)): os.readlink(p) if p.is_symlink() else
            p.read_bytes() if p.is_file() else "dir" for p in sorted(path.rglob("*"))}


def _files(out) -> set:
    """The files of the checkpoint at ``out``: config.json, and model.safetensors or the
    index and the shards it names."""
    if not (out / INDEX).exists():
        return {"config.json", "model.safetensors"}
    return {"config.json", INDEX, *json.loads((out / INDEX).read_text())["weight_map"].values()}


@pytest.mark.parametrize("shards", [1, 2])
def test_a_planted_link_is_replaced_not_written_through(tmp_path, shards):
    out, victim = tmp_path / "prepared", tmp_path / "victim"
    _plant_links(out, victim)
    make_tiny_checkpoint(out, layers=1, experts=4, shards=shards)
    assert victim.read_bytes() == b"precious"
    assert set(os.listdir(out)) == _files(out)  # the links gone with the old content
    assert not any((out / n).is_symlink() for n in os.listdir(out))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no scratch
    weights = ts_moe.load_mixtral_experts(out, device="cpu")
    assert weights[0]["router"].shape == (4, 64)


def test_make_tiny_mixtral_writes_no_link_either(tmp_path):
    pytest.importorskip("transformers")
    out, victim = tmp_path / "prepared", tmp_path / "victim"
    _plant_links(out, victim)
    make_tiny_mixtral(out, layers=1, experts=4, shards=1)
    assert victim.read_bytes() == b"precious"
    assert not (out / "config.json").is_symlink() and (out / "generation_config.json").is_file()
    assert not (out / INDEX).exists()
    weights = ts_moe.load_mixtral_experts(out, device="cpu")
    assert weights[0]["gate_up_proj"].dtype == torch.bfloat16


def test_an_out_dir_that_is_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").symlink_to(elsewhere)
    with pytest.raises(ValueError, match=rf"out_dir '{tmp_path / 'out'}' is a symlink"):
        make_tiny_checkpoint(tmp_path / "out", layers=1)
    assert os.listdir(elsewhere) == []


# ---------------------------------------------------- the whole path, as the kernel cache's

@needs_root
@pytest.mark.parametrize("depth", [1, 2])
def test_another_users_link_above_out_dir_is_not_followed(tmp_path, depth):
    """Their symlink one (or two) levels above ``out_dir``, to a directory root owns:
    refused by name, nothing created or written behind it."""
    target = tmp_path / "roots"
    target.mkdir()
    link = tmp_path / "via"
    link.symlink_to(target)
    os.lchown(link, OTHER_UID, OTHER_UID)
    out = link / "sub" / "ckpt" if depth == 2 else link / "ckpt"
    with pytest.raises(ValueError, match=rf"out_dir '{out}' is not written: {link} is a "
                                         rf"symlink owned by uid {OTHER_UID}"):
        make_tiny_checkpoint(out, layers=1)
    assert os.listdir(target) == []


@needs_root
@pytest.mark.parametrize("owner, mode, why", [
    (OTHER_UID, 0o755, f"is owned by uid {OTHER_UID}"),
    (0, 0o777, "is writable by its group or others and not sticky"),
])
def test_a_directory_on_the_way_another_user_controls_is_refused(tmp_path, owner, mode, why):
    """A directory above ``out_dir`` that another user owns, or anyone can write: they
    could rename what root makes in it and put a link in its place."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, owner, owner)
    theirs.chmod(mode)
    with pytest.raises(ValueError, match=rf"out_dir '{theirs / 'ckpt'}' is not written: "
                                         rf"{theirs} {why}"):
        make_tiny_checkpoint(theirs / "ckpt", layers=1)
    assert os.listdir(theirs) == []


@needs_root
def test_an_out_dir_another_user_owns_is_refused(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    os.chown(out, OTHER_UID, OTHER_UID)
    with pytest.raises(ValueError, match=rf"out_dir '{out}' is owned by uid {OTHER_UID}"):
        make_tiny_checkpoint(out, layers=1)
    assert os.listdir(out) == []


def test_sticky_tmp_and_missing_parents_are_fine(tmp_path):
    """A sticky world-writable directory on the way (as /tmp) is allowed; missing
    directories are made, private."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    out = make_tiny_checkpoint(sticky / "a" / "b" / "ckpt", layers=1, shards=1)
    assert (sticky / "a").stat().st_mode & 0o777 == 0o700
    assert ts_moe.load_mixtral_experts(out, device="cpu")[0]["router"].shape == (4, 64)


# ------------------------------------------------------------------ written whole

@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two renames"])
def test_remaking_over_a_sharded_checkpoint_leaves_none_of_it(tmp_path, monkeypatch, exchange):
    """A single-file checkpoint made where a sharded one was: the loader reads the new
    weights, not the old index's (the directories exchanged in one step, or, where the
    kernel cannot, by two renames)."""
    if not exchange:
        monkeypatch.setattr(publish, "_exchange", lambda *args: False)
    out = tmp_path / "ckpt"
    make_tiny_checkpoint(out, layers=1, shards=3, seed=1)
    old = ts_moe.load_mixtral_experts(out, device="cpu")[0]
    make_tiny_checkpoint(out, layers=1, shards=1, seed=2)
    assert set(os.listdir(out)) == {"config.json", "model.safetensors"}
    new = ts_moe.load_mixtral_experts(out, device="cpu")[0]
    fresh = ts_moe.load_mixtral_experts(make_tiny_checkpoint(tmp_path / "fresh", layers=1,
                                                             shards=1, seed=2), device="cpu")[0]
    assert not torch.equal(new["router"], old["router"])
    for name, tensor in fresh.items():
        assert torch.equal(new[name], tensor), name
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "fresh"]  # the old directory removed


@pytest.mark.parametrize("failing", [1, 3])
def test_a_write_cut_short_leaves_the_old_checkpoint(tmp_path, monkeypatch, failing):
    """The ``failing``-th file's write fails (a full disk): the directory holds the old
    checkpoint byte for byte, and no scratch directory is left beside it."""
    out = tmp_path / "ckpt"
    make_tiny_checkpoint(out, layers=1, shards=3, seed=1)
    before = _listing(tmp_path)
    real_write, written = publish._write, []

    def write_then_fail(dir_fd, name, data):
        written.append(name)
        if len(written) == failing:
            raise OSError(28, "No space left on device")
        real_write(dir_fd, name, data)

    monkeypatch.setattr(publish, "_write", write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        make_tiny_checkpoint(out, layers=1, shards=2, seed=2)
    assert _listing(tmp_path) == before


def test_an_out_dir_holding_something_else_is_refused_untouched(tmp_path):
    out = tmp_path / "ckpt"
    make_tiny_checkpoint(out, layers=1, shards=2)
    (out / "notes.txt").write_text("mine")
    (out / "tokenizer").mkdir()
    before = _listing(tmp_path)
    with pytest.raises(ValueError, match=rf"out_dir '{out}' holds '(notes\.txt|tokenizer)', "
                                         rf"which is not a checkpoint's file"):
        make_tiny_checkpoint(out, layers=1, shards=1)
    assert _listing(tmp_path) == before


def test_the_checkpoint_names_are_what_the_makers_write(tmp_path):
    """What re-making may remove is what the makers write (and nothing else)."""
    for shards in (1, 3):
        path = make_tiny_checkpoint(tmp_path / f"s{shards}", layers=2, shards=shards)
        assert all(publish.CHECKPOINT_FILE.fullmatch(n) for n in os.listdir(path))
        index = path / INDEX
        if index.exists():
            assert set(json.loads(index.read_text())["weight_map"].values()) <= set(
                os.listdir(path))
    for name in ("notes.txt", "tokenizer.json", "model.bin", "config.json.bak", "x.safetensors"):
        assert not publish.CHECKPOINT_FILE.fullmatch(name), name
