"""The sm_90 kernel backends called as the GPU tests call them: one function per op
family, through the path table's backend (``ts_moe.ops.paths.TABLE``), with a
configuration the test forces where it names one.  What the op layer would do around
a call (validation, views, the empty sizes) is the test's: these allocate the output
where none is given and otherwise hand the arguments to the backend as they are."""

import torch

from ts_moe.ops import Op, paths


def backend(op: Op):
    """The sm_90 kernel backend of ``op`` (the table's: what ships)."""
    return paths.TABLE[paths.Path.KERNEL_SM90][op]


def _config(b, config, *args):
    """``config``, or the backend's choice for ``args`` (a decline raises, naming why)."""
    if config is not None:
        return config
    chosen = b.choose_config(*args)
    if not chosen:
        raise ValueError(f"{type(b).__name__} declined: {chosen}")
    return chosen


def grouped_gemm(a, b, offs, out_dtype=None, *, out=None, config=None,
                 prefetch_weights=False):
    """``out[r] = a[r] @ b[e]`` on the sm_90 kernel; a (M, K) K-major, b (E, K, N)."""
    if out is None:
        out = torch.empty(a.shape[0], b.shape[2], dtype=out_dtype or a.dtype, device=a.device)
    if a.shape[0] == 0 or b.shape[2] == 0:
        return out
    if a.shape[1] == 0 or b.shape[0] == 0:
        return out.zero_()
    k = backend(Op.GROUPED_GEMM)
    cfg = _config(k, config, a, b, offs, out, None)
    return k.run(a if a.stride(-1) == 1 else a.contiguous(), b, offs, out, cfg,
                 prefetch_weights=prefetch_weights)


def grouped_gemm_swiglu(a, gate_up, offs, *, out=None, config=None, prefetch_weights=False):
    """``silu(a @ gate^T) * (a @ up^T)`` per expert on the fused sm_90 kernel; gate_up
    (E, 2I, H)."""
    if out is None:
        out = torch.empty(a.shape[0], gate_up.shape[1] // 2, dtype=a.dtype, device=a.device)
    k = backend(Op.GROUPED_GEMM_SWIGLU)
    cfg = _config(k, config, a, gate_up, offs, out, None)
    return k.run(a, gate_up, offs, out, cfg, prefetch_weights=prefetch_weights)


def grouped_gemm_k(a, dy, offs, out, config=None):
    """``out[e] = a[rows e].T @ dy[rows e]`` on the sm_90 k-grouped kernel; a (M, K),
    dy (M, N), out (E, K, N)."""
    if out.shape[0] == 0 or out.shape[1] == 0 or out.shape[2] == 0:
        return out
    if a.shape[0] == 0:
        return out.zero_()
    k = backend(Op.GROUPED_GEMM_K)
    cfg = _config(k, config, a.t(), dy, offs, out)
    return k.run(a.t(), dy, offs, out, cfg)


def route_slots(logits, top_k):
    """(weights, experts, token_index, offs, inverse) on the one-CTA routing kernel."""
    k = backend(Op.ROUTE_SLOTS)
    return k.run(logits, top_k, _config(k, None, logits, top_k))


def sort_slots(experts, num_experts):
    """(token_index, offs, inverse) on the one-CTA slot-order kernel."""
    k = backend(Op.SORT_SLOTS)
    return k.run(experts, num_experts, _config(k, None, experts, num_experts))


def weighted_row_sum(src, index, weights):
    """The combine (``weights`` given) or the row gather, on the row kernel."""
    k = backend(Op.ROW_SUM)
    return k.run(src, index, weights, _config(k, None, src, index, weights))


def router_logits(x, weight):
    """``x @ weight.T`` on the router kernel, whatever the batch's reads (its
    ``choose_config`` would give larger ones to ``F.linear``)."""
    return backend(Op.ROUTER_LOGITS).run(x, weight, x.dtype)


def route_topk(logits, top_k):
    """(weights, experts) on the many-CTA top-k kernel, whatever the batch's size."""
    from csrc_free_kernels.routing.route_sm90_launch import lane_width

    return backend(Op.ROUTE_TOPK).run(logits, top_k, lane_width(logits.shape[1]))


def swiglu_forward(h, out):
    """``out = silu(h[:, :I]) * h[:, I:]`` on the elementwise kernel (nothing launched
    for an empty h)."""
    if out.numel() == 0:
        return out
    k = backend(Op.SWIGLU_ACTIVATION)
    return k.forward(h, out, _config(k, None, h, None))


def swiglu_backward(dy, h, dh):
    """The activation's gradient ``dh`` on the elementwise kernel (nothing launched for
    an empty h)."""
    if dh.numel() == 0:
        return dh
    k = backend(Op.SWIGLU_ACTIVATION)
    return k.backward(dy, h, dh, _config(k, None, h, dy))
