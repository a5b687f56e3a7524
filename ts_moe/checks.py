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


def plausible_kernel_args(a, b, offs, out_dtype, device_index: int) -> bool:
    """The cheap subset of :func:`check_grouped_gemm_args` for the kernel path,
    where ``a`` is already known to be bf16/fp16 on CUDA device ``device_index``.

    The compiled kernels validate ranks, shapes (K and E agreement) and the
    16-byte stride divisibility of ``b`` themselves, before launch (TVM-FFI
    checks every argument against the kernel's symbolic signature); this
    covers what they cannot: dtypes, devices, a K-major ``a`` with an aligned
    row stride (anything else takes the full check, which also admits what
    the launcher then copies or re-strides), pointer alignment, the row limit,
    and no empty dims (where no kernel launches).  When it is False, or a
    kernel rejects its arguments, the full check runs and names the bad
    argument.  Saves ~7 us of the 20 us host budget (H200 host).
    """
    dtype = a.dtype
    return (b.dtype == dtype and offs.dtype == torch.int32
            and (out_dtype is None or out_dtype == dtype or out_dtype == torch.float32)
            and a.dim() == 2 and b.dim() == 3 and b.get_device() == device_index
            and offs.get_device() == device_index and 0 < a.shape[0] <= MAX_ROWS
            and a.shape[1] > 0 and a.stride(1) == 1 and a.stride(0) % 8 == 0
            and b.shape[0] > 0 and a.data_ptr() % ALIGN_BYTES == 0
            and b.data_ptr() % ALIGN_BYTES == 0)
