"""Registration plumbing of the FP8 ops: they register with the one ``ts_moe``
library object (:data:`ts_moe.ops.library.LIBRARY`); the output allocation every
path shares, and the backward that refuses.

The FP8 ops have no backward (FP8 training is not supported).  A forward on
inputs that require grad runs and gives an output that requires grad, so an
inference call without ``torch.no_grad`` works; asking for a gradient through
it (``backward``, ``torch.autograd.grad``) raises ``NotImplementedError`` naming
the op, eagerly and in compiled graphs alike: the backward formula is the op
``ts_moe::fp8_no_backward``, which raises when it runs (its fake kernel lets a
compiled graph that holds it be built).  No gradient is ever silently missing.
"""

import torch

from ..ops.library import _AFTER_AUTOGRAD, LIBRARY, _plain_keyset

lib = LIBRARY
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


_after_autograd = _AFTER_AUTOGRAD

_PLAIN = {_plain_keyset("CPU"), _plain_keyset("CUDA")}


def forbid_backward(name: str, public: str, differentiable: tuple[int, ...], impl) -> None:
    """The Autograd kernel of op ``ts_moe::<name>`` (module docstring):
    ``differentiable``: the positions of its floating-point tensor arguments;
    ``impl``: its CPU/CUDA kernel, called right here for plain tensors when no
    gradient is wanted (a second trip through the dispatcher, or
    ``torch.library.register_autograd``'s Python wrapper, would cost more host time
    than the op's checks and launch together)."""
    op = getattr(torch.ops.ts_moe, name).default

    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keyset, *args):
            ctx.save_for_backward(*(args[i] for i in differentiable))
            ctx.num_inputs = len(args)
            with torch._C._AutoDispatchBelowAutograd():
                return op.redispatch(keyset & _after_autograd, *args)

        @staticmethod
        def backward(ctx, *grads):
            grad = next(g for g in grads if g is not None)
            out = [None] * (1 + ctx.num_inputs)
            for pos, t in zip(differentiable, ctx.saved_tensors):
                if ctx.needs_input_grad[1 + pos]:
                    out[1 + pos] = torch.ops.ts_moe.fp8_no_backward(grad, t, public)
            return tuple(out)

    def kernel(keyset, *args):
        if torch.is_grad_enabled() and any(
                isinstance(args[i], torch.Tensor) and args[i].requires_grad
                for i in differentiable if i < len(args)):
            return NoBackward.apply(keyset, *args)
        if keyset.raw_repr() in _PLAIN:
            return impl(*args)
        return op.redispatch(keyset & _after_autograd, *args)

    lib.impl(name, kernel, "Autograd", with_keyset=True)
