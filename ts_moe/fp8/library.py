"""Registration of the FP8 ops: schema, CPU/CUDA kernel and fake kernel through
:func:`ts_moe.ops.library.define` (the one ``ts_moe`` library object), and the
Autograd kernel that refuses a backward (:func:`define_inference_op`).

The FP8 ops have no backward (FP8 training is not supported).  A forward on
inputs that require grad runs and gives an output that requires grad, so an
inference call without ``torch.no_grad`` works; asking for a gradient through
it (``backward``, ``torch.autograd.grad``) raises ``NotImplementedError`` naming
the op, eagerly and in compiled graphs alike: the backward formula is the op
``ts_moe::fp8_no_backward``, which raises when it runs (its fake kernel lets a
compiled graph that holds it be built).  No gradient is ever silently missing.
"""

import torch

from ..ops.library import AFTER_AUTOGRAD, LIBRARY, below_autograd, define, plain_kernels


def no_backward_message(op: str) -> str:
    return (f"{op} has no backward: ts_moe's FP8 ops are for inference (FP8 training is not "
            f"supported). Run the FP8 layer under torch.no_grad() or torch.inference_mode(), "
            f"or use bf16 weights to train")


def _no_backward_impl(grad, like, op):
    raise NotImplementedError(no_backward_message(op))


def _no_backward_fake(grad, like, op):
    return torch.empty_like(like)


_no_backward = define("fp8_no_backward(Tensor grad, Tensor like, str op) -> Tensor",
                      _no_backward_impl, _no_backward_impl, _no_backward_fake)


def define_inference_op(schema: str, impl, fake, public: str,
                        differentiable: tuple[int, ...]) -> torch._ops.OpOverload:
    """Register ``ts_moe::<schema>`` (``impl`` its CPU and CUDA kernel) with an
    Autograd kernel whose backward raises (module docstring), and return its
    overload.  ``public``: the name the error gives; ``differentiable``: the
    positions of its floating-point tensor arguments.  When no gradient is wanted,
    plain tensors go to ``impl`` right here (a second trip through the dispatcher,
    or ``torch.library.register_autograd``'s Python wrapper, would cost more host
    time than the op's checks and launch together)."""
    op = define(schema, impl, impl, fake)
    direct = plain_kernels({"CPU": impl, "CUDA": impl})

    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keyset, *args):
            ctx.save_for_backward(*(args[i] for i in differentiable))
            ctx.num_inputs = len(args)
            return below_autograd(op, keyset, *args)

        @staticmethod
        def backward(ctx, *grads):
            grad = next(g for g in grads if g is not None)
            out = [None] * (1 + ctx.num_inputs)
            for pos, t in zip(differentiable, ctx.saved_tensors):
                if ctx.needs_input_grad[1 + pos]:
                    out[1 + pos] = _no_backward(grad, t, public)
            return tuple(out)

    def kernel(keyset, *args):
        if torch.is_grad_enabled() and any(
                isinstance(args[i], torch.Tensor) and args[i].requires_grad
                for i in differentiable if i < len(args)):
            return NoBackward.apply(keyset, *args)
        fn = direct.get(keyset.raw_repr())
        if fn is not None:
            return fn(*args)
        return op.redispatch(keyset & AFTER_AUTOGRAD, *args)

    LIBRARY.impl(schema.split("(", 1)[0], kernel, "Autograd", with_keyset=True)
    return op
