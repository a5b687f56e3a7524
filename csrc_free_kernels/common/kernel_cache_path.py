"""Opening the kernel cache's directory so that no one else can redirect it.

A path is trusted as far as its least protected component: whoever can write a
directory on the way can rename the next one away and put a symlink in its
place.  So the path is walked from ``/`` one component at a time, each
directory opened relative to the previous one's descriptor, never following a
symlink by name (OpenSSH's StrictModes rules):

- every directory on the way is owned by this uid or root and not writable by
  its group or others, unless it is sticky (like ``/tmp``: no one can rename
  what another user put in it);
- the last directory is owned by this uid and not writable by its group or
  others, sticky or not;
- a symlink is followed only if this uid or root owns it, and its target is
  walked by the same rules.

The descriptor returned is the directory that was checked: a later swap of a
name on the way cannot change what it refers to.
"""

import os
import stat

_MAX_LINKS = 40  # as the kernel's ELOOP
_WALK = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Unsafe(Exception):
    """``component`` (a path) may not be on the way to the cache: ``why``."""

    def __init__(self, component: str, why: str):
        super().__init__(f"{component} {why}")
        self.component, self.why = component, why


def _owner_ok(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _owner(uid: int) -> str:
    return f"owned by uid {uid}, not by this process's uid {os.geteuid()}"


def check_ancestor(path: str, st) -> None:
    """A directory on the way: this uid's or root's, writable by others only if sticky."""
    if not stat.S_ISDIR(st.st_mode):
        raise Unsafe(path, "is not a directory")
    if not _owner_ok(st.st_uid):
        raise Unsafe(path, f"is {_owner(st.st_uid)} or root")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise Unsafe(path, f"is writable by its group or others and not sticky "
                           f"(mode {stat.S_IMODE(st.st_mode):o})")


def check_last(path: str, st) -> None:
    """The cache directory or its build subdirectory: this uid's, writable only by it."""
    if not stat.S_ISDIR(st.st_mode):
        raise Unsafe(path, "is not a directory")
    if st.st_uid != os.geteuid():
        raise Unsafe(path, f"is {_owner(st.st_uid)}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        sticky = ("; a sticky directory is allowed only above the cache directory"
                  if st.st_mode & stat.S_ISVTX else "")
        raise Unsafe(path, f"is writable by its group or others "
                           f"(mode {stat.S_IMODE(st.st_mode):o}){sticky}")


def _join(parent: str, name: str) -> str:
    return parent.rstrip("/") + "/" + name


def open_child(parent_fd: int, parent: str, name: str, create: bool) -> int | None:
    """The directory ``name`` in ``parent_fd`` (no symlink, checked by
    :func:`check_last`), created ``0o700`` if missing and ``create``; None if
    missing and not ``create``."""
    path = _join(parent, name)
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as e:
        kind = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
        if stat.S_ISLNK(kind):
            raise Unsafe(path, "is a symlink") from e
        if not stat.S_ISDIR(kind):
            raise Unsafe(path, "is not a directory") from e
        raise
    try:
        check_last(path, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_path(path: str, create: bool, check_end=check_last) -> int | None:
    """A descriptor (``O_RDONLY | O_DIRECTORY``) of the absolute directory
    ``path``, every component checked (see the module's rules; ``check_end``: the
    rule of the last directory, :func:`check_ancestor` for one that is itself only
    on the way, a parent); what is missing is created ``0o700`` if ``create``, else
    None.  A missing directory that a
    later ``..`` leaves (``/d/missing/../c``) is never made: ``..`` cancels it
    (nothing under it exists, so no symlink there can change what ``..`` means).
    Raises :class:`Unsafe`, or ``OSError`` for a path that cannot be walked."""
    todo = path.split("/")[::-1]  # a stack: the next component last
    stack = [("/", os.open("/", _WALK))]  # (physical path, descriptor) of each directory
    missing = []  # components under one that does not exist: not made before the path ends
    links = 0
    try:
        check_ancestor("/", os.fstat(stack[0][1]))
        while todo or missing:
            if not todo:  # every ".." is behind: what is left missing is the path's own
                if not create:
                    return None
                todo, missing = missing[::-1], []
                continue
            name = todo.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if missing:  # a directory that does not exist, and will not be made
                    missing.pop()
                elif len(stack) > 1:
                    os.close(stack.pop()[1])
                continue
            if missing:
                missing.append(name)
                continue
            parent, parent_fd = stack[-1]
            here = _join(parent, name)
            try:
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            except FileNotFoundError:
                if not create or ".." in todo:  # made only where no ".." comes after it
                    missing.append(name)
                    continue
                try:
                    os.mkdir(name, 0o700, dir_fd=parent_fd)
                except FileExistsError:
                    pass  # made meanwhile by another process: checked like ours
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                if not _owner_ok(st.st_uid):
                    raise Unsafe(here, f"is a symlink {_owner(st.st_uid)} or root")
                links += 1
                if links > _MAX_LINKS:
                    raise Unsafe(here, "has too many levels of symlinks")
                target = os.readlink(name, dir_fd=parent_fd)
                if target.startswith("/"):
                    for _, fd in stack[1:]:
                        os.close(fd)
                    del stack[1:]
                todo.extend(target.split("/")[::-1])
                continue
            fd = os.open(name, _WALK, dir_fd=parent_fd)
            stack.append((here, fd))
            check_ancestor(here, os.fstat(fd))
        last, last_fd = stack[-1]
        fd = os.open(".", DIR_FLAGS, dir_fd=last_fd)
        try:
            check_end(last, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return fd
    finally:
        for _, fd in stack:
            os.close(fd)
