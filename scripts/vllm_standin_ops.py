"""Torch stand-ins for the compiled helper ops vLLM 0.33's Triton MoE experts call, for a
GPU machine that has vLLM's Python tree but not its compiled extensions (``vllm._C``,
``vllm._moe_C``: built for vLLM's own torch, which the device image does not have).

    import vllm_standin_ops
    standing_in = vllm_standin_ops.install()   # the ops it defined: name them in results

:func:`install` defines, in vLLM's op namespaces, only the ops that are missing there:

- ``_moe_C::moe_align_block_size``: each (token, k) slot's flat index, grouped by expert
  in slot order, each expert's group padded to a multiple of ``block_size`` with the
  slot count (an index past every slot); the expert of each block; the padded total;
- ``_moe_C::moe_sum``: the sum over the top-k rows (M, k, H) -> (M, H), an ``expert_map``
  leaving out another rank's slots;
- ``_C::silu_and_mul``: ``silu(x[:, :d]) * x[:, d:]``;
- ``_C::per_token_group_fp8_quant``: each group of ``group_size`` channels of a row
  scaled by its absolute maximum over the e4m3 maximum (a power of two with ``use_ue8m0``).

Each writes into the tensors vLLM hands it, on the device, without a host sync (so a CUDA
graph captures it), in plain torch: several launches where vLLM's compiled op is one, so
a time that includes them is vLLM's Triton experts *with torch stand-ins*, and says so.
Nothing here imports vLLM.
"""

import torch

FP8 = torch.float8_e4m3fn
# op name -> (namespace, schema)
SCHEMAS = {
    "moe_align_block_size": (
        "_moe_C", "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, "
                  "Tensor(a!) sorted_token_ids, Tensor(b!) experts_ids, "
                  "Tensor(c!) num_tokens_post_pad, Tensor? expert_map=None, "
                  "Tensor(d!)? scatter_idx=None) -> ()"),
    "moe_sum": ("_moe_C", "moe_sum(Tensor input, Tensor(a!) output, Tensor? topk_ids=None, "
                          "Tensor? expert_map=None) -> ()"),
    "silu_and_mul": ("_C", "silu_and_mul(Tensor(a!) result, Tensor input) -> ()"),
    "per_token_group_fp8_quant": (
        "_C", "per_token_group_fp8_quant(Tensor input, Tensor(a!) output_q, "
              "Tensor(b!) output_s, int group_size, float eps, float fp8_min, float fp8_max, "
              "bool scale_ue8m0, bool dummy_is_scale_transposed, "
              "bool dummy_is_tma_aligned) -> ()"),
}
_LIBRARIES: dict = {}  # namespace -> torch.library.Library, kept alive


def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
                         num_tokens_post_pad, expert_map=None, scatter_idx=None):
    if expert_map is not None or scatter_idx is not None:
        raise NotImplementedError("the stand-in moe_align_block_size serves one rank's "
                                  "experts only (expert_map and scatter_idx None)")
    flat = topk_ids.flatten().long()
    slots = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices  # the slots, grouped by expert
    expert_of = flat[order]
    rank = torch.arange(slots, device=flat.device) - (counts.cumsum(0) - counts)[expert_of]
    sorted_token_ids.fill_(slots)
    sorted_token_ids[(ends - padded)[expert_of] + rank] = order.to(sorted_token_ids.dtype)
    block_start = torch.arange(experts_ids.numel(), device=flat.device) * block_size
    expert = torch.searchsorted(ends, block_start, right=True)
    total = ends[-1]
    experts_ids.copy_(torch.where(block_start < total, expert, -1))
    num_tokens_post_pad.copy_(total.reshape(1))


def moe_sum(input, output, topk_ids=None, expert_map=None):
    rows = input
    if expert_map is not None:
        here = (expert_map[topk_ids.long()] >= 0).unsqueeze(-1)
        rows = torch.where(here, input, torch.zeros((), dtype=input.dtype, device=input.device))
    output.copy_(rows.float().sum(dim=1))


def silu_and_mul(result, input):
    d = input.shape[-1] // 2
    gate, up = input[..., :d].float(), input[..., d:].float()
    result.copy_(torch.nn.functional.silu(gate) * up)


def per_token_group_fp8_quant(input, output_q, output_s, group_size, eps, fp8_min, fp8_max,
                              scale_ue8m0, dummy_is_scale_transposed, dummy_is_tma_aligned):
    rows = input.float().reshape(-1, input.shape[-1] // group_size, group_size)
    scale = rows.abs().amax(dim=-1).clamp(min=eps) / fp8_max
    if scale_ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (rows / scale.unsqueeze(-1)).clamp(fp8_min, fp8_max)
    output_q.copy_(q.reshape(output_q.shape).to(output_q.dtype))
    output_s.copy_(scale.reshape(output_s.shape))  # a transposed view takes the values


STAND_INS = {"moe_align_block_size": moe_align_block_size, "moe_sum": moe_sum,
             "silu_and_mul": silu_and_mul, "per_token_group_fp8_quant": per_token_group_fp8_quant}


def _defined(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def install() -> list[str]:
    """Define each op of :data:`SCHEMAS` that vLLM's namespaces lack, as its stand-in, for
    every device; returns the qualified names of those it defined (``[]``: vLLM's
    compiled ops are all there)."""
    defined = []
    for name, (namespace, schema) in SCHEMAS.items():
        if _defined(namespace, name):
            continue
        library = _LIBRARIES.get(namespace)
        if library is None:
            library = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
        library.define(schema)
        library.impl(name, STAND_INS[name], "CompositeExplicitAutograd")
        defined.append(f"{namespace}::{name}")
    return defined
