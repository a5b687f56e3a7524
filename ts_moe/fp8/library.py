"""Registration plumbing of the FP8 ops: their ``torch.library`` fragment of the ``ts_moe``
namespace, the output allocation every path shares, and the backward that refuses.

The FP8 ops have no backward (FP8 training is not supported).  A forward on
inputs that require grad runs and gives an output that requires grad, so an
inference call without ``torch.no_grad`` works; asking for a gradient through
it (``backward``, ``torch.autograd.grad``) raises ``NotImplementedError`` naming
the op, eagerly and in compiled graphs alike: the backward formula is the op
``ts_moe::fp8_no_backward``, which raises when it runs (its fake kernel lets a
compiled graph that holds it be built).  No gradient is ever silently missing.
"""

import torch

lib = torch.library.Library("ts_moe", "FRAGMENT")
lib.define("fp8_no_backward(Tensor grad, Tensor like, str op) -> Tensor")

ALIGN_BYTES = 16


def empty_output(like: torch.Tensor, m, n, dtype: torch.dtype) -> torch.Tensor:
    """(m, n) on ``like``'s device, rows padded to 16 bytes (the kernels store whole
    16-byte vectors; torch pads grouped_mm outputs alike)."""
    align = ALIGN_BYTES // dtype.itemsize
    pad = (n + align - 1) // align * align
    return like.new_empty_strided((m, n), (pad, 1), dtype=dtype)


def no_backward_message(op: str) -> str:
    return (f"{op} has no backward: ts_moe's FP8 ops are for inference (FP8 training is not "
            f"supported). Run the FP8 layer under torch.no_grad() or torch.inference_mode(), "
            f"or use bf16 weights to train")


def _no_backward_impl(grad, like, op):
    raise NotImplementedError(no_backward_message(op))


@torch.library.register_fake("ts_moe::fp8_no_backward", lib=lib)
def _no_backward_fake(grad, like, op):
    return torch.empty_like(like)


for _key in ("CPU", "CUDA"):
    lib.impl("fp8_no_backward", _no_backward_impl, _key)


def forbid_backward(qualname: str, public: str, differentiable: tuple[int, ...]) -> None:
    """Register for op ``qualname`` a backward that raises (module docstring);
    ``differentiable``: the positions of its floating-point tensor arguments."""
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*(inputs[i] for i in differentiable))
        ctx.num_inputs = len(inputs)

    def backward(ctx, *grads):
        grad = next(g for g in grads if g is not None)
        out = [None] * ctx.num_inputs
        for pos, t in zip(differentiable, ctx.saved_tensors):
            if ctx.needs_input_grad[pos]:
                out[pos] = torch.ops.ts_moe.fp8_no_backward(grad, t, public)
        return tuple(out)

    torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=lib)
