"""Registration of the ``torch.ops.ts_moe`` operators: the one
``torch.library.Library`` object, and the way each op family module
(:mod:`.gemm`, :mod:`.swiglu`, :mod:`.routing`) registers its ops with it
(:func:`define`): schema, CPU and CUDA kernels, fake kernel, and for the
differentiable ops the Autograd-key kernel (:func:`autograd_kernel`).

The FP8 ops, which have no backward (FP8 training is not supported), register
through :func:`define_inference_op`: :func:`define` and an Autograd kernel whose
backward raises.  A forward on inputs that require grad runs and gives an output
that requires grad, so an inference call without ``torch.no_grad`` works; asking
for a gradient through it (``backward``, ``torch.autograd.grad``) raises
``NotImplementedError`` naming the op, eagerly and in compiled graphs alike: the
backward formula is the op ``ts_moe::fp8_no_backward``, which raises when it runs
(its fake kernel lets a compiled graph that holds it be built).  No gradient is
ever silently missing.

``torch.library.Library`` rather than ``custom_op``: the latter's Python
wrapper alone costs more than the 20 us host budget allows for a whole call.
"""

import torch

LIBRARY = torch.library.Library("ts_moe", "DEF")
AFTER_AUTOGRAD = torch._C._after_autograd_keyset


def define(schema: str, cpu, cuda, fake, *, with_grad=None,
           differentiable: int = 2) -> torch._ops.OpOverload:
    """Register ``ts_moe::<schema>`` and return its overload.

    ``with_grad(keyset, *args, **kwargs)``: the op under autograd (for the
    differentiable ops: its first ``differentiable`` arguments), installed by
    :func:`autograd_kernel`.  Without it the op has no Autograd kernel (its
    Python wrapper keeps it away from tensors that need a gradient)."""
    name = schema.split("(", 1)[0]
    LIBRARY.define(schema)
    torch.library.register_fake(f"ts_moe::{name}", fake, lib=LIBRARY)
    LIBRARY.impl(name, cpu, "CPU")
    LIBRARY.impl(name, cuda, "CUDA")
    op = getattr(torch.ops.ts_moe, name).default
    if with_grad is not None:
        LIBRARY.impl(name, autograd_kernel(op, {"CPU": cpu, "CUDA": cuda}, with_grad,
                                           differentiable), "Autograd", with_keyset=True)
    return op


def below_autograd(op: torch._ops.OpOverload, keyset, *args, **kwargs):
    """``op`` for the dispatch keys after autograd's (the forward of an
    ``autograd.Function`` that is the op's Autograd kernel)."""
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(keyset & AFTER_AUTOGRAD, *args, **kwargs)


def autograd_kernel(op: torch._ops.OpOverload, backends: dict, with_grad, inputs: int = 2):
    """The Autograd-key kernel of ``op`` (its first ``inputs`` arguments are the
    differentiable ones): ``with_grad`` only when a gradient is wanted.
    Otherwise, for plain CPU or CUDA tensors (nothing traced, no mode or
    subclass below autograd), the backend kernel ``backends[key]`` right here
    instead of a second trip through the dispatcher (each Python kernel it
    enters costs about 1.3 us of the 20 us host budget); anything else
    redispatches.  (``torch.library.register_autograd`` would install such a
    kernel too, but one that always redispatches: the 1.3 us again.)"""
    plain = plain_kernels(backends)

    def kernel(keyset, *args, **kwargs):
        if torch.is_grad_enabled() and (args[0].requires_grad
                                        or (inputs > 1 and args[1].requires_grad)):
            return with_grad(keyset, *args, **kwargs)
        direct = plain.get(keyset.raw_repr())
        if direct is not None:
            return direct(*args, **kwargs)
        return op.redispatch(keyset & AFTER_AUTOGRAD, *args, **kwargs)

    return kernel


def plain_kernels(backends: dict) -> dict:
    """``{keyset: backends[key]}``, keyed by the exact keyset a plain tensor of each
    backend (``"CPU"``, ``"CUDA"``) reaches the Autograd kernel with, as an int (a
    DispatchKeySet is not hashable; comparing raw bits costs 0.1 us)."""
    key = torch._C.DispatchKey
    return {torch._C.DispatchKeySet(getattr(key, backend)).add(
        getattr(key, "Autograd" + backend)).raw_repr(): fn for backend, fn in backends.items()}


def no_backward_message(op: str) -> str:
    return (f"{op} has no backward: ts_moe's FP8 ops are for inference (FP8 training is not "
            f"supported). Run the FP8 layer under torch.no_grad() or torch.inference_mode(), "
            f"or use bf16 weights to train")


def _no_backward_impl(grad, like, op):
    raise NotImplementedError(no_backward_message(op))


def _no_backward_fake(grad, like, op):
    return torch.empty_like(like)


_NO_BACKWARD = define("fp8_no_backward(Tensor grad, Tensor like, str op) -> Tensor",
                      _no_backward_impl, _no_backward_impl, _no_backward_fake)


def define_inference_op(schema: str, impl, fake, public: str,
                        differentiable: tuple[int, ...]) -> torch._ops.OpOverload:
    """Register ``ts_moe::<schema>`` (``impl`` its CPU and CUDA kernel) with an
    Autograd kernel whose backward raises (module docstring), and return its
    overload.  ``public``: the name the error gives; ``differentiable``: the
    positions of its floating-point tensor arguments.  When no gradient is wanted,
    plain tensors go to ``impl`` right here, as :func:`autograd_kernel` does."""
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
                    out[1 + pos] = _NO_BACKWARD(grad, t, public)
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
