"""Argument checks shared by the ops: metadata only, so no host sync, and all
of them run before any kernel, so a bad call never half-writes an output."""

import torch

DTYPES = (torch.bfloat16, torch.float16)
ALIGN_BYTES = 16  # TMA: base address and every non-unit stride


def _check_tensor(name: str, t, rank: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D, got shape {tuple(t.shape)}")


def _check_layout(name: str, t: torch.Tensor, check_pointer: bool) -> None:
    """One of the last two dims contiguous, the rest 16-byte aligned."""
    rows, cols = t.shape[-2:]
    s_row, s_col = t.stride()[-2:]
    if not (s_col == 1 or cols == 1) and not (s_row == 1 or rows == 1):
        raise ValueError(
            f"{name} needs one of its last two dims contiguous (stride 1); got strides "
            f"{t.stride()} for shape {tuple(t.shape)}"
        )
    elem = t.element_size()
    major = -1 if (s_col == 1 or cols == 1) else -2
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if dim - t.dim() == major or size == 1:
            continue
        if (stride * elem) % ALIGN_BYTES:
            raise ValueError(
                f"{name}: stride {stride} of dim {dim} is not a multiple of "
                f"{ALIGN_BYTES // elem} elements ({ALIGN_BYTES}-byte alignment)"
            )
    if check_pointer and t.numel() and t.data_ptr() % ALIGN_BYTES:
        raise ValueError(f"{name}: data pointer is not {ALIGN_BYTES}-byte aligned")


def check_grouped_gemm_args(a, b, offs, out_dtype=None, *, b_name: str = "b",
                            k_dim: int = 1, fake: bool = False) -> None:
    """Validate ``grouped_gemm``-style arguments; ``b``'s K is dim ``k_dim`` (1 or 2).

    ``fake``: the tensors are fake (tracing): skip the data-pointer check."""
    _check_tensor("a", a, 2)
    _check_tensor(b_name, b, 3)
    _check_tensor("offs", offs, 1)
    if a.dtype not in DTYPES:
        raise TypeError(f"a must be bfloat16 or float16, got {a.dtype}")
    if b.dtype != a.dtype:
        raise TypeError(f"{b_name} must have a's dtype {a.dtype}, got {b.dtype}")
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must be int32, got {offs.dtype}")
    if out_dtype is not None and out_dtype not in (a.dtype, torch.float32):
        raise TypeError(f"out_dtype must be None, {a.dtype} or torch.float32, got {out_dtype}")
    if b.device != a.device or offs.device != a.device:
        raise ValueError(
            f"a, {b_name} and offs must be on one device, got {a.device}, {b.device}, {offs.device}"
        )
    if offs.shape[0] != b.shape[0]:
        raise ValueError(
            f"offs must have one entry per expert: {b_name} has {b.shape[0]} experts, "
            f"offs has {offs.shape[0]} entries"
        )
    if b.shape[k_dim] != a.shape[1]:
        raise ValueError(
            f"K mismatch: a is {tuple(a.shape)} (K={a.shape[1]}), {b_name} is "
            f"{tuple(b.shape)} (K={b.shape[k_dim]})"
        )
    n = b.shape[3 - k_dim]
    for dim_name, size in (("K", a.shape[1]), ("N", n)):
        if size % 8:
            raise ValueError(f"{dim_name} = {size} must be a multiple of 8 (16-byte rows)")
    if offs.numel() and offs.stride(0) != 1:
        raise ValueError("offs must be contiguous")
    _check_layout("a", a, not fake)
    _check_layout(b_name, b, not fake)
