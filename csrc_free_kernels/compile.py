"""Compile CuTeDSL kernels once: an in-memory cache, backed by object files on disk.

A kernel is compiled from fake (symbolic-shape) tensors through TVM-FFI, so the
compiled function takes torch tensors directly, reads the current torch stream
itself, and serves every problem size of its configuration.  The object file
is exported to ``$TS_MOE_CACHE_DIR`` (default ``~/.cache/ts_moe``) under a
fingerprint of the kernel sources and toolchain versions, so a new process
loads it in milliseconds instead of recompiling.
"""

import hashlib
import os
import pathlib
import threading
import time

import cutlass
import cutlass.cute as cute

from . import pdl

_SOURCES = [pathlib.Path(__file__).parent, pathlib.Path(__file__).parent.parent / "ts_pipeline"]
_memory: dict = {}
_lock = threading.Lock()
# (key, seconds, "compiled" | "loaded") of each kernel this process obtained
stats: list = []


def _fingerprint() -> str:
    import tvm_ffi

    h = hashlib.sha256(f"{cutlass.__version__}|{tvm_ffi.__version__}".encode())
    for root in _SOURCES:
        for path in sorted(root.glob("*.py")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> pathlib.Path:
    root = os.environ.get("TS_MOE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "ts_moe"
    return pathlib.Path(root) / _fingerprint()


def sym_dims(n: int, divisibility: int = 1) -> list:
    return [cute.sym_int(divisibility=divisibility) for _ in range(n)]


def fake_gemm_args(a_dtype, c_dtype, b_n_major: bool, *, own_n_out: bool = False,
                   row_index: bool = False, gather: bool = False) -> tuple:
    """The grouped GEMMs' symbolic arguments: (M, K) tokens, (E, K, N) weights
    (N-major, or K-major: ``w.transpose(-2, -1)``), (M', N') output, (E,) offs,
    and with ``row_index`` an int32 row index.

    Strides are symbolic multiples of 16 bytes, sizes free (the TMA
    zero-fills K and N tails; callers allocate outputs with 16-byte rows, as
    torch does); shared symbols are checked to agree at every call.
    ``own_n_out``: N' is its own size (the SwiGLU output), else N.
    ``gather``: the output has the index's M' rows, else A's M (and the index,
    if any, is a placeholder of any length)."""
    m, k, n, e = sym_dims(4)
    n_out = sym_dims(1)[0] if own_n_out else n

    def s(dtype):
        return cute.sym_int64(divisibility=128 // dtype.width)

    f = cute.runtime.make_fake_tensor
    a = f(a_dtype, (m, k), (s(a_dtype), 1), assumed_align=16)
    b = f(a_dtype, (e, k, n), (s(a_dtype), s(a_dtype), 1) if b_n_major
          else (s(a_dtype), 1, s(a_dtype)), assumed_align=16)
    index_rows = sym_dims(1)[0] if row_index else None
    c = f(c_dtype, (index_rows if gather else m, n_out), (s(c_dtype), 1), assumed_align=16)
    offs = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (e,), assumed_align=4)
    if not row_index:
        return a, b, c, offs
    index = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (index_rows,), assumed_align=4)
    return a, b, c, offs, index


def fake_stream():
    """The stream argument: TVM-FFI passes torch's current stream."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def get_compiled(key: tuple, build):
    """The compiled function for ``key``; ``build()`` returns ``(kernel, fake_args)``.

    ``key`` must name everything the compiled code depends on besides the
    sources (dtypes, layouts, tile configuration, arch); whether the kernels
    use programmatic dependent launch (:mod:`.pdl`) is added here.
    """
    key = (*key, ("pdl", pdl.ENABLED))
    fn = _memory.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _memory.get(key)
        if fn is not None:
            return fn
        t0 = time.perf_counter()
        name = "k_" + hashlib.sha256(repr(key).encode()).hexdigest()[:24]
        path = None if os.environ.get("TS_MOE_NO_DISK_CACHE") == "1" else cache_dir() / f"{name}.o"
        how = "loaded"
        try:
            fn = cute.runtime.load_module(str(path), enable_tvm_ffi=True)[name] if path and path.exists() else None
        except Exception:  # a truncated or stale object is a cache miss
            fn = None
        if fn is None:
            how = "compiled"
            kernel, args = build()
            fn = cute.compile(kernel, *args, options="--enable-tvm-ffi")
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                fn.export_to_c(object_file_path=str(tmp), function_name=name)
                os.replace(tmp, path)
        stats.append((key, time.perf_counter() - t0, how))
        _memory[key] = fn
        return fn
