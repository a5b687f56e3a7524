"""The grouped GEMMs on ``torch._grouped_mm`` (its CUTLASS kernel on sm_90 and
sm_100 in bf16; elsewhere its per-expert loop, which reads ``offs`` on the
host): the path of Blackwell and of float32 on a GPU (:mod:`ts_moe.ops.paths`).

torch's op reads ``offs`` as given and leaves the rows past ``offs[-1]``
undefined; these backends pass it the segment ends the kernels use
(:func:`ts_moe.reference.segment_ends`, on the device) and zero those rows.
torch allocates its own output, in the op's layout (16-byte rows): ``out`` is
left unused."""

import torch

from ..reference import segment_ends, swiglu

CONFIG = "torch._grouped_mm"


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch._grouped_mm`` of a row-grouped call with the op's semantics: ``offs``
    read as the segment ends, the rows past the last one zero."""
    ends = segment_ends(offs, a.shape[0]).to(torch.int32)
    out = torch._grouped_mm(a, b, offs=ends, out_dtype=out_dtype)
    past = torch.arange(a.shape[0], device=a.device) >= ends[-1]
    return out.masked_fill_(past.unsqueeze(1), 0)


class GroupedGemm:
    gathers = False

    def choose_config(self, a, b, offs, out, a_index):
        return CONFIG

    def run(self, a, b, offs, out, config, *, a_index=None, prefetch_weights=False):
        return grouped_mm(a, b, offs, None if out.dtype == a.dtype else out.dtype)


class GroupedGemmK:
    def choose_config(self, a, b, offs, out):
        return CONFIG

    def run(self, a, b, offs, out, config):
        ends = segment_ends(offs, b.shape[0]).to(torch.int32)
        got = torch._grouped_mm(a, b, offs=ends,
                                out_dtype=None if out.dtype == a.dtype else out.dtype)
        if got.stride() != out.stride():
            got = out.copy_(got)
        empty = torch.diff(ends, prepend=ends.new_zeros(1)) == 0
        return got.masked_fill_(empty.view(-1, 1, 1), 0)


class GroupedGemmSwiglu:
    """The GEMM to h (M, 2I) in ``a.dtype`` (bf16 out keeps torch on its fast
    path: h is rounded once more than on the other paths, within bf16
    tolerance of the fp32 activation), then the activation in fp32."""

    gathers = False

    def choose_config(self, a, gate_up, offs, out, a_index):
        return CONFIG

    def run(self, a, gate_up, offs, out, config, *, a_index=None, prefetch_weights=False):
        h = grouped_mm(a, gate_up.transpose(-2, -1), offs)
        return out.copy_(swiglu(h.float(), a.dtype))


GROUPED_GEMM = GroupedGemm()
GROUPED_GEMM_K = GroupedGemmK()
GROUPED_GEMM_SWIGLU = GroupedGemmSwiglu()
