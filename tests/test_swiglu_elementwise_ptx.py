"""CPU: the elementwise SwiGLU kernels (forward and backward) compile for sm_90a;
their PTX moves data in 16-byte vectors only, keeps everything in registers and
assembles without spills; the TVM-FFI build compiles; the host-side checks and
the fp32 references behave."""

import re

import pytest
import torch

from csrc_free_kernels import ptx_dump
from csrc_free_kernels.hopper import SWIGLU_SM90

from .helpers import swiglu_grad_ref, swiglu_ref
from .ptxas import NO_SPILLS, PTXAS, assemble, ptx_fixture, registers, run_for_arch

BUILDS = ptx_dump.builds_of(SWIGLU_SM90)


def sw():
    from csrc_free_kernels.hopper import swiglu_sm90
    return swiglu_sm90


def swl():
    from csrc_free_kernels.hopper import swiglu_sm90_launch
    return swiglu_sm90_launch


ptx = ptx_fixture("sm_90a", BUILDS)


def test_every_variant_is_built(ptx):
    assert set(BUILDS) <= set(ptx)
    kinds = {(b.spec["backward"], str(b.spec["dtype"]).split(".")[-1])
             for b in (ptx_dump.BUILDS[n] for n in BUILDS)}
    assert kinds == {(f, d) for f in (False, True) for d in ("bfloat16", "float16")}


@pytest.mark.parametrize("name", BUILDS)
def test_kernel_ptx(ptx, name):
    text = ptx[name]
    backward = ptx_dump.BUILDS[name].spec["backward"]
    k = sw().SwigluElementwise(backward)
    assert len(re.findall(r"\.entry\s", text)) == 1
    # every global access a 16-byte vector: g, u (and dy) in, out (or dg, du) out
    loads = re.findall(r"ld\.global(?:\.\w+)*\.v4\.(?:b32|u32|f32)\s", text)
    stores = re.findall(r"st\.global(?:\.\w+)*\.v4\.(?:b32|u32|f32)\s", text)
    assert len(loads) == k.vecs * (3 if backward else 2), loads
    assert len(stores) == k.vecs * (2 if backward else 1), stores
    assert not re.search(r"\b(?:ld|st)\.global(?:\.\w+)*\.(?:b16|u16|b8|u8|v2)", text)
    assert len(re.findall(r"\bld\.global", text)) == len(loads)
    assert len(re.findall(r"\bst\.global", text)) == len(stores)
    # registers only: no local memory, no stack, no shared memory
    assert ".local" not in text and ".shared" not in text
    # sigmoid through ex2.approx and rcp.approx (8 elements a vector), no IEEE division
    assert text.count("ex2.approx") == 8 * k.vecs
    assert text.count("rcp.approx") == 8 * k.vecs
    assert "div.rn.f32" not in text and "div.full" not in text


@pytest.mark.skipif(PTXAS is None, reason="needs ptxas")
@pytest.mark.parametrize("name", BUILDS)
def test_ptxas_no_spills(ptx, name, tmp_path):
    info = assemble(ptx[name], "sm_90a", tmp_path)
    assert "0 bytes stack frame, " + NO_SPILLS in info, info
    # 256 threads a CTA: at least 3 CTAs (768 threads) an SM
    assert registers(info) <= 80, info


def test_tvm_ffi_build_compiles():
    """The build the torch entry points use (TVM-FFI, symbolic M, I, strides):
    compiled in a fresh process for sm_90a, no GPU needed."""
    code = ("import torch\n"
            "from csrc_free_kernels.hopper import swiglu_sm90_launch as s\n"
            "for b in (False, True):\n"
            "    for dt in (torch.bfloat16, torch.float16):\n"
            "        assert s.compiled_kernel(dt, b) is not None\n"
            "print('built')\n")
    assert "built" in run_for_arch("sm_90a", ["-c", code])


def test_no_ts_moe_import():
    for module in (sw(), swl()):
        src = open(module.__file__).read()
        assert not re.search(r"^\s*(?:from|import)\s+ts_moe", src, re.M)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_references_agree_with_autograd(dtype):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(7, 48, generator=g) * 4).to(dtype)
    dy = torch.randn(7, 24, generator=g).to(dtype)
    hf = h.float().requires_grad_()
    gate, up = hf.chunk(2, dim=-1)
    out = torch.nn.functional.silu(gate) * up
    out.backward(dy.float())
    torch.testing.assert_close(swiglu_ref(h), out.detach())
    torch.testing.assert_close(swiglu_grad_ref(dy, h), hf.grad)
    assert swiglu_ref(h).dtype == torch.float32


@pytest.mark.parametrize("h, reason", [
    (torch.randn(4, 32), "bf16 or fp16"),
    (torch.randn(4, 24).bfloat16(), "multiple of 8"),
    (torch.randn(4, 36).bfloat16()[:, 4:], "16-byte aligned"),
])
def test_backend_declines_what_it_cannot_run(h, reason):
    """The op validated the call; the backend declines, with its reason, rows its
    16-byte vectors cannot read (the op then runs the next path)."""
    from csrc_free_kernels.common.kernel_config import Declined

    got = swl().SWIGLU_ACTIVATION.choose_config(h, None)
    assert isinstance(got, Declined) and reason in got.reason, got
    assert swl().SWIGLU_ACTIVATION.choose_config(torch.randn(4, 32).bfloat16(), None) \
        == torch.bfloat16

