"""What the vLLM tests share (imported by them after their ``importorskip("vllm")``): a
vLLM config and a one-process distributed group for building vLLM's layers on the CPU,
vLLM's MoE configs for the experts alone, the routing, and the fp32 loop over the experts
that the results are held against."""

import contextlib
import logging
import tempfile

import torch
import torch.nn.functional as F
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig,
                                                         FusedMoEParallelConfig,
                                                         RoutingMethodType)

import ts_moe
from ts_moe.fp8.reference import dequantize

BLOCKWISE, ROWS_1X128 = "blockwise_128x128", "blockwise_1x128"


@contextlib.contextmanager
def vllm_process():
    """A default vLLM config as the current one, and this process as a distributed group
    of one (gloo, created once per process), for building vLLM's layers."""
    config = VllmConfig()
    with set_current_vllm_config(config):
        if not torch.distributed.is_initialized():
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"file://{tempfile.mkdtemp()}/rendezvous")
            initialize_model_parallel(1, 1)
        yield config


def moe_config(*, experts, local_experts, hidden, inter, top_k, dtype,
               parallel=None, **fields) -> FusedMoEConfig:
    """vLLM's config of a SiLU MoE layer (no parallelism unless ``parallel`` is given)."""
    return FusedMoEConfig(
        num_experts=experts, experts_per_token=top_k, hidden_dim=hidden,
        intermediate_size=inter, num_local_experts=local_experts,
        num_logical_experts=experts, activation=fields.pop("activation", MoEActivation.SILU),
        device="cpu", routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=parallel or FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=dtype, **fields)


def route(tokens: int, experts: int, top_k: int, seed: int):
    """Mixtral's routing of random logits: fp32 weights renormalised over the top-k, and
    int32 ids (as vLLM's routers hand them to the experts)."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.randn(tokens, experts, generator=g).softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def experts_loop(x, w13, w2, weights, ids, expert_map=None, swiglu_out=None):
    """Token by token in fp32: sum over k of ``weights[t, k]`` times expert ``e``'s
    ``w2[e] @ (silu(gate) * up)``, ``(gate; up) = w13[e] @ x[t]``, with ``e`` the id (or
    ``expert_map[id]``; -1: another rank's expert, left out). ``swiglu_out``: what happens
    to the SwiGLU output before the down projection (the layer's rounding)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k]) if expert_map is None else int(expert_map[ids[t, k]])
            if e < 0:
                continue
            h = w13[e].float() @ x[t].float()
            a = F.silu(h[:inter]) * h[inter:]
            if swiglu_out is not None:
                a = swiglu_out(a)
            out[t] += float(weights[t, k]) * (w2[e].float() @ a)
    return out


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """x's rows as the FP8 experts see them: quantized per 1x128 channels and back, fp32."""
    q, s = ts_moe.quantize_fp8(x, ROWS_1X128)
    return dequantize(q, s, ROWS_1X128, torch.float32)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


class Records(logging.Handler):
    """The messages a logger emits while attached (vLLM's "vllm" logger does not
    propagate to the root, where pytest's caplog listens)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def log_of(name: str):
    """The messages of logger ``name`` (and its children) while the block runs."""
    logger, records = logging.getLogger(name), Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    try:
        yield records.messages
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
