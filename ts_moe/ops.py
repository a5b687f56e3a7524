"""The ``torch.ops.ts_moe`` operators, and the one place that decides how each call runs.

``grouped_gemm(a, b, offs, out_dtype=None)`` has the semantics of
``torch.nn.functional.grouped_mm`` for 2-D ``a``:

- row-grouped, ``a`` (M, K) and ``b`` (E, K, N): rows ``[offs[e-1], offs[e])``
  of ``a`` (``offs[-1]`` read as 0) are multiplied by ``b[e]``; rows at or past
  ``offs[-1]`` are written as zeros (``grouped_mm`` leaves them undefined);
- k-grouped, ``a`` (K, M) and ``b`` (M, N): ``out[e] = a[:, rows e] @ b[rows
  e]``, (E, K, N), zeros for an expert without rows: the weight gradient
  ``grouped_gemm(x.t(), dy, offs)``.

Any K and N whose strides are 16-byte aligned; the output's rows are padded
to 16 bytes, as torch pads them.

Bad ``offs`` are not checked on the host (that would be a sync); instead every
path uses ``cummax(clamp(offs, 0, M))`` as the segment ends
(:func:`ts_moe.reference.segment_ends`): no access is ever out of bounds,
segments never overlap, and every output row is written.

How a call runs (:func:`choose_path`, from the device and the dtypes):

- sm_90 (H100/H200), bf16/fp16: the CuTeDSL kernels of
  ``csrc_free_kernels.grouped_gemm_sm90`` (``offs`` on the device, no sync);
- sm_90 and sm_100/sm_103 (B200, GB200, B300), bf16 in and out, where the
  kernels don't run: ``torch._grouped_mm`` (its CUTLASS kernel; no sync);
- float32 on any CUDA GPU: ``torch._grouped_mm`` (its per-expert loop, which
  reads ``offs`` on the host);
- everything else (CPU, other GPUs and dtypes, ``TS_MOE_REFERENCE=1``): the
  plain-torch references of :mod:`ts_moe.reference`, which read ``offs`` on
  the host (a sync per call on a GPU).

The ops are registered with ``torch.library.Library`` rather than
``custom_op``: its Python wrapper alone costs more than the 20 us host budget
allows for a whole call.  Both have autograd formulas made of the ops
themselves (:func:`grouped_gemm_backward`, :func:`grouped_gemm_swiglu_backward`),
so gradients run on the forward's path, eagerly and in compiled graphs.
"""

import enum
import functools
import importlib
import os

import torch
import torch.nn.functional as F

from . import routing
from .checks import (ALIGN_BYTES, check_grouped_gemm_args, check_swiglu_activation_args,
                     check_swiglu_args,
                     check_tensor_types, contiguous_dim, layout_ok, plausible_kernel_args)
from .reference import (acc_dtype, gather_rows, grouped_gemm_k_reference, grouped_gemm_reference,
                        grouped_gemm_swiglu_reference, segment_ends, swiglu, swiglu_backward)

_lib = torch.library.Library("ts_moe", "DEF")
_lib.define("grouped_gemm(Tensor a, Tensor b, Tensor offs, ScalarType? out_dtype=None, *, "
            "Tensor? a_index=None, bool prefetch_weights=False) -> Tensor")
_lib.define("grouped_gemm_swiglu(Tensor a, Tensor gate_up, Tensor offs, *, "
            "Tensor? a_index=None) -> Tensor")


# ------------------------------------------------------------------ paths
class Path(enum.Enum):
    KERNEL_SM90 = "ts_moe CuTeDSL kernels (sm_90a)"
    KERNEL_SM100 = "ts_moe CuTeDSL kernel (sm_100a; opted in, never run on hardware here)"
    TORCH_GROUPED_MM = "torch._grouped_mm"
    REFERENCE = "plain-torch reference (reads offs on the host)"


def choose_path(capability: tuple[int, int] | None, dtype: torch.dtype,
                out_dtype: torch.dtype | None, num_experts: int, *,
                kernels_available: bool = True, kernel_max_experts: int = 512,
                has_torch_grouped_mm: bool = True, sm100_opt_in: bool = False) -> Path:
    """The path of a call on a device of compute ``capability`` (None: the CPU).

    torch's grouped_mm takes its CUTLASS fast path only on sm_90 and sm_100
    (10.x) for bf16 in and out; elsewhere it loops over the experts with a host
    sync, which the reference does too, so it serves only float32 (which our
    kernels don't take).  Capability 10.0 runs the sm_100a kernel only after
    :func:`use_sm100_kernel` (it has never run on a Blackwell GPU).
    """
    if capability is None:
        return Path.REFERENCE
    half = dtype in (torch.bfloat16, torch.float16)
    if (capability == (9, 0) and kernels_available and half
            and num_experts <= kernel_max_experts):
        return Path.KERNEL_SM90
    if (capability == (10, 0) and sm100_opt_in and kernels_available and half
            and num_experts <= kernel_max_experts):
        return Path.KERNEL_SM100
    if has_torch_grouped_mm:
        if dtype == torch.float32:
            return Path.TORCH_GROUPED_MM
        if (dtype == torch.bfloat16 and out_dtype in (None, torch.bfloat16)
                and (capability == (9, 0) or capability[0] == 10)):
            return Path.TORCH_GROUPED_MM
    return Path.REFERENCE


@functools.cache
def _module(name: str):
    """``csrc_free_kernels.<name>``, or None without cutlass (nvidia-cutlass-dsl)."""
    try:
        return importlib.import_module(f"csrc_free_kernels.{name}")
    except ImportError:
        return None


@functools.cache
def _kernels(device_index: int):
    """The grouped GEMM module for this CUDA device's arch (sm_90, sm_100), else None."""
    name = {(9, 0): "grouped_gemm_sm90_launch", (10, 0): "grouped_gemm_sm100_launch"}.get(
        torch.cuda.get_device_capability(device_index))
    return None if name is None else _module(name)


_sm100_opt_in = False


def use_sm100_kernel(enabled: bool = True) -> None:
    """Run bf16/fp16 calls on Blackwell (capability 10.0) on ts_moe's sm_100a kernel.

    Off by default: the kernel compiles, its PTX is checked and its barrier
    protocol model-checked, but it has never run on a Blackwell GPU here, so
    sm_100 gets ``torch._grouped_mm`` unless a user opts in (for example to
    try it on hardware).  Takes effect on the next call.
    """
    global _sm100_opt_in
    _sm100_opt_in = bool(enabled)


def cuda_path(device_index: int, dtype: torch.dtype, out_dtype: torch.dtype | None = None,
              num_experts: int = 1):
    """``(path, kernel module or None)`` of a call on CUDA device ``device_index``
    (``TS_MOE_REFERENCE=1``, read at a device's first call: the reference)."""
    return _cuda_path(device_index, dtype, out_dtype, num_experts, _sm100_opt_in)


@functools.cache
def _cuda_path(device_index, dtype, out_dtype, num_experts, sm100_opt_in):
    if os.environ.get("TS_MOE_REFERENCE") == "1":
        return Path.REFERENCE, None
    kernels = _kernels(device_index)
    path = choose_path(torch.cuda.get_device_capability(device_index), dtype, out_dtype,
                       num_experts, kernels_available=kernels is not None,
                       kernel_max_experts=kernels.MAX_EXPERTS if kernels else 0,
                       has_torch_grouped_mm=hasattr(torch, "_grouped_mm"),
                       sm100_opt_in=sm100_opt_in)
    return path, kernels


def graph_path(device_index: int, dtype: torch.dtype, num_experts: int) -> Path | None:
    """The path of the layer's calls in ``dtype`` with ``num_experts`` experts on
    this CUDA device where it never syncs with the host, so that a CUDA graph
    can hold it (the kernel paths, torch's grouped_mm in 16 bits), else None
    (its float32 loop and the reference read ``offs`` on the host)."""
    path = cuda_path(device_index, dtype, None, num_experts)[0]
    if path in (Path.KERNEL_SM90, Path.KERNEL_SM100) or (
            path is Path.TORCH_GROUPED_MM and dtype != torch.float32):
        return path
    return None


def kernel_arch(device_index: int) -> str | None:
    """'sm_90a' when bf16 calls on this CUDA device run the CuTeDSL kernels, else None."""
    return "sm_90a" if cuda_path(device_index, torch.bfloat16)[0] is Path.KERNEL_SM90 else None


# ---------------------------------------------------------- shared plumbing
def _row_pad(n, dtype: torch.dtype):
    """``n`` rounded up to whole 16-byte vectors of ``dtype`` (SymInt-safe)."""
    align = ALIGN_BYTES // dtype.itemsize
    return (n + align - 1) // align * align


def _empty_output(like: torch.Tensor, m: int, n: int, dtype: torch.dtype,
                  experts: int | None = None) -> torch.Tensor:
    """(m, n), or (experts, m, n), with rows padded to 16 bytes, as torch's
    grouped_mm allocates them; the padding is real memory: the kernels store
    whole 16-byte vectors."""
    pad = _row_pad(n, dtype)
    lead = (m,) if experts is None else (experts, m)
    if pad == n:
        return like.new_empty((*lead, n), dtype=dtype)
    return like.new_empty((*lead, pad), dtype=dtype)[..., :n]


def _padded_strides(shape, major: int, align: int) -> list[int]:
    """Strides of a dense tensor of ``shape``, stride 1 on ``major``, its rows padded."""
    order = [major] + [d for d in reversed(range(len(shape))) if d != major]
    strides, step = [0] * len(shape), 1
    for i, d in enumerate(order):
        strides[d] = step
        step *= -(-shape[d] // align) * align if i == 0 else shape[d]
    return strides


def _tma_view(t: torch.Tensor, major: int) -> torch.Tensor:
    """``t`` as a TMA descriptor (and torch's grouped_mm) reads it: stride 1 on
    ``major``, 16-byte aligned strides elsewhere.  A validated tensor differs
    from that only in strides that are never used (size-1 dims: replaced), in
    broadcast dims (stride 0) or in its major dim (an M-major ``a`` for the
    K-major kernels): those are copied, rows padded."""
    shape = t.shape
    natural = _padded_strides(shape, major, ALIGN_BYTES // t.element_size())
    stride = [natural[d] if size == 1 else s for d, (size, s) in enumerate(zip(shape, t.stride()))]
    if stride[major] != 1 or any(s == 0 and size > 1 for size, s in zip(shape, stride)):
        return torch.empty_strided(shape, natural, dtype=t.dtype, device=t.device).copy_(t)
    return t if tuple(stride) == t.stride() else t.as_strided(shape, stride)


def _torch_grouped_mm(a, b, offs, out_dtype=None) -> torch.Tensor:
    """``torch._grouped_mm`` with this op's semantics: ``offs`` read as the segment
    ends (clamped, made non-decreasing, on the device), rows past the last one zero."""
    ends = segment_ends(offs, a.shape[0]).to(torch.int32)
    a = _tma_view(a, contiguous_dim(a.shape, a.stride()))
    b = _tma_view(b, contiguous_dim(b.shape, b.stride()))
    out = torch._grouped_mm(a, b, offs=ends, out_dtype=out_dtype)
    past = torch.arange(a.shape[0], device=a.device) >= ends[-1]
    return out.masked_fill_(past.unsqueeze(1), 0)


def _without_kernel(t: torch.Tensor, out_dtype, num_experts: int) -> Path:
    """The path of a kernel-path call that the kernel can't take: what
    :func:`choose_path` gives this device without the kernels."""
    return choose_path(torch.cuda.get_device_capability(t.device), t.dtype, out_dtype,
                       num_experts, kernels_available=False,
                       has_torch_grouped_mm=hasattr(torch, "_grouped_mm"))


def _grouped_gemm_k_run(path: Path, a, b, offs, out_dtype=None) -> torch.Tensor:
    """The k-grouped form, a (K, M) and b (M, N) to (E, K, N), of a validated call.

    sm_90: the k-grouped CuTeDSL kernel (a and b read M-major; K and N
    multiples of 8); torch's k-grouped ``_grouped_mm`` for what it can't
    take; the reference elsewhere.  Experts without rows get zeros."""
    out_dtype = out_dtype or a.dtype
    (k, m), n, num_experts = a.shape, b.shape[1], offs.shape[0]
    out = _empty_output(a, k, n, out_dtype, experts=num_experts)
    if 0 in (num_experts, k, m, n):
        return out.zero_()
    if path is Path.KERNEL_SM90:
        kernels = _module("grouped_gemm_dw_sm90_launch")
        if (kernels is not None and k % 8 == 0 and n % 8 == 0
                and num_experts <= kernels.MAX_EXPERTS):
            return kernels.grouped_gemm_k(_tma_view(a, 0).t(), _tma_view(b, 1), offs, out)
    if path in (Path.KERNEL_SM90, Path.KERNEL_SM100):
        path = _without_kernel(a, out_dtype, num_experts)
    if path is Path.TORCH_GROUPED_MM:
        ends = segment_ends(offs, m).to(torch.int32)
        got = torch._grouped_mm(_tma_view(a, contiguous_dim(a.shape, a.stride())),
                                _tma_view(b, contiguous_dim(b.shape, b.stride())),
                                offs=ends, out_dtype=out_dtype)
        if got.stride() != out.stride():
            got = out.copy_(got)
        empty = torch.diff(ends, prepend=ends.new_zeros(1)) == 0
        return got.masked_fill_(empty.view(-1, 1, 1), 0)
    return out.copy_(grouped_gemm_k_reference(a, b, offs, out_dtype))


def _sm90_module(t: torch.Tensor, name: str):
    """``csrc_free_kernels.<name>`` where ``t``'s CUDA device runs the sm_90
    kernels (its bf16 calls take :attr:`Path.KERNEL_SM90`), else None."""
    if t.device.type != "cuda" or cuda_path(t.get_device(), torch.bfloat16)[0] is not \
            Path.KERNEL_SM90:
        return None
    return _module(name)


def _rows_ok(t: torch.Tensor) -> bool:
    """16-bit rows the row kernel reads and writes whole 16-byte vectors of."""
    return (t.dtype in (torch.bfloat16, torch.float16) and t.shape[1] % 8 == 0
            and t.stride(1) == 1 and (t.shape[0] <= 1 or t.stride(0) % 8 == 0)
            and t.data_ptr() % ALIGN_BYTES == 0)


def _gather_rows(path: Path, a: torch.Tensor, a_index: torch.Tensor) -> torch.Tensor:
    """``a[a_index]`` with zero rows for indices outside ``[0, M)``: one launch of
    the row kernel on the sm_90 path, else :func:`ts_moe.reference.gather_rows`."""
    kernels = _module("route_sm90_launch") if path is Path.KERNEL_SM90 else None
    if (kernels is not None and a.shape[0] and _rows_ok(a)
            and a_index.dtype in (torch.int32, torch.int64)):
        index = a_index if a_index.is_contiguous() else a_index.contiguous()
        return kernels.weighted_row_sum(a, index, None, a.new_empty(index.shape[0], a.shape[1]))
    return gather_rows(a, a_index)


# ------------------------------------------------------------- grouped_gemm
def _grouped_gemm_run(path: Path, kernels, a, b, offs, out_dtype=None, a_index=None):
    """Any validated call on ``path``, the degenerate sizes included; ``a_index``
    only for the sm_100 kernel (which gathers), the others take gathered rows."""
    if b.dim() == 2:
        return _grouped_gemm_k_run(path, a, b, offs, out_dtype)
    m, n = (a if a_index is None else a_index).shape[0], b.shape[2]
    out_dtype = out_dtype or a.dtype
    if m == 0 or n == 0 or a.shape[1] == 0 or b.shape[0] == 0:
        return _empty_output(a, m, n, out_dtype).zero_()
    if path is Path.KERNEL_SM100:
        if a.shape[1] % 8 == 0:  # the kernel gathers whole 16-byte chunks
            return kernels.grouped_gemm(_tma_view(a, 1),
                                        _tma_view(b, contiguous_dim(b.shape, b.stride())), offs,
                                        _empty_output(a, m, n, out_dtype), a_index=a_index)
        path = _without_kernel(a, out_dtype, b.shape[0])
    if a_index is not None:
        a = _gather_rows(path, a, a_index)
    if path is Path.KERNEL_SM90:
        out = _empty_output(a, m, n, out_dtype)
        return kernels.grouped_gemm(_tma_view(a, 1), _tma_view(b, contiguous_dim(b.shape, b.stride())),
                                    offs, out_dtype, out=out)
    if path is Path.TORCH_GROUPED_MM:
        return _torch_grouped_mm(a, b, offs, out_dtype)
    return _empty_output(a, m, n, out_dtype).copy_(grouped_gemm_reference(a, b, offs, out_dtype))


def _grouped_gemm_cpu(a, b, offs, out_dtype=None, *, a_index=None, prefetch_weights=False):
    check_grouped_gemm_args(a, b, offs, out_dtype, a_index=a_index)
    if a_index is not None:
        a = gather_rows(a, a_index)
    return _grouped_gemm_run(Path.REFERENCE, None, a, b, offs, out_dtype)


def _grouped_gemm_cuda(a, b, offs, out_dtype=None, *, a_index=None, prefetch_weights=False):
    index = a.get_device()
    path, kernels = cuda_path(index, a.dtype, out_dtype, offs.numel())
    if a_index is not None:
        check_grouped_gemm_args(a, b, offs, out_dtype, a_index=a_index)
        if path is Path.KERNEL_SM100:  # the kernel gathers itself
            return _grouped_gemm_run(path, kernels, a, b, offs, out_dtype, a_index)
        a = _gather_rows(path, a, a_index)  # the Hopper kernels take gathered rows
        prefetch_weights = True  # the gather is the kernel ahead: offs, b are older
    if path is Path.KERNEL_SM90 and plausible_kernel_args(a, b, offs, out_dtype, index):
        m, n = a.shape[0], b.shape[2]
        if n % 8:
            out = _empty_output(a, m, n, out_dtype or a.dtype)
        elif out_dtype is None or out_dtype == a.dtype:
            out = a.new_empty(m, n)  # the cheapest allocation call (host budget)
        else:
            out = torch.empty(m, n, dtype=out_dtype, device=a.device)
        try:  # the hot path: the compiled kernel checks the rest
            return kernels.grouped_gemm(a, b, offs, out_dtype, out=out,
                                        prefetch_weights=prefetch_weights)
        except ValueError:  # name the bad argument, or re-stride what the kernel can't take
            pass
    check_grouped_gemm_args(a, b, offs, out_dtype)
    return _grouped_gemm_run(path, kernels, a, b, offs, out_dtype)


@torch.library.register_fake("ts_moe::grouped_gemm", lib=_lib)
def _grouped_gemm_fake(a, b, offs, out_dtype=None, *, a_index=None, prefetch_weights=False):
    check_grouped_gemm_args(a, b, offs, out_dtype, fake=True, a_index=a_index)
    dtype = out_dtype or a.dtype
    if b.dim() == 2:  # k-grouped: (E, K, N)
        k, n = a.shape[0], b.shape[1]
        pad = _row_pad(n, dtype)
        return a.new_empty_strided((offs.shape[0], k, n), (k * pad, pad, 1), dtype=dtype)
    n = b.shape[2]
    m = a.shape[0] if a_index is None else a_index.shape[0]
    return a.new_empty_strided((m, n), (_row_pad(n, dtype), 1), dtype=dtype)


_lib.impl("grouped_gemm", _grouped_gemm_cpu, "CPU")
_lib.impl("grouped_gemm", _grouped_gemm_cuda, "CUDA")
_grouped_gemm_op = torch.ops.ts_moe.grouped_gemm.default


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                 out_dtype: torch.dtype | None = None, *,
                 a_index: torch.Tensor | None = None,
                 prefetch_weights: bool = False) -> torch.Tensor:
    """``torch.ops.ts_moe.grouped_gemm``: ``out[r] = a[r] @ b[e]`` for the rows of expert ``e``.

    a: (M, K) bf16/fp16/fp32 (float64: reference path, for gradcheck); b:
    (E, K, N), either of its last two dims contiguous (``w.transpose(-2,
    -1)`` of an (E, N, K) nn.Linear weight works), other strides 16-byte
    aligned; offs: int32 (E,) cumulative row ends.  Returns (M, N) in
    ``out_dtype`` (default ``a.dtype``; float32 allowed), zeros past ``offs[-1]``.

    b 2-D: the k-grouped form, a (K, M) and b (M, N) to (E, K, N), ``out[e] =
    a[:, rows e] @ b[rows e]`` (the weight gradient ``grouped_gemm(x.t(), dy,
    offs)``; no ``a_index``).  Differentiable in ``a`` and ``b`` in both forms.

    ``a_index``: int32 (M',): gather the rows first, ``out[r] = a[a_index[r]]
    @ b[e(r)]``, (M', N) (the MoE layer's token rows in expert order, without
    a separate permuted copy).  Indices are read on the device only: one
    outside ``[0, M)`` reads as a zero row (its output row is zero), never
    out of bounds.  ``a``'s own strides are then free.

    ``prefetch_weights``: a promise about the kernel launched last on this
    stream before the op: it did not write ``offs`` or ``b``, and it lets its
    dependents launch only once everything before it has completed (every
    ts_moe kernel does; so does any kernel launched without programmatic
    dependent launch).  The sm_90 kernel may then start streaming the weights
    while that kernel still runs; tokens and output wait for it as always.
    The MoE block sets it for its down projection, whose ``offs`` the routing
    kernel wrote three launches earlier.  With ``a_index`` it holds anyway
    (the op's own row gather runs in between).  Not under ``torch.compile``
    (the compiler orders the launches); elsewhere a hint, ignored.
    """
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and isinstance(offs, torch.Tensor)):
        check_tensor_types(a=a, b=b, offs=offs)
    if prefetch_weights is not False:
        if not isinstance(prefetch_weights, bool):
            raise TypeError(f"prefetch_weights must be a bool, got "
                            f"{type(prefetch_weights).__name__}")
        if a_index is None:  # with a_index the op prefetches anyway
            return _grouped_gemm_op(a, b, offs, out_dtype, prefetch_weights=True)
    if a_index is None:
        return _grouped_gemm_op(a, b, offs, out_dtype)
    check_tensor_types(a_index=a_index)
    return _grouped_gemm_op(a, b, offs, out_dtype, a_index=a_index)


# ------------------------------------------------------ grouped_gemm_swiglu
def _swiglu_run(path: Path, kernels, a, gate_up, offs, a_index=None) -> torch.Tensor:
    """Any validated call on ``path``: the fused kernel where its tiles fit I,
    else the GEMM to (M, 2I) and the activation in fp32 apart; ``a_index`` only
    for the sm_100 kernel (which gathers), the others take gathered rows."""
    k = a.shape[1]
    m = (a if a_index is None else a_index).shape[0]
    num_experts, two_i, _ = gate_up.shape
    if m == 0 or two_i == 0 or k == 0 or num_experts == 0:
        return _empty_output(a, m, two_i // 2, a.dtype).zero_()
    if path is Path.KERNEL_SM100:
        if k % 8 == 0 and kernels.swiglu_config(num_experts, two_i, k, m) is not None:
            return kernels.grouped_gemm(
                _tma_view(a, 1), _tma_view(gate_up, 2).transpose(-2, -1), offs,
                _empty_output(a, m, two_i // 2, a.dtype), a_index=a_index, swiglu=True)
        path = _without_kernel(a, None, num_experts)  # what the kernel cannot take
    if a_index is not None:
        a = _gather_rows(path, a, a_index)
    if path is Path.KERNEL_SM90:
        config = kernels.swiglu_config(num_experts, two_i, k, m)
        if config is not None:
            return kernels.grouped_gemm_swiglu(
                _tma_view(a, 1), _tma_view(gate_up, contiguous_dim(gate_up.shape, gate_up.stride())),
                offs,
                out=_empty_output(a, m, two_i // 2, a.dtype), config=config)
        h = _grouped_gemm_run(path, kernels, a, gate_up.transpose(-2, -1), offs, torch.float32)
    elif path is Path.TORCH_GROUPED_MM:
        # bf16 out keeps torch on its fast path: h is rounded once more than
        # on the other paths (within bf16 tolerance of the fp32 activation)
        h = _torch_grouped_mm(a, gate_up.transpose(-2, -1), offs).float()
    else:
        h = None
    out = _empty_output(a, m, two_i // 2, a.dtype)
    if h is None:
        return out.copy_(grouped_gemm_swiglu_reference(a, gate_up, offs))
    return out.copy_(swiglu(h, a.dtype))


def _grouped_gemm_swiglu_cpu(a, gate_up, offs, *, a_index=None):
    check_swiglu_args(a, gate_up, offs, a_index=a_index)
    if a_index is not None:
        a = gather_rows(a, a_index)
    return _swiglu_run(Path.REFERENCE, None, a, gate_up, offs)


def _grouped_gemm_swiglu_cuda(a, gate_up, offs, *, a_index=None):
    index = a.get_device()
    path, kernels = cuda_path(index, a.dtype, None, offs.numel())
    if a_index is not None:
        check_swiglu_args(a, gate_up, offs, a_index=a_index)
        if path is Path.KERNEL_SM100:  # the kernel gathers itself
            return _swiglu_run(path, kernels, a, gate_up, offs, a_index)
        a = _gather_rows(path, a, a_index)  # the Hopper kernels take gathered rows
    if (path is Path.KERNEL_SM90 and plausible_kernel_args(a, gate_up, offs, None, index)
            and gate_up.shape[1] % 2 == 0):
        m, k = a.shape
        num_experts, two_i, _ = gate_up.shape
        config = kernels.swiglu_config(num_experts, two_i, k, m)
        if config is not None:
            try:  # the hot path: the compiled kernel checks the rest
                return kernels.grouped_gemm_swiglu(
                    a, gate_up, offs, out=_empty_output(a, m, two_i // 2, a.dtype),
                    config=config, prefetch_weights=a_index is not None)  # after the gather
            except ValueError:  # name the bad argument, or re-stride what the kernel can't take
                pass
    check_swiglu_args(a, gate_up, offs)
    return _swiglu_run(path, kernels, a, gate_up, offs)


@torch.library.register_fake("ts_moe::grouped_gemm_swiglu", lib=_lib)
def _grouped_gemm_swiglu_fake(a, gate_up, offs, *, a_index=None):
    check_swiglu_args(a, gate_up, offs, fake=True, a_index=a_index)
    inter = gate_up.shape[1] // 2
    m = a.shape[0] if a_index is None else a_index.shape[0]
    return a.new_empty_strided((m, inter), (_row_pad(inter, a.dtype), 1))


_lib.impl("grouped_gemm_swiglu", _grouped_gemm_swiglu_cpu, "CPU")
_lib.impl("grouped_gemm_swiglu", _grouped_gemm_swiglu_cuda, "CUDA")
_grouped_gemm_swiglu_op = torch.ops.ts_moe.grouped_gemm_swiglu.default


def grouped_gemm_swiglu(a: torch.Tensor, gate_up: torch.Tensor, offs: torch.Tensor, *,
                        a_index: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.ops.ts_moe.grouped_gemm_swiglu``: ``silu(a @ gate^T) * (a @ up^T)`` per expert.

    gate_up: (E, 2I, H), the Hugging Face (transformers 5) layout, gate rows
    first.  Returns (M, I) in ``a.dtype``; rows past ``offs[-1]`` are zeros.
    The same ragged-expert rules, and ``a_index``, as :func:`grouped_gemm`.
    """
    if not (isinstance(a, torch.Tensor) and isinstance(gate_up, torch.Tensor)
            and isinstance(offs, torch.Tensor)):
        check_tensor_types(a=a, gate_up=gate_up, offs=offs)
    if a_index is None:
        return _grouped_gemm_swiglu_op(a, gate_up, offs)
    check_tensor_types(a_index=a_index)
    return _grouped_gemm_swiglu_op(a, gate_up, offs, a_index=a_index)


# ------------------------------------------------- the SwiGLU activation alone
# Ops of their own (not plain calls) so that traced graphs (torch.compile of a
# training step) hold them with a fake kernel: the autograd formula of
# ``grouped_gemm_swiglu`` uses them.
_lib.define("swiglu(Tensor h) -> Tensor")
_lib.define("swiglu_backward(Tensor dy, Tensor h) -> Tensor")


def _elementwise_for(h: torch.Tensor):
    """The elementwise kernel module where ``h``'s calls run the sm_90a kernels, else None."""
    if h.dtype not in (torch.bfloat16, torch.float16) or h.shape[-1] % 16:
        return None
    return _sm90_module(h, "swiglu_sm90_launch")


def _swiglu_impl(h):
    check_swiglu_activation_args(h)
    out = _empty_output(h, h.shape[0], h.shape[1] // 2, h.dtype)
    kernels = _elementwise_for(h)
    if kernels is not None:
        return kernels.swiglu_forward(_operand(h), out)
    return out.copy_(swiglu(h.to(acc_dtype(h.dtype)), h.dtype))


def _swiglu_backward_impl(dy, h):
    check_swiglu_activation_args(h, dy)
    dh = _empty_output(h, h.shape[0], h.shape[1], h.dtype)
    kernels = _elementwise_for(h)
    if kernels is not None:
        return kernels.swiglu_backward(_operand(dy), _operand(h), dh)
    return dh.copy_(swiglu_backward(dy, h, h.dtype))


@torch.library.register_fake("ts_moe::swiglu", lib=_lib)
def _swiglu_fake(h):
    check_swiglu_activation_args(h)
    inter = h.shape[1] // 2
    return h.new_empty_strided((h.shape[0], inter), (_row_pad(inter, h.dtype), 1))


@torch.library.register_fake("ts_moe::swiglu_backward", lib=_lib)
def _swiglu_backward_fake(dy, h):
    check_swiglu_activation_args(h, dy)
    return h.new_empty_strided(h.shape, (_row_pad(h.shape[1], h.dtype), 1))


for _key in ("CPU", "CUDA"):
    _lib.impl("swiglu", _swiglu_impl, _key)
    _lib.impl("swiglu_backward", _swiglu_backward_impl, _key)
_swiglu_op = torch.ops.ts_moe.swiglu.default


# ------------------------------------------------ routing, slot order, combine
_lib.define("router_logits(Tensor x, Tensor weight) -> Tensor")
_lib.define("route_slots(Tensor logits, int top_k) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_lib.define("sort_slots(Tensor experts, int num_experts) -> (Tensor, Tensor, Tensor)")
_lib.define("combine(Tensor y_sorted, Tensor weights, Tensor inverse) -> Tensor")


_router_kernel_opt_in = False
# the router kernel's CTAs read x's rows once per expert pair: it takes a batch
# while they read at most this much (about 250 KB per SM of the H200), e.g.
# Qwen3-30B-A3B up to 64 tokens, DeepSeek-V3 up to 8 (not yet measured: see
# use_router_kernel)
ROUTER_KERNEL_MAX_READ = 32 << 20
# route_slots in one CTA spends about 900 warp instructions a token at 128
# experts on its top-k rounds (one SM, issue-bound: 9 us at Qwen3-30B-A3B
# T=64, 17 at DeepSeek-V3 T=64).  From this many tokens x logits per lane
# (E / 32), with use_router_kernel, the routing runs a warp a token on many
# CTAs and the slot order in a second launch (an estimate: Qwen3 from T=32,
# DeepSeek-V3 from T=16, Mixtral from T=128; bench/RESULTS.md "fifth pass")
ROUTE_SPLIT_MIN_WORK = 128


def use_router_kernel(enabled: bool = True) -> bool:
    """Take :func:`router_logits` of small batches (bf16/fp16, the kernel's reads
    within ``ROUTER_KERNEL_MAX_READ``) on the sm_90 path to ts_moe's router
    kernel (``route_sm90.RouterLogits``: one launch, fp32 sums in a fixed order)
    instead of ``F.linear`` (cuBLAS: two launches at decode shapes), and
    :func:`route_slots` of batches from ``ROUTE_SPLIT_MIN_WORK`` to the top-k on
    many CTAs (``route_sm90.RouteTopK``) and the slot order in a second launch
    (the same experts, weights and order, bit for bit).  Off by
    default until it has been measured on the GPU (bench/RESULTS.md, "Issue 21,
    fifth pass").  Returns the previous setting; takes effect on the next call
    (the layer's decode graphs key on it; a ``torch.compile(mode="reduce-overhead")``
    graph keeps the router it was recorded with: set this before compiling)."""
    global _router_kernel_opt_in
    previous, _router_kernel_opt_in = _router_kernel_opt_in, bool(enabled)
    return previous


def router_kernel_enabled() -> bool:
    """Whether :func:`use_router_kernel` is on."""
    return _router_kernel_opt_in


def _router_rows_ok(t: torch.Tensor) -> bool:
    """Rows as the router kernel is compiled for: 16-byte vectors, 16-byte strides."""
    return _rows_ok(t) and t.stride(0) % 8 == 0


def _router_logits_impl(x, weight):
    routing.check_router_args(x, weight)
    kernels = _sm90_module(x, "router_sm90_launch") if _router_kernel_opt_in else None
    # the choice rests on shapes, dtypes and the weight (which a decode graph
    # keys on), never on x's strides: x's rows are copied where the kernel
    # cannot read them, so that a graph replay routes as the eager call did
    if (kernels is not None and x.dtype in (torch.bfloat16, torch.float16)
            and 0 < x.shape[0] <= kernels.ROUTER_MAX_TOKENS and weight.shape[0]
            and x.shape[1] % 8 == 0 and _router_rows_ok(weight)
            and kernels.router_read_bytes(x.shape[0], *weight.shape) <= ROUTER_KERNEL_MAX_READ):
        if not _router_rows_ok(x):
            x = x.clone(memory_format=torch.contiguous_format)
        return kernels.router_logits(x, weight)
    return F.linear(x, weight)


def _route_slots_impl(logits, top_k):
    routing.check_route_args(logits, top_k)
    kernels = _sm90_module(logits, "route_sm90_launch")
    tokens, num_experts = logits.shape
    if (kernels is not None and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and kernels.fits(tokens * top_k, num_experts)):
        if (_router_kernel_opt_in
                and tokens * kernels.lane_width(num_experts) >= ROUTE_SPLIT_MIN_WORK):
            weights, experts = _sm90_module(logits, "router_sm90_launch").route_topk(
                logits.contiguous(), top_k)
            return (weights, experts, *kernels.sort_slots(experts, num_experts))
        return kernels.route_slots(logits.contiguous(), top_k)
    weights, experts = routing.route(logits, top_k)
    experts = experts.contiguous()  # a slice of the sort: the kernel's layout
    return (weights.contiguous(), experts, *routing.sort_slots(experts, logits.shape[1]))


def _sort_slots_impl(experts, num_experts):
    routing.check_experts(experts, num_experts)
    kernels = _sm90_module(experts, "route_sm90_launch")
    if kernels is not None and kernels.fits(experts.numel(), num_experts):
        return kernels.sort_slots(experts.contiguous(), num_experts)
    return tuple(routing.sort_slots(experts, num_experts))


def _combine_impl(y_sorted, weights, inverse):
    routing.check_combine_args(y_sorted, weights, inverse)
    kernels = _sm90_module(y_sorted, "route_sm90_launch")
    if (kernels is not None and y_sorted.shape[0] and _rows_ok(y_sorted)
            and weights.device == inverse.device == y_sorted.device):
        w = weights if weights.dtype == torch.float32 else weights.float()
        out = y_sorted.new_empty(weights.shape[0], y_sorted.shape[1])
        return kernels.weighted_row_sum(y_sorted, inverse.contiguous(), w.contiguous(), out)
    return routing.combine(y_sorted, weights, inverse)


@torch.library.register_fake("ts_moe::router_logits", lib=_lib)
def _router_logits_fake(x, weight):
    routing.check_router_args(x, weight)
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("ts_moe::route_slots", lib=_lib)
def _route_slots_fake(logits, top_k):
    routing.check_route_args(logits, top_k)
    tokens, num_experts = logits.shape
    return (logits.new_empty(tokens, top_k, dtype=torch.float32),
            logits.new_empty(tokens, top_k, dtype=torch.int64),
            logits.new_empty(tokens * top_k, dtype=torch.int32),
            logits.new_empty(num_experts, dtype=torch.int32),
            logits.new_empty(tokens * top_k, dtype=torch.int64))


@torch.library.register_fake("ts_moe::sort_slots", lib=_lib)
def _sort_slots_fake(experts, num_experts):
    routing.check_experts(experts, num_experts)
    slots = experts.numel()
    return (experts.new_empty(slots, dtype=torch.int32),
            experts.new_empty(num_experts, dtype=torch.int32),
            experts.new_empty(slots, dtype=torch.int64))


@torch.library.register_fake("ts_moe::combine", lib=_lib)
def _combine_fake(y_sorted, weights, inverse):
    routing.check_combine_args(y_sorted, weights, inverse)
    return y_sorted.new_empty(weights.shape[0], y_sorted.shape[1])


for _key in ("CPU", "CUDA"):
    _lib.impl("router_logits", _router_logits_impl, _key)
    _lib.impl("route_slots", _route_slots_impl, _key)
    _lib.impl("sort_slots", _sort_slots_impl, _key)
    _lib.impl("combine", _combine_impl, _key)
_router_logits_op = torch.ops.ts_moe.router_logits.default
_route_slots_op = torch.ops.ts_moe.route_slots.default
_sort_slots_op = torch.ops.ts_moe.sort_slots.default
_combine_op = torch.ops.ts_moe.combine.default


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The router's logits ``x @ weight.T`` (T, E) in x's dtype, fp32 sums
    (reference: :func:`ts_moe.routing.router_logits_reference`).

    ``torch.ops.ts_moe.router_logits``: ``F.linear``, or with
    :func:`use_router_kernel` a small batch on the sm_90 path in one launch of
    ts_moe's router kernel.  The op runs only where it may choose the kernel:
    with the switch off, or where x or weight need a gradient (the op is not
    differentiable itself), ``F.linear`` runs here, without the op's dispatch."""
    if not _router_kernel_opt_in or (
            torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                            for t in (x, weight))):
        routing.check_router_args(x, weight)
        return F.linear(x, weight)
    if not all(isinstance(t, torch.Tensor) for t in (x, weight)):
        routing.check_router_args(x, weight)  # the op validates the rest, once
    return _router_logits_op(x, weight)


def route_slots(logits: torch.Tensor, top_k: int):
    """:func:`ts_moe.route` and :func:`ts_moe.sort_slots` of its experts:
    ``(weights, experts, SlotOrder)``.

    ``torch.ops.ts_moe.route_slots``: on the sm_90 path a batch of up to
    1024 slots and 256 experts takes one launch (``csrc_free_kernels.route_sm90``;
    two for larger batches with :func:`use_router_kernel`), otherwise the
    plain-torch functions.  Not differentiable itself: where
    the logits need a gradient, the differentiable torch functions run.
    """
    if torch.is_grad_enabled() and isinstance(logits, torch.Tensor) and logits.requires_grad:
        weights, experts = routing.route(logits, top_k)
        return weights, experts, routing.sort_slots(experts, logits.shape[1])
    if not isinstance(logits, torch.Tensor) or type(top_k) is not int:
        routing.check_route_args(logits, top_k)  # the op validates the rest, once
    weights, experts, token_index, offs, inverse = _route_slots_op(logits, top_k)
    return weights, experts, routing.SlotOrder(token_index, offs, inverse)


def sort_slots(experts: torch.Tensor, num_experts: int):
    """:func:`ts_moe.sort_slots` as ``torch.ops.ts_moe.sort_slots``: one launch on
    the sm_90 path for up to 1024 slots and 256 experts."""
    if not isinstance(experts, torch.Tensor) or type(num_experts) is not int:
        routing.check_experts(experts, num_experts)  # the op validates the rest, once
    return routing.SlotOrder(*_sort_slots_op(experts, num_experts))


def combine(y_sorted: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor):
    """:func:`ts_moe.combine` (``inverse`` a permutation, as :func:`sort_slots`
    makes it) as ``torch.ops.ts_moe.combine``: one launch on the sm_90 path
    (fp32 sums, one rounding, no atomics); where ``y_sorted`` or ``weights``
    need a gradient, the differentiable torch function."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (y_sorted, weights)):
        return routing.combine(y_sorted, weights, inverse)
    if not all(isinstance(t, torch.Tensor) for t in (y_sorted, weights, inverse)):
        routing.check_combine_args(y_sorted, weights, inverse)  # the op validates the rest
    return _combine_op(y_sorted, weights, inverse)


# ----------------------------------------------------------------- autograd
# The swiglu op under autograd keeps its pre-activation h (M, 2I) from the
# forward (True) or recomputes it in the backward (False): measured both, see
# bench/RESULTS.md "training: keep or recompute h"
SWIGLU_KEEPS_H = True


def _operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a gradient: contiguous, expanded, ...) as the ops take it: as is
    when its layout passes the checks, else a row-major copy with 16-byte rows."""
    if layout_ok(t):
        return t
    strides = _padded_strides(t.shape, t.dim() - 1, ALIGN_BYTES // t.element_size())
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def scatter_rows(rows: torch.Tensor, a_index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The gradient of :func:`ts_moe.reference.gather_rows`: ``out[i]`` = the sum of
    ``rows[r]`` over ``a_index[r] == i``, (num_rows, K); indices outside
    ``[0, num_rows)`` (read as zero rows) get nothing: they are sent to a spare
    row past the end.  ``index_put_(accumulate=True)``: on CUDA torch's
    sort-based kernel (deterministic, no host sync; no fp32 copy of ``rows``,
    checked against an fp32 reference by the GPU tests)."""
    out = rows.new_zeros(num_rows + 1, rows.shape[1])
    if rows.shape[0]:
        index = a_index.long()
        outside = (index < 0) | (index >= num_rows)
        out.index_put_((index.masked_fill(outside, num_rows),), rows, accumulate=True)
    return out[:num_rows]


def _weight_grad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor,
                 like: torch.Tensor) -> torch.Tensor:
    """``dW[e] = x[rows e]^T @ dy[rows e]`` (E, K, N), by the k-grouped form, in the
    memory layout of the weight ``like`` (E, K, N): a K-contiguous weight (the
    transpose of an (E, N, K) ``nn.Linear`` stack) gets its gradient computed
    as (E, N, K) and transposed, so the optimiser sees the parameter's layout."""
    if like.stride(1) == 1 and like.shape[1] > 1:
        return grouped_gemm(dy.t(), x, offs).transpose(-2, -1)
    return grouped_gemm(x.t(), dy, offs)


def grouped_gemm_backward(dy, a, b, offs, a_index=None, need_a=True, need_b=True):
    """``(da, db)`` of ``grouped_gemm(a, b, offs, out_dtype, a_index=a_index)`` for
    the output's gradient ``dy``; each None where not needed.  Every product is
    the op itself, so each gradient runs on the forward's path (kernels, torch,
    reference), with no host sync:

    - row-grouped (b (E, K, N)): ``da = grouped_gemm(dy, b^T)`` (scattered back
      through ``a_index``), ``db = grouped_gemm(a.t(), dy)`` (k-grouped);
    - k-grouped (a (K, M), b (M, N), dy (E, K, N)): ``da^T = grouped_gemm(b,
      dy^T)``, ``db = grouped_gemm(a.t(), dy)`` (both row-grouped).

    Rows past ``offs[-1]`` (and experts without rows) get zero gradients.
    ``dy`` in float32 (``out_dtype``) is rounded to ``a.dtype`` first.
    """
    dy = _operand(dy.to(a.dtype))
    da = db = None
    if b.dim() == 2:
        if need_a:
            da = grouped_gemm(b, dy.transpose(-2, -1), offs).t()
        if need_b:
            db = grouped_gemm(a.t(), dy, offs)
        return da, db
    if need_a:
        da = grouped_gemm(dy, b.transpose(-2, -1), offs)
        if a_index is not None:
            da = scatter_rows(da, a_index, a.shape[0])
    if need_b:
        x = a if a_index is None else gather_rows(a, a_index)
        db = _weight_grad(x, dy, offs, b)
    return da, db


def grouped_gemm_swiglu_backward(dy, a, gate_up, offs, a_index=None, need_a=True,
                                 need_gate_up=True):
    """``(da, dgate_up)`` of ``grouped_gemm_swiglu`` without :data:`SWIGLU_KEEPS_H`:
    the pre-activation ``h`` (M, 2I) recomputed, ``dh`` = d(SwiGLU)/dh
    (``ts_moe::swiglu_backward``), then ``da = grouped_gemm(dh, gate_up)`` and
    ``dgate_up = grouped_gemm(dh.t(), a)`` (k-grouped).  (With it, the op is the
    GEMM to h and ``ts_moe::swiglu``, each with its own formula.)"""
    x = a if a_index is None else gather_rows(a, a_index)
    dh = torch.ops.ts_moe.swiglu_backward(dy.to(a.dtype),
                                          grouped_gemm(x, gate_up.transpose(-2, -1), offs))
    da = dgate_up = None
    if need_a:
        da = grouped_gemm(dh, gate_up, offs)
        if a_index is not None:
            da = scatter_rows(da, a_index, a.shape[0])
    if need_gate_up:
        dgate_up = _weight_grad(x, dh, offs, gate_up.transpose(-2, -1)).transpose(-2, -1)
    return da, dgate_up


_after_autograd = torch._C._after_autograd_keyset


class _GroupedGemmFunction(torch.autograd.Function):
    """``grouped_gemm`` under autograd: the forward below autograd, the backward
    :func:`grouped_gemm_backward` (itself made of ops, so double backward works)."""

    @staticmethod
    def forward(ctx, keyset, a, b, offs, out_dtype, a_index):
        ctx.save_for_backward(a, b, offs, a_index)
        with torch._C._AutoDispatchBelowAutograd():
            return _grouped_gemm_op.redispatch(keyset & _after_autograd, a, b, offs, out_dtype,
                                               a_index=a_index)

    @staticmethod
    def backward(ctx, dy):
        a, b, offs, a_index = ctx.saved_tensors
        da, db = grouped_gemm_backward(dy, a, b, offs, a_index, *ctx.needs_input_grad[1:3])
        return None, da, db, None, None, None


class _SwigluRecomputeFunction(torch.autograd.Function):
    """``grouped_gemm_swiglu`` under autograd without :data:`SWIGLU_KEEPS_H`: the
    fused forward; ``h`` recomputed in the backward."""

    @staticmethod
    def forward(ctx, keyset, a, gate_up, offs, a_index):
        ctx.save_for_backward(a, gate_up, offs, a_index)
        with torch._C._AutoDispatchBelowAutograd():
            return _grouped_gemm_swiglu_op.redispatch(keyset & _after_autograd, a, gate_up, offs,
                                                      a_index=a_index)

    @staticmethod
    def backward(ctx, dy):
        a, gate_up, offs, a_index = ctx.saved_tensors
        da, dgate_up = grouped_gemm_swiglu_backward(dy, a, gate_up, offs, a_index,
                                                    *ctx.needs_input_grad[1:3])
        return None, da, dgate_up, None, None


class _SwigluActivationFunction(torch.autograd.Function):
    """``ts_moe::swiglu`` under autograd: keeps ``h``; backward ``ts_moe::swiglu_backward``."""

    @staticmethod
    def forward(ctx, keyset, h):
        ctx.save_for_backward(h)
        with torch._C._AutoDispatchBelowAutograd():
            return _swiglu_op.redispatch(keyset & _after_autograd, h)

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        return None, torch.ops.ts_moe.swiglu_backward(dy.to(h.dtype), h)


def _grouped_gemm_autograd(keyset, a, b, offs, out_dtype=None, *, a_index=None,
                           prefetch_weights=False):
    # prefetch_weights is a hint about the launch order, not part of the math
    return _GroupedGemmFunction.apply(keyset, a, b, offs, out_dtype, a_index)


def _swiglu_autograd(keyset, a, gate_up, offs, *, a_index=None):
    if SWIGLU_KEEPS_H:
        # two autograd nodes, the GEMM to h and the activation, so that the
        # engine frees h and the activation's gradient once dh exists (as for
        # any plain-torch layer) rather than at the end of one fused node
        h = grouped_gemm(a, gate_up.transpose(-2, -1), offs, a_index=a_index)
        return torch.ops.ts_moe.swiglu(h)
    return _SwigluRecomputeFunction.apply(keyset, a, gate_up, offs, a_index)


def _activation_autograd(keyset, h):
    return _SwigluActivationFunction.apply(keyset, h)


def _autograd_kernel(op: torch._ops.OpOverload, backends: dict, with_grad, inputs: int = 2):
    """The Autograd-key kernel of ``op`` (its first ``inputs`` arguments are the
    differentiable ones): ``with_grad`` only when a gradient is wanted.
    Otherwise, for plain CPU or CUDA tensors (nothing traced, no mode or
    subclass below autograd), the backend kernel ``backends[key]`` right here
    instead of a second trip through the dispatcher (each Python kernel it
    enters costs about 1.3 us of the 20 us host budget); anything else
    redispatches.  (``torch.library.register_autograd`` would install such a
    kernel too, but one that always redispatches: the 1.3 us again.)"""
    # the exact keyset a plain tensor of each backend arrives with, as an int
    # (a DispatchKeySet is not hashable; comparing raw bits costs 0.1 us)
    plain = {_plain_keyset(key): fn for key, fn in backends.items()}

    def kernel(keyset, *args, **kwargs):
        if torch.is_grad_enabled() and (args[0].requires_grad
                                        or (inputs > 1 and args[1].requires_grad)):
            return with_grad(keyset, *args, **kwargs)
        direct = plain.get(keyset.raw_repr())
        if direct is not None:
            return direct(*args, **kwargs)
        return op.redispatch(keyset & _after_autograd, *args, **kwargs)

    return kernel


def _plain_keyset(backend: str) -> int:
    key = torch._C.DispatchKey
    return torch._C.DispatchKeySet(getattr(key, backend)).add(
        getattr(key, "Autograd" + backend)).raw_repr()


_lib.impl("grouped_gemm", _autograd_kernel(_grouped_gemm_op, {
    "CPU": _grouped_gemm_cpu, "CUDA": _grouped_gemm_cuda}, _grouped_gemm_autograd), "Autograd",
    with_keyset=True)
_lib.impl("grouped_gemm_swiglu", _autograd_kernel(_grouped_gemm_swiglu_op, {
    "CPU": _grouped_gemm_swiglu_cpu, "CUDA": _grouped_gemm_swiglu_cuda}, _swiglu_autograd),
    "Autograd", with_keyset=True)
_lib.impl("swiglu", _autograd_kernel(_swiglu_op, {"CPU": _swiglu_impl, "CUDA": _swiglu_impl},
                                     _activation_autograd, inputs=1), "Autograd", with_keyset=True)
