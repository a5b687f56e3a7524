"""The compiled kernels' disk cache: object files that only this user can have written.

A compiled kernel is an ELF object that the next process links into itself, so
the cache holds native code and is trusted only as far as its directory is.
The rules (pip's and Triton's):

- the directory is ``$TS_MOE_CACHE_DIR`` (an absolute path) or
  ``~/.cache/ts_moe``, with one subdirectory per :func:`fingerprint` (the
  kernel sources and the toolchain's versions); whatever is missing of that
  path is created ``0o700``;
- the cache directory, its fingerprint subdirectory and every directory
  created for them must be owned by the effective uid and not writable by its
  group or others, and an object must be a regular file of this uid (never a
  symlink); otherwise the kernels stay in memory for this process, with one
  warning that names the directory and the reason;
- an object is loaded only if it matches the sha256 stored beside it (written
  after the object), so a torn or corrupted file is a miss, recompiled;
- files are written under a fresh ``mkstemp`` name (``O_EXCL``, no symlink
  followed) and renamed into place: processes that share the directory, even
  with one pid each (containers), never write the same file;
- a directory that cannot be written (read-only, full, not a directory) is a
  warning, once, and memory only, never an error.

``TS_MOE_NO_DISK_CACHE=1`` keeps every kernel in memory, silently.
"""

import errno
import functools
import hashlib
import os
import pathlib
import re
import stat
import tempfile
import warnings

_SOURCES = [pathlib.Path(__file__).parent, pathlib.Path(__file__).parent.parent / "ts_pipeline"]
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")
# our files in a fingerprint directory: objects, their sha256, temporaries
_OURS = re.compile(r"\.?k_[0-9a-f]{24}(\.[A-Za-z0-9_]+)?\.(o|o\.sha256|tmp)")
_DISABLED = "TS_MOE_NO_DISK_CACHE=1"
_warned: set = set()
_unwritable: set = set()  # directories whose writes failed in this process


class KernelCacheWarning(UserWarning):
    """The disk cache is not used (or not for one object); kernels still work."""


def warn_once(topic: str, message: str) -> None:
    if topic not in _warned:
        _warned.add(topic)
        warnings.warn(f"ts_moe kernel cache: {message}", KernelCacheWarning, stacklevel=3)


@functools.cache
def fingerprint() -> str:
    """The kernel sources and the toolchain's versions: a new build, a new directory."""
    import cutlass
    import tvm_ffi

    h = hashlib.sha256(f"{cutlass.__version__}|{tvm_ffi.__version__}".encode())
    for root in _SOURCES:
        for path in sorted(root.glob("*.py")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def object_name(key: tuple) -> str:
    return "k_" + hashlib.sha256(repr(key).encode()).hexdigest()[:24]


def configured_root() -> tuple:
    """``(root, None)``: the cache directory asked for (not checked), or ``(None, why)``."""
    if os.environ.get("TS_MOE_NO_DISK_CACHE") == "1":
        return None, _DISABLED
    env = os.environ.get("TS_MOE_CACHE_DIR")
    if env:
        if not os.path.isabs(env):
            return None, (f"TS_MOE_CACHE_DIR={env!r} is a relative path (it would depend on "
                          f"the working directory): give an absolute one")
        return pathlib.Path(env), None
    try:
        home = pathlib.Path.home()
    except RuntimeError:
        return None, "no home directory for ~/.cache/ts_moe: set TS_MOE_CACHE_DIR"
    if not home.is_absolute():
        return None, f"the home directory {str(home)!r} is a relative path: set TS_MOE_CACHE_DIR"
    return home / ".cache" / "ts_moe", None


def _unsafe(path: pathlib.Path) -> str | None:
    """Why ``path`` may not hold our objects (a directory of ours that only we can
    write), or None."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _make_dirs(path: pathlib.Path) -> list:
    """Creates what is missing of ``path``, ``0o700``; the directories it created."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    created = []
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass  # made meanwhile by another process: checked like ours
        created.append(p)
    return created


def locate(create: bool = True) -> tuple:
    """``(directory, None)``: this build's checked cache directory, created if
    ``create`` (else possibly absent); or ``(None, why)``: memory only."""
    asked, why = configured_root()
    if asked is None:
        return None, why
    root = asked
    try:
        created = _make_dirs(root) if create else []
        root = pathlib.Path(os.path.realpath(root))
        if not root.exists():
            if create:
                return None, f"{asked} is not a directory"
            return root / fingerprint(), None  # not created yet
        for d in [root, *created]:
            why = _unsafe(d) if os.path.lexists(d) else None
            if why:
                return None, f"{d} {why}"
        directory = root / fingerprint()
        if create:
            _make_dirs(directory)
        why = _unsafe(directory) if os.path.lexists(directory) else None
        return (None, f"{directory} {why}") if why else (directory, None)
    except OSError as e:
        return None, f"{asked} cannot be used ({e.strerror or e}: {e.filename or asked})"


def directory() -> pathlib.Path | None:
    """The directory to load and store kernels in, or None (memory only, said once)."""
    found, why = locate()
    if found is None and why != _DISABLED:
        warn_once(why, f"{why}; compiled kernels stay in memory in this process")
    return found


def _read_nofollow(path: pathlib.Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def load(directory: pathlib.Path, name: str, loader):
    """``loader(path)`` of the object ``name`` if it is ours and intact, else None
    (a miss).  ``path`` names the very file that was checked (``/proc/self/fd``)."""
    path = directory / f"{name}.o"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        why = "is a symlink" if e.errno == errno.ELOOP else f"cannot be read ({e.strerror})"
        warn_once(f"object {directory}", f"{path} {why}: not loaded; recompiling")
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            warn_once(f"object {directory}", f"{path} is not a regular file of this uid that "
                                             f"only it can write: not loaded; recompiling")
            return None
        digest = hashlib.sha256(f.read()).hexdigest()
        stored = _read_nofollow(directory / f"{name}.o.sha256")
        if stored is None or stored.split()[:1] != [digest.encode()]:
            warn_once(f"integrity {directory}",
                      f"{path} does not match its sha256 file "
                      f"({'missing' if stored is None else 'differs'}): not loaded; recompiling "
                      f"(further mismatches in {directory} are not reported)")
            return None
        proc = f"/proc/self/fd/{fd}"
        try:
            return loader(proc if os.path.exists(proc) else str(path))
        except Exception as e:  # noqa: BLE001 (the kernel is compiled instead)
            warn_once(f"load {directory}", f"{path} could not be loaded ({e}); recompiling")
            return None


def _write_new(directory: pathlib.Path, name: str, suffix: str, write) -> None:
    """``write(tmp_path)`` to a fresh private file, then renamed to ``name + suffix``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=suffix, dir=directory)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, directory / f"{name}{suffix}")
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def store(directory: pathlib.Path, name: str, export) -> bool:
    """Writes the object ``name`` with ``export(path)``, then its sha256; False
    (with one warning, and no further writes there) if the directory cannot take it."""
    if directory in _unwritable:
        return False
    digest = []

    def export_and_hash(tmp):
        export(tmp)
        data = _read_nofollow(pathlib.Path(tmp))
        if data is None:
            raise OSError(errno.ENOENT, "the exported object vanished", tmp)
        digest.append(hashlib.sha256(data).hexdigest())

    def write_sha(tmp):
        with open(tmp, "w") as f:
            f.write(f"{digest[0]}  {name}.o\n")

    try:
        _write_new(directory, name, ".o", export_and_hash)
        _write_new(directory, name, ".o.sha256", write_sha)
    except Exception as e:  # noqa: BLE001 (the compiled kernel works without its copy)
        _unwritable.add(directory)
        warn_once(f"write {directory}", f"cannot write to {directory} ({e}); compiled kernels "
                                        f"stay in memory in this process")
        return False
    return True


def usage(root: pathlib.Path) -> dict:
    """``{fingerprint: (objects, bytes)}`` of our files under ``root``."""
    found = {}
    for sub in _fingerprint_dirs(root):
        objects = size = 0
        for entry in os.scandir(sub):
            if _OURS.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                if entry.name.endswith(".o") and not entry.name.startswith("."):
                    objects += 1
                size += entry.stat(follow_symlinks=False).st_size
        found[sub.name] = (objects, size)
    return found


def clear(root: pathlib.Path) -> tuple:
    """Removes our files (and then empty fingerprint directories) under ``root``;
    ``(files, bytes)`` removed.  Anything else there stays."""
    files = size = 0
    for sub in _fingerprint_dirs(root):
        for entry in os.scandir(sub):
            if _OURS.fullmatch(entry.name) and not entry.is_dir(follow_symlinks=False):
                size += entry.stat(follow_symlinks=False).st_size
                os.unlink(entry.path)
                files += 1
        try:
            os.rmdir(sub)
        except OSError:
            pass  # something not ours is left in it
    return files, size


def _fingerprint_dirs(root: pathlib.Path) -> list:
    if not root.is_dir():
        return []
    return sorted(pathlib.Path(e.path) for e in os.scandir(root)
                  if _FINGERPRINT.fullmatch(e.name) and e.is_dir(follow_symlinks=False))
