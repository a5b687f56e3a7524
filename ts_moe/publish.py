"""Writing a checkpoint directory whole, through a path no one else can redirect: what
the tiny-checkpoint makers (:mod:`ts_moe.tiny`) write with.

- The path is trusted as far as its least protected component, by the kernel cache's
  rules (:mod:`csrc_free_kernels.common.kernel_cache_path`): every directory from
  ``/`` to ``out_dir``'s parent this uid's or root's and writable by no one else unless
  sticky (``/tmp``), a symlink on the way followed only if this uid or root owns it;
  ``out_dir`` itself, where it exists, a directory (not a link) of this uid that no one
  else can write.  So root making a checkpoint never writes through another user's link
  or into a directory another user can rename, at any depth.
- The files are written into a fresh directory beside ``out_dir`` and put in its place
  by one rename (an exchange with the old one where the kernel has ``renameat2``), then
  what was there is removed: a reader sees the old checkpoint or the new one, never a
  mix, and never an earlier checkpoint's index or shards beside the new files; a write
  cut short leaves the old checkpoint as it was.  An ``out_dir`` holding anything but a
  checkpoint's files (:data:`CHECKPOINT_FILE`) is refused before anything is written,
  so nothing of the caller's is removed.
"""

import contextlib
import ctypes
import errno
import os
import re
import secrets
import stat
from pathlib import Path

from csrc_free_kernels.common import kernel_cache_path
from csrc_free_kernels.common.kernel_cache_path import Unsafe

# the names a checkpoint's writers (ts_moe.tiny, transformers' save_pretrained) give
# its files, and an interrupted write's temporary file: what re-making one may remove
CHECKPOINT_FILE = re.compile(r"(generation_)?config\.json|model\.safetensors(\.index\.json)?|"
                             r"model-\d{5}-of-\d{5}\.safetensors|\..+\.[0-9a-f]{16}\.tmp")
_DIR_MODE = 0o755  # a fresh checkpoint directory (less what the umask takes): this user writes
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_RENAME_EXCHANGE = 2


def publish(out_dir, files: dict[str, bytes]) -> Path:
    """``files`` (name -> bytes) as the whole content of the directory ``out_dir``
    (module docstring); ``out_dir`` returned.  ValueError naming the component of its
    path that may not be trusted, or what in ``out_dir`` is not a checkpoint's file."""
    out_dir = Path(out_dir)
    parent, name = os.path.split(os.path.abspath(out_dir))
    if not name:
        raise ValueError(f"out_dir {str(out_dir)!r} names no directory to write")
    try:
        parent_fd = kernel_cache_path.open_path(parent, True, kernel_cache_path.check_ancestor)
    except Unsafe as exc:
        raise ValueError(f"out_dir {str(out_dir)!r} is not written: {exc}; every directory "
                         f"on its path must be this user's or root's and writable by no one "
                         f"else (sticky ones such as /tmp excepted), a link on it this "
                         f"user's or root's") from None
    try:
        old_fd = _open_old(parent_fd, parent, name, out_dir)
        try:
            _replace(parent_fd, parent, name, old_fd, files)
        finally:
            if old_fd is not None:
                os.close(old_fd)
    finally:
        os.close(parent_fd)
    return out_dir


def _open_old(parent_fd: int, parent: str, name: str, out_dir: Path) -> int | None:
    """The existing ``out_dir`` (checked as the kernel cache's own directory, holding
    only a checkpoint's files), or None."""
    try:
        fd = kernel_cache_path.open_child(parent_fd, parent, name, create=False)
    except Unsafe as exc:
        hint = ": pass the directory it links to" if exc.why == "is a symlink" else ""
        raise ValueError(f"out_dir {str(out_dir)!r} {exc.why}{hint}") from None
    if fd is None:
        return None
    try:
        for entry in os.listdir(fd):
            kind = os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode
            if not CHECKPOINT_FILE.fullmatch(entry) or stat.S_ISDIR(kind):
                raise ValueError(f"out_dir {str(out_dir)!r} holds {entry!r}, which is not a "
                                 f"checkpoint's file: making a checkpoint there would remove "
                                 f"it (pass an empty directory, or one holding a checkpoint)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _replace(parent_fd: int, parent: str, name: str, old_fd: int | None,
             files: dict[str, bytes]) -> None:
    """``files`` written into a fresh directory beside ``name`` (in ``parent``), which then
    takes its place; the old directory (``old_fd``), if any, emptied of its checkpoint and
    removed."""
    fresh = f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        os.mkdir(fresh, _DIR_MODE, dir_fd=parent_fd)
    except PermissionError as exc:
        raise PermissionError(exc.errno, f"{parent!r} cannot be written: a checkpoint is "
                                         f"written beside {name!r} there, then takes its "
                                         f"place whole") from None
    fresh_fd = os.open(fresh, kernel_cache_path.DIR_FLAGS, dir_fd=parent_fd)
    try:
        try:
            for file, data in files.items():
                _write(fresh_fd, file, data)
            if old_fd is None:
                os.rename(fresh, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
            elif not _exchange(parent_fd, fresh, name):  # two renames: out_dir briefly absent
                _rename(parent_fd, name, fresh + ".old")
                try:
                    _rename(parent_fd, fresh, name)
                except BaseException:
                    _rename(parent_fd, fresh + ".old", name)
                    raise
                fresh += ".old"
        except BaseException:
            _remove(parent_fd, fresh, fresh_fd, None)  # the new files; the old stay as they were
            raise
    finally:
        os.close(fresh_fd)
    if old_fd is not None:  # now under the fresh name
        _remove(parent_fd, fresh, old_fd, CHECKPOINT_FILE)


def _rename(dir_fd: int, src: str, dst: str) -> None:
    os.rename(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _write(dir_fd: int, name: str, data: bytes) -> None:
    fd = os.open(name, _FILE_FLAGS, 0o644, dir_fd=dir_fd)
    with open(fd, "wb") as f:
        f.write(data)


def _exchange(dir_fd: int, a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` in ``dir_fd`` in one step; False where this kernel
    or file system cannot (then nothing happened)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def _remove(parent_fd: int, name: str, fd: int, only: re.Pattern | None) -> None:
    """The directory ``name`` (open at ``fd``) emptied of its files (those whose names
    ``only`` matches, where given), then removed if that left it empty: a file that
    appeared there meanwhile stays, with the directory."""
    with contextlib.suppress(OSError):
        for entry in os.listdir(fd):
            if only is None or only.fullmatch(entry):
                with contextlib.suppress(IsADirectoryError, PermissionError):
                    os.unlink(entry, dir_fd=fd)
        os.rmdir(name, dir_fd=parent_fd)
