"""Argument checks shared by the ops: metadata only, so no host sync, and all
of them run before any kernel, so a bad call never half-writes an output.

One rule set for every path (CPU reference, CUDA kernels, torch's grouped_mm,
the fake kernel under ``torch.compile``), so that a call gives the same result
or the same error everywhere.  The rules are ``F.grouped_mm``'s where it has
one (16-byte aligned strides, any K and N), and accept more where the result is
still well defined: size-1 dims (whose stride never matters), zero strides
(broadcast inputs) and empty tensors (whose strides are never read).

They run on every call, so they read each tensor's metadata once (the host
overhead budget of an op call is 20 us).
"""

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # float64: reference path
ALIGN_BYTES = 16  # TMA and torch's grouped_mm: base address and every non-unit stride
MAX_ROWS = 2**31 - 1  # offs is int32, and the kernels index rows in 32 bits
MAX_EXPERTS = 2**31 - 1  # the ids int32 experts hold (a dropped slot's id is num_experts)


def check_tensor_types(**tensors) -> None:
    """A TypeError naming the argument before the dispatcher's generic one."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def contiguous_dim(shape, stride) -> int | None:
    """The dim of the last two with stride 1 (preferring one longer than 1), or None.

    A dim of size 1 counts as contiguous whatever its stride: ``w.t()[None]``
    of a (K, 1) weight, or ``x[:1]``."""
    rank = len(shape)
    rows, cols = shape[-2:]
    s_row, s_col = stride[-2:]
    if s_col == 1 and cols > 1:
        return rank - 1
    if s_row == 1 and rows > 1:
        return rank - 2
    if cols == 1:
        return rank - 1
    if rows == 1:
        return rank - 2
    return None


def _check_layout(name: str, shape, stride, elem: int) -> None:
    """One of the last two dims contiguous (stride 1), every other stride 16-byte aligned.

    Dims of size 1 are free (their stride is never used); an empty tensor is
    never read, so any strides do."""
    if 0 in shape:
        return
    major = contiguous_dim(shape, stride)
    if major is None:
        raise ValueError(
            f"{name} needs one of its last two dims contiguous (stride 1); got strides "
            f"{tuple(stride)} for shape {tuple(shape)}")
    for dim in range(len(shape)):
        if dim != major and shape[dim] != 1 and (stride[dim] * elem) % ALIGN_BYTES:
            raise ValueError(
                f"{name}: stride {stride[dim]} of dim {dim} is not a multiple of "
                f"{ALIGN_BYTES // elem} elements ({ALIGN_BYTES}-byte alignment)")


def layout_ok(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides pass the ops' layout rule (:func:`_check_layout`)."""
    try:
        _check_layout("t", t.shape, t.stride(), t.element_size())
    except ValueError:
        return False
    return True


def check_grouped_gemm_args(a, b, offs, out_dtype=None, *, b_name: str = "b",
                            k_dim: int = 1, fake: bool = False, a_index=None) -> None:
    """Validate ``grouped_gemm``-style arguments; ``b``'s K is dim ``k_dim`` (1 or 2).

    ``b`` 3-D (E, K, N): the row-grouped form, ``a`` (M, K).  ``b`` 2-D (M, N)
    (only as ``b``): the k-grouped form of ``F.grouped_mm``, ``a`` (K, M), the
    experts split the shared dim M, the result is (E, K, N) with E =
    ``len(offs)``.

    ``fake``: the tensors are fake (tracing): skip the data-pointer check,
    which is also skipped off the GPU, where only the TMA needs aligned
    pointers (safetensors memory-maps CPU weights at 8-byte offsets).
    ``a_index``: the rows are ``a[a_index]``, gathered into a fresh aligned
    tensor, so ``a``'s own strides and pointer are free and the row limit
    applies to ``a_index``'s length (row-grouped form only).
    """
    check_tensor_types(a=a, **{b_name: b}, offs=offs)
    a_shape, b_shape = a.shape, b.shape
    k_grouped = len(b_shape) == 2 and b_name == "b"
    for name, shape, rank in (("a", a_shape, 2), (b_name, b_shape, 2 if k_grouped else 3),
                              ("offs", offs.shape, 1)):
        if len(shape) != rank:
            expected = "2-D or 3-D" if name == "b" else f"{rank}-D"
            raise ValueError(f"{name} must be {expected}, got shape {tuple(shape)}")
    dtype = a.dtype
    if dtype not in DTYPES:
        raise TypeError(f"a must be bfloat16, float16, float32 or float64, got {dtype}")
    if b.dtype != dtype:
        raise TypeError(f"{b_name} must have a's dtype {dtype}, got {b.dtype}")
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must be int32, got {offs.dtype}")
    if out_dtype is not None and out_dtype != dtype and out_dtype != torch.float32:
        raise TypeError(f"out_dtype must be None, {dtype} or torch.float32, got {out_dtype}")
    device = a.device
    if b.device != device or offs.device != device:
        raise ValueError(
            f"a, {b_name} and offs must be on one device, got {device}, {b.device}, {offs.device}")
    if k_grouped:
        if a_index is not None:
            raise ValueError("a_index is only for a 3-D b (the row-grouped form); b is 2-D")
        if a_shape[1] != b_shape[0]:
            raise ValueError(
                f"M mismatch: in the k-grouped form a is (K, M) and b is (M, N); got a "
                f"{tuple(a_shape)} (M={a_shape[1]}) and b {tuple(b_shape)} (M={b_shape[0]})")
        if b_shape[0] > MAX_ROWS:
            raise ValueError(
                f"b has {b_shape[0]} rows; at most 2**31 - 1 are supported (offs is int32)")
    else:
        if offs.shape[0] != b_shape[0]:
            raise ValueError(
                f"offs must have one entry per expert: {b_name} has {b_shape[0]} experts, "
                f"offs has {offs.shape[0]} entries")
        if a_shape[0] > MAX_ROWS:
            raise ValueError(
                f"a has {a_shape[0]} rows; at most 2**31 - 1 are supported (offs is int32)")
        if a_index is not None:
            _check_a_index(a_index, device)
        k = a_shape[1]
        if b_shape[k_dim] != k:
            raise ValueError(
                f"K mismatch: a is {tuple(a_shape)} (K={k}), {b_name} is "
                f"{tuple(b_shape)} (K={b_shape[k_dim]})")
    if offs.shape[0] > 1 and offs.stride(0) != 1:
        raise ValueError("offs must be contiguous")
    elem = a.element_size()
    if a_index is None:
        _check_layout("a", a_shape, a.stride(), elem)
    _check_layout(b_name, b_shape, b.stride(), elem)
    if not fake and device.type == "cuda":
        for name, t in ((("a", a),) if a_index is None else ()) + ((b_name, b),):
            if t.numel() and t.data_ptr() % ALIGN_BYTES:
                raise ValueError(f"{name}: data pointer is not {ALIGN_BYTES}-byte aligned")


def _check_a_index(a_index, device) -> None:
    check_tensor_types(a_index=a_index)
    if a_index.dim() != 1:
        raise ValueError(f"a_index must be 1-D, got shape {tuple(a_index.shape)}")
    if a_index.dtype != torch.int32:
        raise TypeError(f"a_index must be int32, got {a_index.dtype}")
    if a_index.device != device:
        raise ValueError(f"a_index must be on a's device {device}, got {a_index.device}")
    if a_index.shape[0] > MAX_ROWS:
        raise ValueError(f"a_index has {a_index.shape[0]} entries; at most 2**31 - 1 are "
                         f"supported (offs is int32)")


def check_swiglu_args(a, gate_up, offs, fake: bool = False, a_index=None) -> None:
    """``grouped_gemm_swiglu``'s arguments: ``gate_up`` (E, 2I, H), K = H its last dim."""
    check_grouped_gemm_args(a, gate_up, offs, b_name="gate_up", k_dim=2, fake=fake,
                            a_index=a_index)
    if gate_up.shape[1] % 2:
        raise ValueError(
            f"gate_up must be (E, 2I, H) (gate rows, then as many up rows), got "
            f"{tuple(gate_up.shape)}: an odd number of rows")


def check_swiglu_activation_args(h, dy=None) -> None:
    """``ts_moe::swiglu(h)`` / ``swiglu_backward(dy, h)``: h (M, 2I), dy (M, I), one
    float dtype and device, layouts as the GEMMs' operands."""
    check_tensor_types(h=h, **({} if dy is None else {"dy": dy}))
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"h must be (M, 2I) (gate columns, then up), got shape {tuple(h.shape)}")
    if h.dtype not in DTYPES:
        raise TypeError(f"h must be bfloat16, float16, float32 or float64, got {h.dtype}")
    if dy is not None:
        if tuple(dy.shape) != (h.shape[0], h.shape[1] // 2):
            raise ValueError(f"dy must be (M, I) = {(h.shape[0], h.shape[1] // 2)}, "
                             f"got {tuple(dy.shape)}")
        if dy.dtype != h.dtype or dy.device != h.device:
            raise TypeError(f"dy must have h's dtype and device ({h.dtype}, {h.device}), got "
                            f"{dy.dtype}, {dy.device}")


def layout_ready(a, b, offs, out_dtype, device_index: int, k_dim: int = 1) -> bool:
    """Whether a row-grouped call is valid *and* in a layout every backend reads
    as it is, judged from a few metadata reads: then the op skips
    :func:`check_grouped_gemm_args` and the views of
    :func:`ts_moe.ops.layout.tma_view` (together about 7 us of the 20 us host
    budget of a call on the H200's host).

    True only where the full check passes: matching dtypes (16-bit or fp32),
    ``out_dtype``, ``b`` and ``offs`` on ``device_index`` (``a``'s device, read
    by the caller), ranks, K and E agreement, contiguous int32 ``offs``, no
    empty dim, the row limit; and the layout: a K-major ``a``, a ``b`` (K on
    dim ``k_dim``, as in :func:`check_grouped_gemm_args`) with a unit stride on
    one of its last two dims, every other stride of both a positive multiple
    of 16 bytes (size-1 dims included: a compiled kernel checks them all),
    aligned data pointers.  Anything else is False, not an error: the full
    check then names the bad argument, or the views re-stride what it accepts.
    Each tensor's shape and strides are read once (each read costs).  Pinned
    against the full check by ``tests/test_checks.py``.
    """
    dtype = a.dtype
    align = _READY_DTYPES.get(dtype)
    if (align is None or b.dtype != dtype or offs.dtype != torch.int32
            or not (out_dtype is None or out_dtype == dtype or out_dtype == torch.float32)):
        return False
    shape_a, shape_b, shape_o = a.shape, b.shape, offs.shape
    if len(shape_a) != 2 or len(shape_b) != 3 or len(shape_o) != 1:
        return False
    (m, k), (e, d1, d2) = shape_a, shape_b
    bk, n = (d1, d2) if k_dim == 1 else (d2, d1)
    if not (0 < m <= MAX_ROWS and k > 0 and n > 0 and e > 0 and bk == k and shape_o[0] == e):
        return False
    sa0, sa1 = a.stride()
    sb0, sb1, sb2 = b.stride()
    return (sa1 == 1 and sa0 > 0 and sa0 % align == 0 and sb0 > 0 and sb0 % align == 0
            and ((sb2 == 1 and sb1 > 0 and sb1 % align == 0)
                 or (sb1 == 1 and sb2 > 0 and sb2 % align == 0))
            and (e == 1 or offs.stride(0) == 1)
            and b.get_device() == device_index and offs.get_device() == device_index
            and a.data_ptr() % ALIGN_BYTES == 0 and b.data_ptr() % ALIGN_BYTES == 0)


# elements per 16 bytes of the dtypes whose calls may skip the full check
_READY_DTYPES = {torch.bfloat16: 8, torch.float16: 8, torch.float32: 4}


# ------------------------------------------------------------------ routing
def _check_float_matrix(name: str, t, dims: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D {dims}, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {t.dtype}")


def check_router_args(x, weight) -> None:
    """x (T, H) and weight (E, H), float tensors of one dtype on one device, else
    a TypeError/ValueError naming them."""
    _check_float_matrix("x", x, "(tokens, hidden)")
    _check_float_matrix("weight", weight, "(experts, hidden)")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be (E, H) with H = {x.shape[1]} (x's last dim), "
                         f"got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")


def check_top_k(top_k, num_experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")


def check_flag(name: str, value) -> None:
    """A TypeError naming ``name`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_route_args(logits, top_k) -> None:
    """(T, E) float logits and 1 <= top_k <= E, else a TypeError/ValueError naming them."""
    _check_float_matrix("logits", logits, "(tokens, experts)")
    check_top_k(top_k, logits.shape[1])


def check_experts(experts, num_experts) -> None:
    """experts (T, top_k) int32/int64 (any values: those outside [0, E) are
    dropped slots) and a positive int ``num_experts`` of at most :data:`MAX_EXPERTS`
    (offs has one entry per expert: a larger count is refused, not allocated)."""
    if not isinstance(experts, torch.Tensor):
        raise TypeError(f"experts must be a torch.Tensor, got {type(experts).__name__}")
    if experts.dim() != 2:
        raise ValueError(f"experts must be 2-D, got shape {tuple(experts.shape)}")
    if experts.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"experts must be int32 or int64, got {experts.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts must be at most 2**31 - 1 (the ids int32 experts "
                         f"hold), got {num_experts}")


def check_permute_args(x, experts, num_experts) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    check_experts(experts, num_experts)
    if experts.shape[0] != x.shape[0]:
        raise ValueError(
            f"experts has {experts.shape[0]} rows (tokens) but x has {x.shape[0]}")
    if experts.device != x.device:
        raise ValueError(
            f"x and experts must be on one device, got {x.device} and {experts.device}")


def _check_ranks(**tensors) -> None:
    """Each ``name=(t, rank)``: a tensor of that rank, else the error naming it."""
    for name, (t, rank) in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D, got shape {tuple(t.shape)}")


def check_combine_args(y_sorted, weights, inverse) -> None:
    """y_sorted (M, H) of a float dtype, weights (T, k) floating point and inverse (M,)
    int32/int64 with M = T * k, all on one device (a ``meta`` tensor among real ones
    included: the result would be uninitialized memory)."""
    _check_ranks(y_sorted=(y_sorted, 2), weights=(weights, 2), inverse=(inverse, 1))
    if y_sorted.dtype not in DTYPES:  # an integer y would be truncated by the rounding
        raise TypeError(f"y_sorted must be bfloat16, float16, float32 or float64, got "
                        f"{y_sorted.dtype}")
    if not weights.is_floating_point():
        raise TypeError(f"weights must be floating point, got {weights.dtype}")
    if inverse.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"inverse must be int32 or int64, got {inverse.dtype}")
    slots = weights.shape[0] * weights.shape[1]
    if inverse.shape[0] != slots or y_sorted.shape[0] != slots:
        raise ValueError(
            f"weights {tuple(weights.shape)} has {slots} slots; inverse has {inverse.shape[0]} "
            f"and y_sorted {y_sorted.shape[0]} rows")
    for name, t in (("weights", weights), ("inverse", inverse)):
        if t.device != y_sorted.device:
            raise ValueError(f"{name} is on {t.device} but y_sorted is on {y_sorted.device}")


def check_combine_grad_args(dout, y_sorted, weights, order) -> None:
    """dout (T, H) and y_sorted (M, H) of one float dtype, weights (T, k) floating point,
    order (M,) int32/int64, all on one device."""
    _check_ranks(dout=(dout, 2), y_sorted=(y_sorted, 2), weights=(weights, 2),
                 order=(order, 1))
    if y_sorted.dtype not in DTYPES or dout.dtype != y_sorted.dtype:
        raise TypeError(f"dout and y_sorted must have one float dtype (bfloat16, float16, "
                        f"float32 or float64), got {dout.dtype} and {y_sorted.dtype}")
    if not weights.is_floating_point():
        raise TypeError(f"weights must be floating point, got {weights.dtype}")
    if order.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"order must be int32 or int64, got {order.dtype}")
    if dout.shape != (weights.shape[0], y_sorted.shape[1]) or order.shape[0] != y_sorted.shape[0]:
        raise ValueError(
            f"dout must be (T, H) = ({weights.shape[0]}, {y_sorted.shape[1]}) and order "
            f"({y_sorted.shape[0]},) for weights {tuple(weights.shape)} and y_sorted "
            f"{tuple(y_sorted.shape)}; got {tuple(dout.shape)} and {tuple(order.shape)}")
    for name, t in (("dout", dout), ("weights", weights), ("order", order)):
        if t.device != y_sorted.device:
            raise ValueError(f"{name} is on {t.device} but y_sorted is on {y_sorted.device}")
