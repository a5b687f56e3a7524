"""Grouped-GEMM inputs, the plain-torch reference, and the backends that are timed.

A backend is a *factory* ``factory(case, device) -> bind``; ``bind(inputs)``
does all the host-side preparation for one copy of the inputs (sizes read
from the case, pointer arrays, output buffers) and returns the zero-argument
``run() -> out`` that is checked and timed.  So nothing a backend needs to
look up on the host is inside the timed call.  A factory that cannot run on
this machine raises :class:`Unavailable` (or lets an ``ImportError`` out).
"""

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ts_moe.reference import grouped_gemm_reference

from .cases import Case

Run = Callable[[], torch.Tensor]
Bind = Callable[[object], Run]
Factory = Callable[[Case, torch.device], Bind]


class Unavailable(Exception):
    """The backend cannot run here (missing package, no GPU, wrong arch)."""


@dataclass
class GemmInputs:
    """``a`` (M, K) tokens sorted by expert, ``b`` (E, K, N) weights, ``offs`` int32 row ends."""

    a: torch.Tensor
    b: torch.Tensor
    offs: torch.Tensor
    counts: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.untyped_storage().nbytes()

    def clone(self) -> "GemmInputs":
        # clone keeps b's strides (a k-major b stays k-major)
        return GemmInputs(self.a.clone(), self.b.clone(), self.offs, self.counts)


def make_gemm_inputs(case: Case, device: torch.device) -> GemmInputs:
    """Seeded random inputs scaled like a real layer: unit activations, weights
    ``* K**-0.5`` so outputs are O(1).  ``kmajor``: b is ``w.transpose(-2, -1)``
    of an (E, N, K) nn.Linear-style weight."""
    g = torch.Generator(device).manual_seed(case.seed)
    kw = {"generator": g, "device": device, "dtype": torch.bfloat16}
    E, M, N, K = case.E, case.M, case.N, case.K
    a = torch.randn(M, K, **kw)
    if case.weight_layout == "kmajor":
        b = torch.randn(E, N, K, **kw).mul_(K**-0.5).transpose(-2, -1)
    elif case.weight_layout == "nmajor":
        b = torch.randn(E, K, N, **kw).mul_(K**-0.5)
    else:
        raise ValueError(f"unknown weight layout {case.weight_layout!r}")
    offs = torch.tensor(case.counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return GemmInputs(a, b, offs, case.counts)


def segments(counts):
    """(expert, first row, rows) of every expert that got rows."""
    start = 0
    for e, rows in enumerate(counts):
        if rows:
            yield e, start, rows
        start += rows


def reference_grouped_gemm(inp: GemmInputs, out_dtype=torch.float32) -> torch.Tensor:
    """ts_moe's plain-torch reference: per-expert fp32 matmuls, zeros past the
    last expert; fast enough on a GPU for the largest cases.  Its row ends are
    a CPU tensor made from the case's counts: no sync, so it can be graph-captured."""
    return grouped_gemm_reference(inp.a, inp.b, torch.tensor(inp.counts).cumsum(0), out_dtype)


def _require_cuda(device: torch.device, what: str) -> None:
    if device.type != "cuda":
        raise Unavailable(f"{what} needs a CUDA device")


def reference(case: Case, device: torch.device) -> Bind:
    """Plain torch, fp32 per expert, bf16 out."""
    return lambda inp: lambda: reference_grouped_gemm(inp, inp.a.dtype)


def torch_grouped_mm(case: Case, device: torch.device) -> Bind:
    """``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` on older torch)."""
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise Unavailable(f"torch {torch.__version__} has no grouped_mm")
    return lambda inp: lambda: fn(inp.a, inp.b, offs=inp.offs)


def cublas_loop(case: Case, device: torch.device) -> Bind:
    """One ``torch.mm`` (cuBLAS on a GPU) per expert that got rows, into one output.

    For a 2-D ``b`` (the k-grouped weight gradient, ``a`` (K, M), ``b`` (M, N)):
    ``out[e] = a[:, rows e] @ b[rows e]`` into an (E, K, N) output, whose
    experts without rows are zero-filled (as ``F.grouped_mm`` gives them)."""

    def bind(inp: GemmInputs) -> Run:
        a, b = inp.a, inp.b
        segs = list(segments(inp.counts))
        if b.dim() == 2:
            experts = len(inp.counts)
            empty = [e for e, rows in enumerate(inp.counts) if not rows]
            empty_index = torch.tensor(empty, dtype=torch.int64, device=a.device)

            def run_k():
                out = torch.empty(experts, a.shape[0], b.shape[1], dtype=a.dtype,
                                  device=a.device)
                for e, start, rows in segs:
                    torch.mm(a[:, start:start + rows], b[start:start + rows], out=out[e])
                if empty:
                    out.index_fill_(0, empty_index, 0)
                return out

            return run_k

        def run():
            out = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
            for e, start, rows in segs:
                torch.mm(a[start:start + rows], b[e], out=out[start:start + rows])
            return out

        return run

    return bind


@functools.cache
def _cublas_handle(device_index: int):
    """One nvmath cuBLAS handle per device for the whole run, with its own
    workspace so that CUDA-graph capture never makes cuBLAS allocate."""
    from nvmath.bindings import cublas

    with torch.cuda.device(device_index):
        handle = cublas.create()
        workspace = torch.empty(32 << 20, dtype=torch.uint8, device=f"cuda:{device_index}")
        cublas.set_workspace(handle, workspace.data_ptr(), workspace.nbytes)
    return handle, workspace


GROUPED_GEMM_CUBLAS = 120500  # cublasGetVersion of the first cuBLAS with grouped GEMM


@dataclass
class CublasPlan:
    """The column-major GEMMs cuBLAS sees, one group per expert with rows.

    cuBLAS is column-major, so the row-major ``out_e = a_e @ b_e`` is computed
    as ``out_e^T = b_e^T a_e^T``: cuBLAS's A is the weight block (transposed by
    cuBLAS when b is k-major), its B the expert's token rows, its C the
    expert's row-major output block, all read as column-major matrices.
    Offsets are in elements from each tensor's data pointer.
    """

    transpose_w: bool
    m: int  # N
    k: int  # K
    lda: int
    ldb: int
    ldc: int
    n: list[int]  # rows of each expert
    w_offsets: list[int]
    a_offsets: list[int]
    out_offsets: list[int]


def cublas_plan(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, counts) -> CublasPlan:
    """The plan for a row-major ``a`` (M, K), ``b`` (E, K, N) and a row-major ``out`` (M, N)."""
    if b.stride(2) == 1:  # N-major: each (K, N) block is a column-major N x K = b_e^T
        transpose_w, lda = False, b.stride(1)
    else:  # K-major: each block is a column-major K x N = b_e, so cuBLAS transposes it
        transpose_w, lda = True, b.stride(2)
    segs = list(segments(counts))
    return CublasPlan(
        transpose_w=transpose_w, m=b.shape[2], k=b.shape[1], lda=lda, ldb=a.stride(0),
        ldc=out.stride(0), n=[rows for _, _, rows in segs],
        w_offsets=[e * b.stride(0) for e, _, _ in segs],
        a_offsets=[start * a.stride(0) for _, start, _ in segs],
        out_offsets=[start * out.stride(0) for _, start, _ in segs])


def cublas_grouped(case: Case, device: torch.device) -> Bind:
    """``cublasGemmGroupedBatchedEx`` through nvmath-python (see :class:`CublasPlan`).

    Per-group sizes, leading dimensions and scalars are host arrays (as the
    API wants), the A/B/C pointer arrays device arrays; all built in ``bind``.
    """
    _require_cuda(device, "cublas_grouped")
    try:
        from nvmath import CudaDataType
        from nvmath.bindings import cublas

        handle, _ = _cublas_handle(device.index if device.index is not None
                                   else torch.cuda.current_device())
        version = cublas.get_version(handle)
    except Exception as exc:  # not installed, or libcublas did not load
        raise Unavailable(f"cuBLAS through nvmath: {type(exc).__name__}: {exc}") from exc
    if version < GROUPED_GEMM_CUBLAS:
        raise Unavailable(f"cuBLAS {version} has no cublasGemmGroupedBatchedEx (12.5+)")
    bf16 = int(CudaDataType.CUDA_R_16BF)
    op_n, op_t = int(cublas.Operation.N), int(cublas.Operation.T)

    def bind(inp: GemmInputs) -> Run:
        a, b = inp.a, inp.b
        out = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
        plan = cublas_plan(a, b, out, inp.counts)
        groups = len(plan.n)

        def host_int(value):
            return torch.tensor(value if isinstance(value, list) else [value] * groups,
                                dtype=torch.int32)

        host = {  # cuBLAS reads these at every call
            "transa": host_int(op_t if plan.transpose_w else op_n),
            "transb": host_int(op_n),
            "m": host_int(plan.m), "n": host_int(plan.n), "k": host_int(plan.k),
            "lda": host_int(plan.lda), "ldb": host_int(plan.ldb), "ldc": host_int(plan.ldc),
            "group_size": host_int(1),
            "alpha": torch.ones(groups, dtype=torch.float32),
            "beta": torch.zeros(groups, dtype=torch.float32),
        }
        es = a.element_size()
        ptrs = torch.tensor(
            [[b.data_ptr() + off * es for off in plan.w_offsets],
             [a.data_ptr() + off * es for off in plan.a_offsets],
             [out.data_ptr() + off * es for off in plan.out_offsets]],
            dtype=torch.int64).to(a.device)
        p = {name: t.data_ptr() for name, t in host.items()}
        w_ptrs, a_ptrs, out_ptrs = (row.data_ptr() for row in ptrs)

        def run():
            # the handle follows torch's stream, also while a CUDA graph is captured
            cublas.set_stream(handle, torch.cuda.current_stream().cuda_stream)
            cublas.gemm_grouped_batched_ex(
                handle, p["transa"], p["transb"], p["m"], p["n"], p["k"], p["alpha"],
                w_ptrs, bf16, p["lda"], a_ptrs, bf16, p["ldb"],
                p["beta"], out_ptrs, bf16, p["ldc"], groups, p["group_size"],
                int(cublas.ComputeType.COMPUTE_32F))
            return out

        # run() holds only raw addresses: tie the arrays behind them to its life
        run.keep_alive = (host, ptrs)
        return run

    return bind


def ts_moe(case: Case, device: torch.device) -> Bind:
    """``ts_moe.grouped_gemm``: the CuTeDSL kernel on sm_90, the reference elsewhere.

    On a CUDA device without the kernel the op would silently time its
    reference fallback, so that is reported as unavailable instead."""
    import ts_moe as op
    from ts_moe.ops import kernel_arch

    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if kernel_arch(index) is None:
            raise Unavailable("no ts_moe kernel for this GPU (the op would run its reference)")
    return lambda inp: lambda: op.grouped_gemm(inp.a, inp.b, inp.offs)


def variant_kernels() -> dict:
    """``name -> (kernel class, {config name: TileConfig})``: the sm_90 GEMM variants
    awaiting an A/B, run as ``ts_moe:kernel=NAME`` (in ``choose_config``'s tiles unless
    ``config=`` names one of theirs).  None now: the last one (the TMA-store epilogue)
    lost its A/B (bench/notes/2026-12-07-tma-store-epilogue-ab.md)."""
    return {}


def ts_moe_variant(spec: str) -> Factory:
    """``ts_moe:FIELD=VALUE:...``: the sm_90 kernel with fields of the config
    ``choose_config`` picks replaced (``config=NAME`` starts from a named
    configuration instead), e.g. ``ts_moe:band_m=16`` or
    ``ts_moe:config=mid:cluster_m=2:b_warps=1``: tile experiments side by side
    with the peers in one run.  ``kernel=NAME`` runs a variant awaiting its A/B
    (:func:`variant_kernels`)."""
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as sm90
    from csrc_free_kernels.hopper import grouped_gemm_sm90_launch as launch

    kernels = {"plain": (launch.GroupedGemmSm90, sm90.CONFIGS), **variant_kernels()}
    fields = {f.name: f.type for f in dataclasses.fields(sm90.TileConfig)}
    items = [item.partition("=") for item in spec.split(":")]
    for key, sep, value in items:
        if not sep or not value:
            raise ValueError(f"ts_moe variant {spec!r}: {key + sep + value!r} is not "
                             f"FIELD=VALUE")
    kernel = dict((k, v) for k, _, v in items).get("kernel", "plain")
    if kernel not in kernels:
        raise ValueError(f"ts_moe variant {spec!r}: no kernel {kernel!r}; known: "
                         f"{', '.join(kernels)}")
    kernel_cls, configs = kernels[kernel]
    base = None
    changes = {}
    for key, _, value in items:
        if key == "kernel":
            continue
        if key == "config":
            if value not in configs:
                raise ValueError(f"ts_moe variant {spec!r}: no configuration {value!r}; "
                                 f"known: {', '.join(configs)}")
            base = configs[value]
        elif key in fields and key != "name":
            kind = fields[key]
            try:
                changes[key] = bool(int(value)) if kind is bool else kind(value)
            except ValueError as exc:
                raise ValueError(f"ts_moe variant {spec!r}: {key}={value!r}: {exc}") from None
        else:
            raise ValueError(f"ts_moe variant {spec!r}: no TileConfig field {key!r}; known: "
                             f"config, {', '.join(k for k in fields if k != 'name')}")

    def factory(case: Case, device: torch.device) -> Bind:
        _require_cuda(device, f"ts_moe:{spec}")
        if torch.cuda.get_device_capability(device) != (9, 0):
            raise Unavailable("the sm_90 kernel needs an sm_90 GPU")
        chosen = base or sm90.choose_config(case.E, case.N, case.K, case.M)
        config = dataclasses.replace(chosen, name=f"{chosen.name}:{spec}", **changes)

        def bind(inp):
            out = torch.empty(case.M, case.N, dtype=inp.a.dtype, device=inp.a.device)
            return lambda: launch.launch(inp.a, inp.b, inp.offs, out, config, kernel_cls)
        return bind

    return factory


QUACK_REQUIRES = ("quack-kernels>=0.6.5 (it brings apache-tvm-ffi, torch-c-dlpack-ext and "
                  "einops; it needs nvidia-cutlass-dsl >= 4.7): pip install 'ts-moe[peers]'")


def quack(case: Case, device: torch.device) -> Bind:
    """QuACK's CuTeDSL GEMM (``quack.gemm_interface.gemm``, Dao-AILab) on the ragged
    rows: ``cu_seqlens_m`` = ``[0, offs...]``, its default (untuned) configuration for
    the GPU (sm_90: 128x192 ping-pong tiles, CTA pairs).  Row-grouped only: the
    k-grouped weight gradient (a 2-D ``b``) is not timed for it.  Unavailable where the
    optional package is not installed (``QUACK_REQUIRES``) or on a non-CUDA device."""
    _require_cuda(device, "quack")
    try:
        from quack.gemm_interface import gemm
    except ImportError as exc:
        raise Unavailable(f"QuACK is not installed ({exc}); {QUACK_REQUIRES}") from None

    def bind(inp: GemmInputs) -> Run:
        if inp.b.dim() != 3:
            raise Unavailable("QuACK backend: row-grouped GEMMs only (no k-grouped dW)")
        cu = torch.cat([inp.offs.new_zeros(1), inp.offs])
        out = torch.empty(inp.a.shape[0], inp.b.shape[2], dtype=inp.a.dtype,
                          device=inp.a.device)
        return lambda: gemm(inp.a, inp.b, out=out, cu_seqlens_m=cu, tuned=False)

    return bind


class Registry(dict):
    """Backends by name; ``ts_moe:...`` names are made on lookup (:func:`ts_moe_variant`,
    whose ``ValueError`` names what is wrong with a bad one)."""

    def __contains__(self, name) -> bool:
        try:
            self[name]
        except KeyError:
            return False
        return True

    def __missing__(self, name):
        if isinstance(name, str) and name.startswith("ts_moe:"):
            factory = self[name] = ts_moe_variant(name[len("ts_moe:"):])
            return factory
        raise KeyError(name)


BACKENDS: dict[str, Factory] = {
    "torch_grouped_mm": torch_grouped_mm,
    "cublas_grouped": cublas_grouped,
    "cublas_loop": cublas_loop,
    "ts_moe": ts_moe,
    "quack": quack,
    "reference": reference,
}
# reference is slow (fp32); it is there for checking and on request
DEFAULT_BACKENDS = ("torch_grouped_mm", "cublas_grouped", "cublas_loop", "quack", "ts_moe")
