"""Compile CuTeDSL kernels once, each through the pre-flight of the hardware's rules: an
in-memory cache, backed by object files on disk.

A kernel is compiled from fake (symbolic-shape) tensors through TVM-FFI, so the
compiled function takes torch tensors directly, reads the current torch stream
itself, and serves every problem size of its configuration.  The object file
is exported to the disk cache (:mod:`.kernel_cache`: ``$TS_MOE_CACHE_DIR`` or
``~/.cache/ts_moe``, only if no one but this user or root can write its path),
so a new process loads it in milliseconds instead of recompiling.
"""

import os
import threading
import time

import cutlass
import cutlass.cute as cute
import torch

from . import kernel_cache, pdl, refusals, scratch
from .refusals import PreflightError

# the DSL's element type of each torch dtype a kernel's fake arguments take
CUTE_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
               torch.float32: cutlass.Float32, torch.int32: cutlass.Int32,
               torch.int64: cutlass.Int64}

_memory: dict = {}
_lock = threading.Lock()
# (key, seconds, "compiled" | "loaded") of each kernel this process obtained
stats: list = []


def codegen_environment() -> str:
    """The DSL settings that change the code it generates (``CUTE_DSL_ARCH``,
    ``CUTE_DSL_LINEINFO``, ``CUTE_DSL_COMPILER_OPT``, ...), as the DSL keys its own
    JIT cache on them: the values it read, not today's environment."""
    try:
        from cutlass.cutlass_dsl import CuTeDSL

        return CuTeDSL._get_dsl().envar.cache_key_str()
    except (ImportError, AttributeError):  # another DSL release: every CUTE_DSL_ variable
        return ";".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                        if k.startswith("CUTE_DSL_"))


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


def _compile(kernel, args, options: str = ""):
    return cute.compile(kernel, *args, options="--enable-tvm-ffi" + options)


def compile_build(build):
    """Compile a :class:`.family.Build` exactly as a call does (no cache, no gate): the
    PTX tests and ``python -m ts_moe compile`` read what ships and run the pre-flight
    themselves."""
    return _compile(*build.make())


def _compile_checked(build):
    """``build`` compiled, its PTX and cubin kept in a scratch folder and put through the
    pre-flight (``csrc_free_kernels.preflight``, about 0.2 s, a fifth of a compile);
    a violation raises :class:`.refusals.PreflightError` naming the build, the rule and
    the PTX line, and nothing is cached."""
    from .. import preflight

    with scratch.directory("ts_moe_preflight_") as dump, preflight.recording() as facts:
        fn = _compile(*build.make(), options=scratch.dump_options(dump))
        found = preflight.check(build.name, preflight.collect(dump, facts), facts)
    if found:
        raise PreflightError(refusals.Refusal.of(build.name, found))
    return fn


def get_compiled(build):
    """The compiled function of a :class:`.family.Build`, memoized, from the disk cache
    where it holds one, else compiled through the pre-flight (:func:`_compile_checked`).

    ``build.key`` must name everything the compiled code depends on besides the
    sources (dtypes, layouts, tile configuration, arch); whether the kernels
    use programmatic dependent launch (:mod:`.pdl`) and the DSL's code-generation
    settings (:func:`codegen_environment`) are added here.  The cache holds only builds
    that passed: its directory is named after the sources, the pre-flight's rules among
    them (:func:`.kernel_cache.fingerprint`), so a loaded object carries its verdict.
    A refused build is recorded once (:mod:`.refusals`: one warning) and raises
    :class:`.refusals.PreflightError` at this and every later request, without a second
    compile.
    """
    key = (*build.key, ("pdl", pdl.ENABLED), ("dsl", codegen_environment()))
    fn = _memory.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _memory.get(key)
        if fn is not None:
            return fn
        refused = refusals.get(key)
        if refused is not None:  # not compiled and checked again on every call
            raise PreflightError(refused)
        t0 = time.perf_counter()
        name = kernel_cache.object_name(key)
        with kernel_cache.directory() as directory:  # None: memory only
            how = "loaded"
            fn = None if directory is None else kernel_cache.load(
                directory, name,
                lambda path: cute.runtime.load_module(path, enable_tvm_ffi=True)[name])
            if fn is None:
                how = "compiled"
                try:
                    fn = _compile_checked(build)
                except PreflightError as exc:
                    refusals.record(key, exc.refusal)
                    raise
                if directory is not None:
                    kernel_cache.store(directory, name, lambda path: fn.export_to_c(
                        object_file_path=path, function_name=name))
        stats.append((key, time.perf_counter() - t0, how))
        _memory[key] = fn
        return fn
