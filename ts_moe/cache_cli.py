"""``python -m ts_moe cache`` (``ts-moe cache``): where the compiled kernels are
kept, how much they take, or why they stay in memory; ``--clear`` empties it.
The rules are :mod:`csrc_free_kernels.common.kernel_cache`'s."""

import sys

from csrc_free_kernels.common import kernel_cache


def add_arguments(c) -> None:
    c.add_argument("--clear", action="store_true",
                   help="remove the cached kernel objects (only ts_moe's own files)")


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def run(clear: bool) -> int:
    """Prints the cache's state, or clears it (1 if there is no disk cache to clear)."""
    cache, why = kernel_cache.locate(create=False)
    if cache is None:
        print(f"kernel cache: memory only ({why})")
        if clear:
            print("nothing cleared: no disk cache in use", file=sys.stderr)
        return int(clear)
    with cache:
        if clear:
            files, size = kernel_cache.clear(cache)
            print(f"kernel cache: {cache.root}: removed {files} files ({_size(size)})")
            return 0
        found = kernel_cache.usage(cache)
        created = cache.fd is not None
    objects = sum(n for n, _ in found.values())
    size = sum(s for _, s in found.values())
    mine = found.get(cache.path.name, (0, 0))
    print(f"kernel cache: {cache.root}")
    print(f"  this build ({cache.path.name}): {mine[0]} kernel objects, {_size(mine[1])}"
          + ("" if created else " (not created yet)"))
    print(f"  in all: {len(found)} builds, {objects} kernel objects, {_size(size)}")
    return 0
