"""The compiled kernels' disk cache: object files that only this user (or root)
can have written.

A compiled kernel is an ELF object that the next process links into itself, so
the cache holds native code and is trusted only as far as every directory on
its path is.  The rules:

- the directory is ``settings.cache_dir`` (``$TS_MOE_CACHE_DIR``, an absolute
  path; :mod:`.settings`) or ``~/.cache/ts_moe``, with one subdirectory per :func:`fingerprint` (the
  kernel sources and the toolchain's versions); whatever is missing of that
  path is created ``0o700``;
- the path is walked from ``/`` (:mod:`.kernel_cache_path`): every directory
  on the way is owned by this uid or root and not writable by its group or
  others unless it is sticky (like ``/tmp``); the cache directory and its
  fingerprint subdirectory are this uid's and writable by no one else, sticky
  or not; a symlink is followed only if this uid or root owns it, and its
  target is walked by the same rules;
- the fingerprint directory is opened once (``O_DIRECTORY | O_NOFOLLOW``,
  component by component) and every load, write, rename and removal is
  relative to that descriptor, so renaming a directory on the way after the
  check redirects nothing;
- an object is loaded only if it is a regular file of this uid that no one
  else can write, with a single link (another name could change it), and
  matches the sha256 its name carries (``k_<key>.<sha256>.o``).  The sha256 is
  a corruption check (a torn or damaged file is a miss, recompiled), not an
  integrity check: whoever can write the object can rename it too.  The
  protection is that no one but this uid or root can write anywhere on the path;
- an object is written under a fresh random name (``O_EXCL``, no symlink
  followed) created in that directory, exported into it through
  ``/proc/self/fd``, hashed, and renamed to the name of its key and sha256 in
  one step: processes that share the directory, even with one pid each
  (containers), never write the same file, and no moment exists where an object
  and its sha256 disagree (concurrent first writes of one kernel each publish a
  whole object, which any of them may load; a write cut short, by a full disk
  say, publishes nothing);
- :func:`clear` removes only our file names, in the fingerprint-named
  subdirectories of a cache directory that passes the same checks, relative to
  their descriptors and never through a symlink;
- a path that fails a check costs one warning naming the component and the
  reason, as does a directory that cannot be written (read-only, full, not a
  directory); the kernels then stay in memory for this process, never an error.

``TS_MOE_NO_DISK_CACHE=1`` (``settings.disk_cache = False``) keeps every kernel in
memory, silently.  A relative ``TS_MOE_CACHE_DIR`` is a warning, not an error, as is
every reason above: the cache saves compile time, and no choice of it stops a kernel.
"""

import contextlib
import errno
import functools
import hashlib
import os
import pathlib
import re
import secrets
import stat
import warnings

from . import kernel_cache_path
from .settings import settings, shown

_PACKAGE = pathlib.Path(__file__).resolve().parent.parent  # csrc_free_kernels
_SOURCES = [_PACKAGE, _PACKAGE.parent / "ts_pipeline"]
# what no compiled object depends on: the packages' records and exports (a status update
# must not send every user's kernels to be compiled again), the build lists, the PTX tool
_NOT_SOURCES = {"__init__.py", "families.py", "family.py", "ptx_dump.py"}
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")
# our files in a fingerprint directory: objects and temporaries, and the .o.sha256
# files that other versions' builds keep beside their objects (clear removes them too)
_OURS = re.compile(r"\.?k_[0-9a-f]{24}(\.[A-Za-z0-9_]+)?\.(o|o\.sha256|tmp)")
_DIGEST = re.compile(r"[0-9a-f]{64}")  # an object's name: k_<key>.<its sha256>.o
_DISABLED = "TS_MOE_NO_DISK_CACHE=1 (settings.disk_cache is off)"
_warned: set = set()
_unwritable: set = set()  # directories whose writes failed in this process


class KernelCacheWarning(UserWarning):
    """The disk cache is not used (or not for one object); kernels still work."""


def warn_once(topic: str, message: str, stacklevel: int = 3) -> None:
    if topic not in _warned:
        _warned.add(topic)
        warnings.warn(f"ts_moe kernel cache: {message}", KernelCacheWarning,
                      stacklevel=stacklevel)


def dsl_flavor() -> str:
    """The CUDA flavour ("cu12", "cu13") of the DSL compiler this process loaded.  With
    ``nvidia-cutlass-dsl[cu13]`` installed the DSL takes its cu13 compiler on a CUDA 13
    driver and its cu12 one on an older driver, and the two make different cubins from
    one release (bench/notes/2026-12-06-dsl-4.8.0-and-cu13.md)."""
    from cutlass._mlir._mlir_libs import _cutlass_ir

    found = re.search(r"_cutlass_ir\.(cu\d+)\.", pathlib.Path(_cutlass_ir.__file__).name)
    return found.group(1) if found else "unknown"


@functools.cache
def fingerprint() -> str:
    """The kernel sources (every module of the kernels, the pipelines and the
    pre-flight but :data:`_NOT_SOURCES`) and the toolchain (the DSL's release and
    flavour, TVM-FFI's release): a new build, a new directory."""
    import cutlass
    import tvm_ffi

    h = hashlib.sha256(f"{cutlass.__version__}|{dsl_flavor()}|{tvm_ffi.__version__}".encode())
    for root in _SOURCES:
        for path in sorted(p for p in root.rglob("*.py") if p.name not in _NOT_SOURCES):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def object_name(key: tuple) -> str:
    return "k_" + hashlib.sha256(repr(key).encode()).hexdigest()[:24]


def configured_root() -> tuple:
    """``(root, None)``: the cache directory asked for (not checked), or ``(None, why)``."""
    if not settings.disk_cache:
        return None, _DISABLED
    asked = settings.cache_dir
    if asked:
        if not os.path.isabs(asked):
            return None, (f"TS_MOE_CACHE_DIR={shown(asked)} is a relative path (it would depend on "
                          f"the working directory): give an absolute one")
        return pathlib.Path(asked), None
    try:
        home = pathlib.Path.home()
    except RuntimeError:
        return None, "no home directory for ~/.cache/ts_moe: set TS_MOE_CACHE_DIR"
    if not home.is_absolute():
        return None, f"the home directory {str(home)!r} is a relative path: set TS_MOE_CACHE_DIR"
    return home / ".cache" / "ts_moe", None


class CacheDir:
    """This build's cache directory (``path``) under the cache directory
    (``root``), checked and open: everything is done relative to ``fd`` and
    ``root_fd``.  A descriptor is None where the directory does not exist yet
    (``locate(create=False)`` only)."""

    def __init__(self, root: pathlib.Path, root_fd, path: pathlib.Path, fd):
        self.root, self.root_fd, self.path, self.fd = root, root_fd, path, fd

    def close(self) -> None:
        for fd in (self.fd, self.root_fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.root_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def locate(create: bool = True) -> tuple:
    """``(CacheDir, None)``: this build's checked cache directory, open (the
    caller closes it), created if ``create``; or ``(None, why)``: memory only."""
    asked, why = configured_root()
    if asked is None:
        return None, why
    if not os.path.isdir("/proc/self/fd"):
        return None, "/proc/self/fd is missing (objects are read and written through it)"
    root_fd = fd = None
    try:
        root_fd = kernel_cache_path.open_path(str(asked), create)
        if root_fd is not None:
            fd = kernel_cache_path.open_child(root_fd, str(asked), fingerprint(), create)
    except (kernel_cache_path.Unsafe, OSError) as e:
        if root_fd is not None:
            os.close(root_fd)
        if isinstance(e, OSError):
            return None, f"{asked} cannot be used ({e.strerror or e}: {e.filename or asked})"
        inside = e.component == str(asked) or e.component.startswith(f"{asked}/")
        return None, f"{e}" if inside else f"{asked}: {e}"
    return CacheDir(asked, root_fd, asked / fingerprint(), fd), None


@contextlib.contextmanager
def directory():
    """The :class:`CacheDir` to load and store kernels in, closed on exit, or
    None (memory only, said once)."""
    found, why = locate()
    if found is None and why != _DISABLED:
        warn_once(why, f"{why}; compiled kernels stay in memory in this process",
                  stacklevel=4)  # get_compiled, past contextlib
    try:
        yield found
    finally:
        if found is not None:
            found.close()


_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO never blocks


def _read_all(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _not_ours(st) -> str | None:
    """Why an object may not be loaded, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links (another name could change it)"
    return None


def _objects(directory: CacheDir, name: str) -> list:
    """``(file name, sha256)`` of each object of ``name`` in the directory."""
    prefix = f"{name}."
    return [(f, f[len(prefix):-2]) for f in sorted(os.listdir(directory.fd))
            if f.startswith(prefix) and f.endswith(".o")
            and _DIGEST.fullmatch(f[len(prefix):-2])]


def load(directory: CacheDir, name: str, loader):
    """``loader(path)`` of an object of ``name`` that is ours and intact, else None
    (a miss).  ``path`` names the very file that was checked (``/proc/self/fd``)."""
    for filename, digest in _objects(directory, name):
        fn = _load_object(directory, filename, digest, loader)
        if fn is not None:
            return fn
    return None


def _load_object(directory: CacheDir, filename: str, digest: str, loader):
    path = directory.path / filename
    try:
        fd = os.open(filename, _READ, dir_fd=directory.fd)
    except FileNotFoundError:  # replaced meanwhile by a process that wrote it
        return None
    except OSError as e:
        why = "is a symlink" if e.errno == errno.ELOOP else f"cannot be read ({e.strerror})"
        warn_once(f"object {directory.path}", f"{path} {why}: not loaded; recompiling",
                  stacklevel=4)
        return None
    try:
        why = _not_ours(os.fstat(fd))
        if why:
            warn_once(f"object {directory.path}", f"{path} {why}: not loaded; recompiling",
                      stacklevel=4)
            return None
        if hashlib.sha256(_read_all(fd)).hexdigest() != digest:
            warn_once(f"integrity {directory.path}",
                      f"{path} does not match the sha256 its name carries (a damaged or "
                      f"torn file): not loaded; recompiling (further mismatches in "
                      f"{directory.path} are not reported)", stacklevel=4)
            return None
        try:
            return loader(f"/proc/self/fd/{fd}")
        except Exception as e:  # noqa: BLE001 (the kernel is compiled instead)
            warn_once(f"load {directory.path}", f"{path} could not be loaded ({e}); "
                                                f"recompiling", stacklevel=4)
            return None
    finally:
        os.close(fd)


def _write_object(directory: CacheDir, name: str, export) -> None:
    """``export(path)`` into a fresh private file created in the directory, then
    renamed there, in one step, to the name of ``name`` and its sha256."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=directory.fd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no unused temporary name", str(directory.path))
    try:
        export(f"/proc/self/fd/{fd}")
        digest = hashlib.sha256(_read_all(fd)).hexdigest()
        os.replace(tmp, f"{name}.{digest}.o", src_dir_fd=directory.fd, dst_dir_fd=directory.fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=directory.fd)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)


def store(directory: CacheDir, name: str, export) -> bool:
    """Writes an object of ``name`` with ``export(path)``; False (with one warning,
    and no further writes there) if the directory cannot take it.  ``path`` is
    ``/proc/self/fd/N`` of the file created for it, so the export cannot be
    redirected by a name."""
    if str(directory.path) in _unwritable:
        return False
    try:
        _write_object(directory, name, export)
    except Exception as e:  # noqa: BLE001 (the compiled kernel works without its copy)
        _unwritable.add(str(directory.path))
        warn_once(f"write {directory.path}", f"cannot write to {directory.path} ({e}); "
                                             f"compiled kernels stay in memory in this process")
        return False
    return True


def _builds(cache: CacheDir):
    """``(name, fd)`` of each fingerprint directory in the cache directory (never
    through a symlink); the caller closes ``fd``."""
    if cache.root_fd is None:
        return
    for name in sorted(os.listdir(cache.root_fd)):
        if _FINGERPRINT.fullmatch(name):
            try:
                fd = os.open(name, kernel_cache_path.DIR_FLAGS, dir_fd=cache.root_fd)
            except OSError:
                continue  # a symlink, a file, or gone
            yield name, fd


def _our_files(fd: int):
    """``(name, stat)`` of our files (anything but a directory) in the directory ``fd``."""
    for name in sorted(os.listdir(fd)):
        if _OURS.fullmatch(name):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # renamed meanwhile by a process that wrote it
            if not stat.S_ISDIR(st.st_mode):
                yield name, st


def usage(cache: CacheDir) -> dict:
    """``{fingerprint: (objects, bytes)}`` of our regular files in the cache directory."""
    found = {}
    for build, fd in _builds(cache):
        objects = size = 0
        try:
            for name, st in _our_files(fd):
                if stat.S_ISREG(st.st_mode):
                    objects += name.endswith(".o") and not name.startswith(".")
                    size += st.st_size
        finally:
            os.close(fd)
        found[build] = (objects, size)
    return found


def clear(cache: CacheDir) -> tuple:
    """Removes our files (and then empty fingerprint directories) in the cache
    directory; ``(files, bytes)`` removed.  Anything else there stays; a symlink
    named like ours is removed, never followed."""
    files = size = 0
    for build, fd in _builds(cache):
        try:
            for name, st in _our_files(fd):
                try:
                    os.unlink(name, dir_fd=fd)
                except FileNotFoundError:
                    continue
                files += 1
                size += st.st_size
        finally:
            os.close(fd)
        try:
            os.rmdir(build, dir_fd=cache.root_fd)
        except OSError:
            pass  # something not ours is left in it
    return files, size
