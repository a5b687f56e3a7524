"""The ``training`` suite: each expert GEMM's forward and gradients, and the whole
layer's forward + backward, against torch's and transformers' training paths.

GEMM cases (a step of the ``gate_up`` or ``down`` GEMM, shapes of
:mod:`bench.cases`; x (M, K), w (E, K, N), dy (M, N), ``offs`` int32 row ends),
every backend on the same :class:`bench.backends.GemmInputs` ``(a, b)``:

- ``fwd``: ``a = x``, ``b = w`` -> (M, N);
- ``dA``: ``a = dy``, ``b = w.transpose(-2, -1)`` -> (M, K), the input gradient;
- ``dW``: ``a = x.t()``, ``b = dy`` -> (E, K, N), ``out[e] = x[rows e].T @ dy[rows e]``,
  the weight gradient (k-grouped, 2-D x 2-D, as ``F.grouped_mm``; zeros for an
  expert without rows).

Backends: ``ts_moe`` (``ts_moe.grouped_gemm(a, b, offs)``), ``torch_grouped_mm``
(``torch._grouped_mm(a, b, offs=offs)``), ``cublas_loop`` (one ``torch.mm``
per expert, slice bounds from the case's counts, fixed outside the timed call).

Layer cases (``gemm`` ``layer``, step ``fwd+bwd``): the expert half of a
Mixtral-style layer with the routing given (as in the ``moe_layer`` suite: the
router GEMM and top-k are not part of the case), forward then backward with
``dout`` (T, H): one call returns ``(out, dx, d gate_up, d down, d topk_weights)``
(``torch.autograd.grad``: nothing accumulates across calls).  The
``topk_weights`` gradient is what flows back into the router.  Backends:
``ts_moe`` (``ts_moe.experts_forward``, the fused gate/up + SwiGLU op),
``hf_grouped_mm`` (transformers' ``MixtralExperts`` with the ``grouped_mm``
experts implementation), ``torch_layer`` (:func:`bench.moe_layer.torch_layer_forward`:
plain torch on ``F.grouped_mm``).

Every backend is checked against an fp32 reference (each result's relative
error, the largest counts) before it is timed; on CUDA each also gets its peak
memory over one call (``peak_mem_bytes``, see :func:`bench.runner.peak_memory`).
Inputs are ``torch.randn`` data, the same tensors for every backend.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import backends as gemm_backends
from . import moe_layer
from .backends import Bind, Factory, GemmInputs, Unavailable
from .cases import Case
from .moe_layer import LayerInputs

DEFAULT_BACKENDS = ("ts_moe", "torch_grouped_mm", "cublas_loop", "hf_grouped_mm", "torch_layer")
TARGET_MS = 40.0  # timed work per backend and case on a GPU: the suite ends in minutes
HOST_GRAD_BYTES = 8 << 30  # the layer reference's fp32 weight gradients above this: host


# ------------------------------------------------------------------- inputs
@dataclass
class TrainLayerInputs(LayerInputs):
    """:class:`bench.moe_layer.LayerInputs` and ``dout`` (T, H), the output's gradient."""

    dout: torch.Tensor = None

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.dout.nbytes

    def clone(self) -> "TrainLayerInputs":
        return TrainLayerInputs(self.x.clone(), self.gate_up.clone(), self.down.clone(),
                                self.topk_ids, self.topk_weights, self.counts, self.dout)


def make_step_inputs(case: Case, device: torch.device) -> GemmInputs:
    """A GEMM step's ``(a, b)`` (see the module doc), seeded randn (weights ``* K**-0.5``)."""
    g = torch.Generator(device).manual_seed(case.seed)
    kw = {"generator": g, "device": device, "dtype": torch.bfloat16}
    E, M, N, K = case.E, case.M, case.N, case.K

    def weights():
        if case.weight_layout == "kmajor":
            return torch.randn(E, N, K, **kw).mul_(K**-0.5).transpose(-2, -1)
        if case.weight_layout == "nmajor":
            return torch.randn(E, K, N, **kw).mul_(K**-0.5)
        raise ValueError(f"unknown weight layout {case.weight_layout!r}")

    if case.step == "fwd":
        a, b = torch.randn(M, K, **kw), weights()
    elif case.step == "dA":
        a, b = torch.randn(M, N, **kw), weights().transpose(-2, -1)
    elif case.step == "dW":
        a, b = torch.randn(M, K, **kw).t(), torch.randn(M, N, **kw)
    else:
        raise ValueError(f"unknown GEMM step {case.step!r}; expected fwd, dA or dW")
    offs = torch.tensor(case.counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return GemmInputs(a, b, offs, case.counts)


def make_layer_train_inputs(case: Case, device: torch.device) -> TrainLayerInputs:
    """The ``moe_layer`` suite's inputs of the case, and a randn ``dout``."""
    inp = moe_layer.make_layer_inputs(case, device)
    g = torch.Generator(device).manual_seed(case.seed + 1)
    dout = torch.randn(inp.x.shape, generator=g, device=device, dtype=inp.x.dtype)
    return TrainLayerInputs(inp.x, inp.gate_up, inp.down, inp.topk_ids, inp.topk_weights,
                            inp.counts, dout)


def make_training_inputs(case: Case, device: torch.device):
    if case.gemm == "layer":
        return make_layer_train_inputs(case, device)
    return make_step_inputs(case, device)


# ---------------------------------------------------------------- reference
def reference_layer_train(inp: TrainLayerInputs):
    """``(out, dx, d gate_up, d down, d topk_weights)`` in fp32: a loop over the
    experts with the backward written out (SwiGLU's derivative by hand);
    host-side counts, no sync."""
    x, gate_up, down = inp.x, inp.gate_up, inp.down
    tokens, top_k = inp.topk_ids.shape
    inter = gate_up.shape[1] // 2
    kw = {"dtype": torch.float32, "device": x.device}
    dout = inp.dout.float()
    out, dx = torch.zeros(x.shape, **kw), torch.zeros(x.shape, **kw)
    # fp32 weight gradients as large as the bf16 stacks twice over stay in host memory
    # (DeepSeek-V3: 42 GiB), where the checks read them a slab at a time
    grads = {**kw, "device": "cpu"} if 4 * (gate_up.numel() + down.numel()) > HOST_GRAD_BYTES \
        else kw
    d_gate_up, d_down = torch.zeros(gate_up.shape, **grads), torch.zeros(down.shape, **grads)
    d_weights = torch.zeros(tokens * top_k, **kw)
    order = inp.topk_ids.flatten().argsort(stable=True)
    weights = inp.topk_weights.flatten().float()
    start = 0
    for e, rows in enumerate(inp.counts):
        if rows:
            pairs = order[start:start + rows]
            tok = pairs // top_k
            xe, w_gu, w_down = x[tok].float(), gate_up[e].float(), down[e].float()
            h = xe @ w_gu.t()
            gate, up = h[:, :inter], h[:, inter:]
            sig = torch.sigmoid(gate)
            silu = gate * sig
            act = silu * up
            y = act @ w_down.t()
            we = weights[pairs, None]
            out.index_add_(0, tok, y * we)
            go = dout[tok]
            d_weights[pairs] = (go * y).sum(dim=1)
            dy = go * we
            d_down[e] = (dy.t() @ act).to(d_down.device)
            d_act = dy @ w_down
            d_h = torch.cat([d_act * up * sig * (1 + gate * (1 - sig)), d_act * silu], dim=1)
            d_gate_up[e] = (d_h.t() @ xe).to(d_gate_up.device)
            dx.index_add_(0, tok, d_h @ w_gu)
        start += rows
    return out, dx, d_gate_up, d_down, d_weights.view(tokens, top_k)


def reference_training(inp):
    """The fp32 result(s) of a case's inputs: a GEMM step's output, or the layer's tuple."""
    if isinstance(inp, TrainLayerInputs):
        return reference_layer_train(inp)
    return gemm_backends.reference_grouped_gemm(inp)


# ----------------------------------------------------------------- backends
def _gemm_case(case: Case) -> bool:
    return case.gemm != "layer"


def _layer_case(case: Case) -> bool:
    return case.gemm == "layer"


def _applying(applies, factory: Factory) -> Factory:
    """``factory`` for the cases where ``applies(case)``; the runner makes no record elsewhere."""
    @functools.wraps(factory)
    def wrapped(case: Case, device: torch.device) -> Bind:
        return factory(case, device)

    wrapped.applies = applies
    return wrapped


@functools.cache
def _grouped_mm_unusable(device: str) -> str | None:
    """Why torch's grouped_mm (both forms) can't run on ``device``, or None."""
    fn = getattr(torch, "_grouped_mm", None) or getattr(F, "grouped_mm", None)
    if fn is None:
        return f"torch {torch.__version__} has no grouped_mm"
    kw = {"device": device, "dtype": torch.bfloat16}
    a, b, dy = torch.randn(16, 16, **kw), torch.randn(2, 16, 16, **kw), torch.randn(16, 16, **kw)
    offs = torch.tensor([8, 16], dtype=torch.int32, device=device)
    try:
        fn(a, b, offs=offs)
        fn(a.t(), dy, offs=offs)
    except (RuntimeError, NotImplementedError) as exc:
        return f"torch's grouped_mm on {device}: {type(exc).__name__}: {str(exc)[:120]}"
    return None


def _require_grouped_mm(device: torch.device) -> None:
    why = _grouped_mm_unusable(str(device))
    if why is not None:
        raise Unavailable(why)


def torch_grouped_mm(case: Case, device: torch.device) -> Bind:
    """``torch._grouped_mm(a, b, offs=offs)`` (``F.grouped_mm`` where torch has no
    ``_grouped_mm``): the forward, ``grouped_mm(dy, w^T)`` and the k-grouped
    ``grouped_mm(x.t(), dy)``."""
    _require_grouped_mm(device)
    fn = getattr(torch, "_grouped_mm", None) or F.grouped_mm
    return lambda inp: lambda: fn(inp.a, inp.b, offs=inp.offs)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A leaf on ``t``'s storage that requires grad (``t`` itself is left alone)."""
    return t.detach().requires_grad_(True)


def _layer_step(forward, inp: TrainLayerInputs, x, gate_up, down, weights):
    """One training step of a layer: forward, then the gradients of its inputs."""
    out = forward(x, inp.topk_ids, weights, gate_up, down)
    grads = torch.autograd.grad(out, (x, gate_up, down, weights), inp.dout)
    return (out.detach(), *grads)


def ts_moe_layer(case: Case, device: torch.device) -> Bind:
    """``ts_moe.experts_forward`` (fused gate/up + SwiGLU) forward and backward.
    On a CUDA device without ts_moe's kernels the ops would run torch's or the
    reference path: reported as unavailable, as the GEMM backend does."""
    import ts_moe

    gemm_backends.ts_moe(case, device)  # raises Unavailable where there is no kernel

    def forward(x, topk_ids, weights, gate_up, down):
        return ts_moe.experts_forward(x, topk_ids, weights, gate_up, down, fused=True)

    def bind(inp: TrainLayerInputs):
        leaves = [_leaf(t) for t in (inp.x, inp.gate_up, inp.down, inp.topk_weights)]
        return lambda: _layer_step(forward, inp, *leaves)
    return bind


def ts_moe_training(case: Case, device: torch.device) -> Bind:
    """``ts_moe.grouped_gemm(a, b, offs)`` for a GEMM step, the layer's step for a layer case."""
    if case.gemm == "layer":
        return ts_moe_layer(case, device)
    return gemm_backends.ts_moe(case, device)


def hf_grouped_mm(case: Case, device: torch.device) -> Bind:
    """transformers' ``MixtralExperts`` with ``experts_implementation="grouped_mm"``,
    its parameters on the inputs' weight tensors (no copy), one module per input copy."""
    moe_layer.hf_experts_module(case.model, "grouped_mm")  # no transformers: ImportError

    def bind(inp: TrainLayerInputs):
        experts = moe_layer.hf_experts_module(case.model, "grouped_mm")
        experts.gate_up_proj = torch.nn.Parameter(inp.gate_up.detach())
        experts.down_proj = torch.nn.Parameter(inp.down.detach())
        x, weights = _leaf(inp.x), _leaf(inp.topk_weights)

        def forward(x, topk_ids, weights, gate_up, down):
            return experts(x, topk_ids, weights)

        return lambda: _layer_step(forward, inp, x, experts.gate_up_proj, experts.down_proj,
                                   weights)

    return bind


def torch_layer(case: Case, device: torch.device) -> Bind:
    """:func:`bench.moe_layer.torch_layer_forward` (plain torch on ``F.grouped_mm``),
    forward and backward through torch's autograd."""
    _require_grouped_mm(device)

    def bind(inp: TrainLayerInputs):
        leaves = [_leaf(t) for t in (inp.x, inp.gate_up, inp.down, inp.topk_weights)]
        return lambda: _layer_step(moe_layer.torch_layer_forward, inp, *leaves)
    return bind


def reference(case: Case, device: torch.device) -> Bind:
    """The fp32 reference, rounded as the backends round (slow; checks the harness)."""
    def bind(inp):
        if isinstance(inp, TrainLayerInputs):
            def run():
                out, dx, d_gate_up, d_down, d_weights = reference_layer_train(inp)
                dtype = inp.x.dtype
                return (out.to(dtype), dx.to(dtype), d_gate_up.to(dtype), d_down.to(dtype),
                        d_weights)
            return run
        return lambda: gemm_backends.reference_grouped_gemm(inp, inp.a.dtype)
    return bind


def training_backends() -> dict[str, Factory]:
    """Backend name -> factory; each factory's ``applies(case)`` says which cases it runs."""
    return {
        "ts_moe": ts_moe_training,
        "torch_grouped_mm": _applying(_gemm_case, torch_grouped_mm),
        "cublas_loop": _applying(_gemm_case, gemm_backends.cublas_loop),
        "hf_grouped_mm": _applying(_layer_case, hf_grouped_mm),
        "torch_layer": _applying(_layer_case, torch_layer),
        "reference": reference,
    }

