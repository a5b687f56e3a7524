"""The kernel cache's writes leave no moment where a load finds an object that does
not match its sha256: concurrent first writes of one kernel, or a write cut short
(a full disk), are never reported as a damaged object; and the cache directory's
path is walked as the kernel would resolve it, ``..`` after a missing directory
included, creating nothing that path does not name.

The stand-in DSL of tests/test_kernel_cache.py: an "object" is bytes."""

import errno
import os
from pathlib import Path

import pytest

from csrc_free_kernels.common import kernel_cache

from .test_kernel_cache import cache_warnings, dsl, fresh, get, new_process  # noqa: F401

OTHER = b"\x7fELF the same kernel, compiled by another process"


def _write_other(name: str) -> None:
    """Another process's whole write of an object of ``name``, with other bytes."""
    with kernel_cache.directory() as directory:
        assert kernel_cache.store(directory, name, lambda path: Path(path).write_bytes(OTHER))


def test_concurrent_first_writes_leave_only_whole_objects(dsl, tmp_path, monkeypatch, recwarn):
    """Two processes write the first object of one kernel (the DSL need not give the
    same bytes twice): the second writes all of its own between the first one's
    renames.  A later load finds a whole object, whichever it is, and says nothing."""
    real_replace, seen = os.replace, []

    def replace(src, dst, **kwargs):
        real_replace(src, dst, **kwargs)
        if not seen:  # the first rename of the first writer: the other writes now
            seen.append(dst)
            _write_other(dst.split(".")[0])

    monkeypatch.setattr(os, "replace", replace)
    assert get()[1] == "compiled"
    monkeypatch.setattr(os, "replace", real_replace)
    new_process()
    fn, how = get()
    assert how == "loaded" and fn[1] in (b"\x7fELF good", OTHER)
    assert cache_warnings(recwarn) == []


@pytest.mark.parametrize("fails", [1, 2], ids=["first rename", "second rename"])
def test_a_write_cut_short_is_never_a_damaged_object(dsl, tmp_path, monkeypatch, recwarn,
                                                     fails):
    """The disk fills at a rename of the write: that write's warning, and then
    either the whole object or nothing, never one that disagrees with its sha256."""
    real_replace, calls = os.replace, []

    def replace(src, dst, **kwargs):
        calls.append(dst)
        if len(calls) == fails:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    assert get()[1] == "compiled"
    monkeypatch.setattr(os, "replace", real_replace)
    new_process()
    fn, how = get()
    assert how == "compiled" or fn == ("loaded", b"\x7fELF good")
    assert not [m for m in cache_warnings(recwarn) if "sha256" in m]
    (build,) = (tmp_path / "cache").iterdir()
    assert not [p for p in os.listdir(build) if p.startswith(".")]  # no temporary left


@pytest.mark.parametrize("asked, used", [("d/missing/../c", "d/c"),
                                         ("d/missing/x/../../c", "d/c"),
                                         ("d/m1/m2/..", "d/m1")])
def test_a_missing_directory_left_by_dotdot_is_not_created(dsl, tmp_path, monkeypatch, recwarn,
                                                           asked, used):
    (tmp_path / "d").mkdir()
    monkeypatch.setenv("TS_MOE_CACHE_DIR", f"{tmp_path}/{asked}")
    assert get()[1] == "compiled"
    new_process()
    assert get()[1] == "loaded" and cache_warnings(recwarn) == []
    (obj,) = (tmp_path / used).glob("*/k_*.o")
    made = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "d").rglob("*")
                  if p.is_dir())
    assert made == [used, f"{used}/{obj.parent.name}"]  # nothing the path does not name
