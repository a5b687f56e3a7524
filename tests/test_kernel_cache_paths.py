"""The kernel cache trusts a path only as far as its least protected component:
every directory from ``/`` is this uid's or root's and writable by no one else
(sticky directories above the cache allowed), symlinks on the way are this
uid's or root's, the directory is used through one descriptor opened before
the compile, an object with a second name is refused, and ``cache --clear``
deletes nothing outside the cache.

As in tests/test_kernel_cache.py, root plays both users: a chown to an unused
uid stands in for the attacker, and "objects" are bytes (its stand-in DSL)."""

import hashlib
import os
from pathlib import Path

import pytest

from csrc_free_kernels.common import kernel_cache
from ts_moe import __main__ as ts_moe_main

from .test_kernel_cache import (OTHER_UID, PLANTED, cache_warnings, dsl, fresh,  # noqa: F401
                                get, needs_root, new_process, plant)

pytestmark = needs_root


def seed_at(root: Path, monkeypatch, key="k0"):
    """One kernel stored with ``TS_MOE_CACHE_DIR=root``: (its build directory, its object)."""
    monkeypatch.setenv("TS_MOE_CACHE_DIR", str(root))
    before = set(root.glob("*/k_*.o"))
    get(key=key)
    (obj,) = set(root.glob("*/k_*.o")) - before
    new_process()
    return obj.parent, obj


def listing(path: Path) -> dict:
    """Every name under ``path`` with its bytes (files) or target (symlinks)."""
    found = {}
    for p in sorted(path.rglob("*")):
        found[str(p)] = (os.readlink(p) if p.is_symlink() else
                         p.read_bytes() if p.is_file() else "dir")
    return found


def assert_refused(dsl, recwarn, planted_obj: Path, *words):
    """Compiled, not loaded, the planted object untouched, one warning with ``words``."""
    before = listing(planted_obj.parent)
    fn, how = get()
    assert how == "compiled" and fn is not None and dsl.loaded == []
    assert listing(planted_obj.parent) == before  # nothing written there
    (message,) = cache_warnings(recwarn)
    assert "memory" in message
    for word in words:
        assert word in message, (word, message)
    assert get(key="k1")[1] == "compiled" and len(cache_warnings(recwarn)) == 1


# ---------------------------------------------------------------- symlinks

@pytest.mark.parametrize("where", ["the cache directory", "a directory on the way"])
def test_a_symlink_another_user_owns_is_not_followed(dsl, tmp_path, monkeypatch, recwarn,
                                                     where):
    """Their symlink (planted in /tmp before first use) to a root-owned directory
    holding files they wrote, as a repository cloned by root would."""
    _, obj = seed_at(tmp_path / "repo" / "cache", monkeypatch)
    obj = plant(obj)
    if where == "the cache directory":
        link = tmp_path / "link"
        link.symlink_to(tmp_path / "repo" / "cache")
        monkeypatch.setenv("TS_MOE_CACHE_DIR", str(link))
    else:
        link = tmp_path / "via"
        link.symlink_to(tmp_path / "repo")
        monkeypatch.setenv("TS_MOE_CACHE_DIR", str(link / "cache"))
    os.lchown(link, OTHER_UID, OTHER_UID)
    assert_refused(dsl, recwarn, obj, f"{link} is a symlink owned by uid {OTHER_UID}")


def test_a_symlink_of_this_uid_is_followed_and_its_target_checked(dsl, tmp_path, monkeypatch,
                                                                  recwarn):
    _, obj = seed_at(tmp_path / "real" / "cache", monkeypatch)
    link = tmp_path / "link"
    link.symlink_to(Path("real") / "cache")     # relative, resolved from the link's directory
    monkeypatch.setenv("TS_MOE_CACHE_DIR", str(link))
    assert get() == (("loaded", b"\x7fELF good"), "loaded")

    new_process()
    dsl.loaded.clear()
    obj = plant(obj)
    os.chmod(tmp_path / "real", 0o777)          # the target's parent: anyone can swap it
    assert_refused(dsl, recwarn, obj, f"{tmp_path / 'real'} is writable by its group or others")


def test_a_build_directory_that_is_a_symlink_is_refused(dsl, tmp_path, monkeypatch, recwarn):
    """Even our own symlink: the build directory is opened without following one."""
    build, obj = seed_at(tmp_path / "cache", monkeypatch)
    os.rename(build, tmp_path / "elsewhere")
    build.symlink_to(tmp_path / "elsewhere")
    assert_refused(dsl, recwarn, tmp_path / "elsewhere" / obj.name, f"{build} is a symlink")


# ---------------------------------------------------------------- parents

@pytest.mark.parametrize("perms", [0o777, 0o2775, 0o770], ids=["0777", "2775", "0770"])
def test_a_parent_others_can_write_is_refused(dsl, tmp_path, monkeypatch, recwarn, capsys,
                                              perms):
    """A team directory: anyone in it can rename the cache away and put a symlink there."""
    team = tmp_path / "team"
    _, obj = seed_at(team / "cache", monkeypatch)
    obj = plant(obj)
    os.chmod(team, perms)
    assert_refused(dsl, recwarn, obj, f"{team} is writable by its group or others",
                   f"mode {perms:o}")
    capsys.readouterr()
    assert ts_moe_main.main(["cache", "--clear"]) == 1
    assert f"{team} is writable" in capsys.readouterr().out and obj.read_bytes() == PLANTED


@pytest.mark.parametrize("cache_owner", ["theirs", "root's"])
def test_another_users_home_is_refused(dsl, tmp_path, monkeypatch, recwarn, cache_owner):
    """``sudo -E``: HOME is another user's, so ``~/.cache/ts_moe`` is theirs to replace."""
    home = tmp_path / "home"
    _, obj = seed_at(home / ".cache" / "ts_moe", monkeypatch)
    obj = plant(obj)
    os.chmod(home, 0o755)
    for d in (home, home / ".cache"):
        os.chown(d, OTHER_UID, OTHER_UID)
    if cache_owner == "theirs":
        for p in [home / ".cache" / "ts_moe", *(home / ".cache" / "ts_moe").rglob("*")]:
            os.chown(p, OTHER_UID, OTHER_UID)
    monkeypatch.delenv("TS_MOE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(home))
    assert_refused(dsl, recwarn, obj, f"{home} is owned by uid {OTHER_UID}")


@pytest.mark.parametrize("case", ["root's sticky ancestor", "another user's sticky ancestor",
                                  "sticky cache directory", "sticky build directory"])
def test_a_sticky_directory_is_allowed_only_above_the_cache(dsl, tmp_path, monkeypatch,
                                                            recwarn, case):
    """Like /tmp: no one can rename another user's entry in a sticky directory,
    except its owner; our own directories must not be writable by others at all."""
    sticky = tmp_path / "shared"
    build, obj = seed_at(sticky / "cache", monkeypatch)
    os.chmod(sticky, 0o1777)
    if case == "root's sticky ancestor":
        assert get() == (("loaded", b"\x7fELF good"), "loaded")
        assert cache_warnings(recwarn) == []
        return
    obj = plant(obj)
    if case == "another user's sticky ancestor":
        os.chown(sticky, OTHER_UID, OTHER_UID)
        words = [f"{sticky} is owned by uid {OTHER_UID}"]
    else:
        target = sticky / "cache" if case == "sticky cache directory" else build
        os.chmod(target, 0o1777)
        words = [f"{target} is writable by its group or others (mode 1777)",
                 "sticky directory is allowed only above the cache directory"]
    assert_refused(dsl, recwarn, obj, *words)


# ---------------------------------------------------------------- one descriptor

def test_a_swap_during_the_export_writes_nothing_outside(dsl, tmp_path, monkeypatch):
    """The cache directory renamed away and replaced by a symlink to a victim
    directory while the kernel compiles: the object still goes to the directory
    that was checked, and the victim's files keep their bytes."""
    build, obj = seed_at(tmp_path / "cache", monkeypatch)
    obj.unlink()
    victim = tmp_path / "victim" / build.name
    victim.mkdir(parents=True)
    for name in (obj.name, f"{obj.name.split('.')[0]}.o"):
        (victim / name).write_bytes(b"precious")
        os.chmod(victim / name, 0o600)
    before = listing(tmp_path / "victim")

    def swap():
        os.rename(tmp_path / "cache", tmp_path / "away")
        (tmp_path / "cache").symlink_to(tmp_path / "victim")

    dsl.during_export = swap
    assert get()[1] == "compiled"
    assert listing(tmp_path / "victim") == before
    moved = tmp_path / "away" / build.name / obj.name
    assert moved.read_bytes() == b"\x7fELF good"
    assert moved.name.split(".")[1] == hashlib.sha256(b"\x7fELF good").hexdigest()
    assert dsl.exported[-1][0].startswith("/proc/self/fd/")  # no name to redirect


def test_an_object_with_a_second_name_is_refused(dsl, tmp_path, monkeypatch, recwarn):
    """Another name (in a directory someone else can write) could change the object."""
    _, obj = seed_at(tmp_path / "cache", monkeypatch)
    os.link(obj, tmp_path / "second-name")
    _, how = get()
    assert how == "compiled" and dsl.loaded == []
    (message,) = cache_warnings(recwarn)
    assert str(obj) in message and "2 hard links" in message
    assert (tmp_path / "second-name").read_bytes() == b"\x7fELF good"
    new_process()                    # rewritten under one name: loaded next time
    assert get()[1] == "loaded" and os.stat(obj).st_nlink == 1


# ---------------------------------------------------------------- clear

FP, OBJ = "0123456789abcdef", "k_" + "a" * 24 + ".o"


def victim_cache(path: Path) -> None:
    """A directory that looks like a cache: a build with objects named like ours."""
    (path / FP).mkdir(parents=True)
    for name in (OBJ, f"{OBJ}.sha256", f".{OBJ[:-2]}.x1y2z3.o"):
        (path / FP / name).write_bytes(b"precious")


@pytest.mark.parametrize("case", ["another user's symlink", "our symlink, writable parent",
                                  "symlinks inside the cache"])
def test_clear_deletes_nothing_outside_the_cache(dsl, tmp_path, monkeypatch, capsys, case):
    victim = tmp_path / "team" / "victim"
    victim_cache(victim)
    link = tmp_path / "cache"
    if case == "symlinks inside the cache":
        build, _ = seed_at(link, monkeypatch)
        (link / "fedcba9876543210").symlink_to(victim / FP)          # a build that is a symlink
        (build / f"k_{'b' * 24}.o").symlink_to(victim / FP / OBJ)  # an object that is one
    else:
        link.symlink_to(victim)
        monkeypatch.setenv("TS_MOE_CACHE_DIR", str(link))
        if case == "another user's symlink":
            os.lchown(link, OTHER_UID, OTHER_UID)
        else:
            os.chmod(tmp_path / "team", 0o777)
    before = listing(victim)
    capsys.readouterr()
    code = ts_moe_main.main(["cache", "--clear"])
    out = capsys.readouterr().out
    assert listing(victim) == before
    if case == "symlinks inside the cache":
        assert code == 0 and "removed 2 files" in out        # the object, the symlink
        assert [p.name for p in link.rglob("*")] == ["fedcba9876543210"]
    else:
        assert code == 1 and "memory only" in out
        assert ("is a symlink owned by uid" if case == "another user's symlink"
                else "is writable by its group or others") in out

