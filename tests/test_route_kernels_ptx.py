"""CPU: the decode block's small kernels (router logits, routing and slot order,
combine, row gather) compile for sm_90a and assemble without spills; their torch entry points
and the ops' CPU paths agree with the plain-torch functions."""

import re

import pytest
import torch

import ts_moe
from csrc_free_kernels import ptx_dump
from csrc_free_kernels.routing import ROUTE_SM90, ROUTER_SM90
from ts_moe import ops, reference
from ts_moe.ops import paths

from .helpers import fake_route_kernel, rel_err, router_logits_reference
from .ptxas import NO_SPILLS, PTXAS, assemble, assert_pdl_entry, ptx_fixture, run_for_arch

BUILDS = ptx_dump.builds_of(ROUTE_SM90, ROUTER_SM90)
ptx = ptx_fixture("sm_90a", BUILDS)


def test_builds(ptx):
    assert set(BUILDS) <= set(ptx)
    assert {ptx_dump.space()[n][0] for n in BUILDS} == {ROUTE_SM90, ROUTER_SM90}  # both checked
    for name in BUILDS:
        assert len(re.findall(r"\.entry\s", ptx[name])) == 1
        assert ".local" not in ptx[name]


@pytest.mark.parametrize("name", BUILDS)
def test_waits_for_the_stream_before_global_memory(ptx, name):
    """Launched with PDL: nothing global before griddepcontrol.wait."""
    assert_pdl_entry(ptx[name])


def test_row_kernels_move_16_byte_vectors(ptx):
    for name in ("combine_rows", "gather_rows_i32"):
        text = ptx[name]
        assert re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", text), name
        assert len(re.findall(r"st\.global(?:\.\w+)*\.v4\.b32", text)) == 1, name
        assert not re.search(r"st\.global(?:\.\w+)*\.(?:b16|v2)", text), name


@pytest.mark.parametrize("name", ["router_logits", "router_logits_fp16"])
def test_router_kernel_streams_16_byte_vectors_and_stores_once(ptx, name):
    """Each thread loads whole 16-byte vectors of the experts' and the tokens' rows
    (two experts and eight tokens a CTA, the loop unrolled twice: 20 loads), sums in
    fp32, and a CTA's partial sums meet in shared memory, not by atomics; one
    rounding, one 2-byte store of each logit."""
    text = ptx[name]
    loads = re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", text)
    assert len(loads) == 20 and len(re.findall(r"ld\.global", text)) == 20
    assert len(re.findall(r"fma\.rn\.f32", text)) == 2 * 2 * 8 * 8
    assert len(re.findall(r"st\.global\.b16", text)) == 1
    assert len(re.findall(r"st\.global", text)) == 1
    assert not re.search(r"^\s*(?:@!?%p\d+\s+)?(?:atom|red)\.", text, re.M)
    assert len(re.findall(r"shfl\.sync\.bfly", text)) == 2 * 8 * 5
    cvt = {"router_logits": "cvt.rn.bf16.f32", "router_logits_fp16": "cvt.rn.f16.f32"}[name]
    assert text.count(cvt) == 1


def test_topk_kernel_is_the_routing_phase_alone(ptx):
    """RouteTopK: a warp a token, the routing kernel's rounds (bf16: one packed
    reduction a round; fp32: two), no shared memory, no barrier, no atomics;
    each lane stores the weights and experts of its rounds."""
    for name, per_lane, reductions in (("route_topk", 8, {"max": 2, "min": 0}),
                                       ("route_topk_f32_e128", 4, {"max": 2, "min": 1})):
        text = ptx[name]
        assert text.count("redux.sync.max") == reductions["max"], name
        assert text.count("redux.sync.min") == reductions["min"], name
        assert ".shared" not in text and "bar.sync" not in text, name
        assert not re.search(r"^\s*(?:@!?%p\d+\s+)?(?:atom|red)\.", text, re.M), name
        assert len(re.findall(r"st\.global\.b32", text)) == per_lane, name
        assert len(re.findall(r"st\.global\.b64", text)) == per_lane, name


def test_router_kernel_tile_is_validated():
    from csrc_free_kernels.routing import router_sm90_launch as r

    with pytest.raises(ValueError, match="experts_per_cta"):
        r.RouterLogits(experts_per_cta=0)
    with pytest.raises(ValueError, match="outnumber"):
        r.RouterLogits(experts_per_cta=8, tokens_per_cta=8, warps=1)
    # each CTA: its 2 experts' rows and its (up to) 8 tokens' rows
    assert r.router_read_bytes(1, 8, 4096) == 4 * 3 * 4096 * 2
    assert r.router_read_bytes(16, 256, 7168) == 128 * 2 * 10 * 7168 * 2
    assert r.router_read_bytes(3, 1, 64) == 1 * 1 * 4 * 64 * 2


def test_router_kernel_taken_for_small_batches_only():
    """The op's rule: the kernel while its CTAs read at most ROUTER_KERNEL_MAX_READ
    (the rows of x are read once per expert pair)."""
    from csrc_free_kernels.routing import router_sm90_launch as r

    def taken(t, e, h):
        return r.router_read_bytes(t, e, h) <= r.ROUTER_KERNEL_MAX_READ

    assert all(taken(t, 8, 4096) for t in (1, 16, 64, 128))         # Mixtral
    assert taken(64, 128, 2048) and not taken(128, 128, 2048)       # Qwen3-30B-A3B
    assert taken(8, 256, 7168) and not taken(16, 256, 7168)         # DeepSeek-V3


def test_router_kernel_declines_what_it_cannot_take():
    """The backend declines, saying why, a batch or an H its kernel cannot take."""
    from csrc_free_kernels.routing import router_sm90_launch as r

    w = torch.randn(8, 64, dtype=torch.bfloat16)
    declined = r.ROUTER_LOGITS.choose_config(torch.randn(0, 64, dtype=torch.bfloat16), w)
    assert not declined and "1 to 524280 tokens" in declined.reason
    declined = r.ROUTER_LOGITS.choose_config(torch.randn(2, 60, dtype=torch.bfloat16),
                                             torch.randn(8, 60, dtype=torch.bfloat16))
    assert not declined and "a multiple of 8" in declined.reason


def test_lane_widths():
    """One build per logits-per-lane width: a round's scan is no wider than E needs."""
    from csrc_free_kernels.routing import route_sm90 as r
    from csrc_free_kernels.routing.route_sm90_launch import lane_width

    assert [lane_width(e) for e in (1, 8, 32, 33, 60, 64, 65, 128, 129, 256)] == \
        [1, 1, 1, 2, 2, 2, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="per_lane must be one of"):
        r.RouteSlots(True, per_lane=3)


def test_routing_is_one_cta_with_warp_shuffles(ptx):
    text = ptx["route_slots"]
    assert "shfl.sync.bfly" in text
    assert ".shared" in text and "atom." not in text  # no atomics: deterministic
    # top-k rounds: bf16 logits pack key and expert (one reduction a round, and
    # the first outside the loop); fp32 the largest key, then the lowest expert
    assert text.count("redux.sync.max") == 2 and "redux.sync.min" not in text
    f32 = ptx["route_slots_f32"]
    assert f32.count("redux.sync.max") == 2 and f32.count("redux.sync.min") == 1


@pytest.mark.skipif(PTXAS is None, reason="needs ptxas")
@pytest.mark.parametrize("name", BUILDS)
def test_ptxas_no_spills(ptx, name, tmp_path):
    assert NO_SPILLS in assemble(ptx[name], "sm_90a", tmp_path)


def test_tvm_ffi_builds_compile():
    """The builds the ops use (TVM-FFI, symbolic sizes): compiled in a fresh process
    for sm_90a, no GPU needed."""
    code = ("import torch\n"
            "from csrc_free_kernels.routing import route_sm90_launch as r\n"
            "from csrc_free_kernels.routing import router_sm90_launch as rr\n"
            "for dt in (torch.bfloat16, torch.float16):\n"
            "    assert rr._router_kernel(dt) is not None\n"
            "    assert rr._topk_kernel(dt, 4) is not None\n"
            "for dt in (torch.bfloat16, torch.float32):\n"
            "    assert r._route_kernel(True, dt) is not None\n"
            "for dt in (torch.int32, torch.int64):\n"
            "    assert r._route_kernel(False, dt) is not None\n"
            "    assert r._rowsum_kernel(False, torch.bfloat16, dt) is not None\n"
            "assert r._rowsum_kernel(True, torch.bfloat16, torch.int64) is not None\n"
            "print('built')\n")
    assert "built" in run_for_arch("sm_90a", ["-c", code])


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (5, 8, 2), (33, 64, 6), (0, 4, 1)])
def test_ops_cpu_paths_are_the_torch_functions(tokens, experts, top_k):
    logits = torch.randn(tokens, experts)
    w, ex, slots = ops.route_slots(logits, top_k)
    w_ref, ex_ref = reference.route(logits, top_k)
    slots_ref = reference.sort_slots(ex_ref, experts)
    assert torch.equal(ex, ex_ref) and torch.equal(w, w_ref)
    for got, ref in zip(slots, slots_ref):
        assert torch.equal(got, ref)
    for got, ref in zip(ops.sort_slots(ex, experts), slots_ref):
        assert torch.equal(got, ref)
    y = torch.randn(tokens * top_k, 16, dtype=torch.bfloat16)
    assert torch.equal(ops.combine(y, w, slots.inverse), reference.combine(y, w, slots.inverse))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", [False, True])
def test_router_logits_cpu_is_f_linear(dtype, kernel):
    """On the CPU (either setting of use_router_kernel) the op is F.linear: within
    an output rounding of the float64 reference; eager and compiled alike."""
    x = torch.randn(5, 72, dtype=dtype)
    w = torch.randn(12, 72, dtype=dtype)
    previous = ops.use_router_kernel(kernel)
    try:
        got = ops.router_logits(x, w)
        compiled = torch.compile(ops.router_logits, fullgraph=True)(x, w)
    finally:
        ops.use_router_kernel(previous)
    assert got.dtype == dtype and got.shape == (5, 12)
    assert torch.equal(got, torch.nn.functional.linear(x, w)) and torch.equal(compiled, got)
    ref = router_logits_reference(x, w)
    assert rel_err(got, ref) < 1e-2
    for row, ref_row in zip(got, ref):
        assert rel_err(row, ref_row) < 1e-2


@pytest.fixture
def sm90_kernels_on_cpu(monkeypatch):
    """The sm_90 routing backends for CPU tensors, their compiled kernels replaced
    by recorders (everything else, choose_config and the launch glue, is the
    backends' own): the router writes 7s, the routing kernels the references'
    results.  Yields the list of launches."""
    from csrc_free_kernels.routing import route_sm90_launch, router_sm90_launch

    launches = []

    def router_kernel(dtype):
        def launch(x, weight, out):
            launches.append(("router_logits", x))
            out.fill_(7)
        return launch

    def topk_kernel(dtype, per_lane):
        def launch(logits, weights, experts):
            launches.append(("route_topk", per_lane))
            w, ex = reference.route(logits, experts.shape[1])
            weights.copy_(w), experts.copy_(ex)
        return launch

    monkeypatch.setattr(router_sm90_launch, "_router_kernel", router_kernel)
    monkeypatch.setattr(router_sm90_launch, "_topk_kernel", topk_kernel)
    monkeypatch.setattr(route_sm90_launch, "_route_kernel", fake_route_kernel(launches))
    monkeypatch.setattr(paths, "device_capability", lambda t: (9, 0))
    previous = ops.use_router_kernel(True)
    yield launches
    ops.use_router_kernel(previous)


def test_router_op_chooses_on_shapes_and_the_weight(sm90_kernels_on_cpu, monkeypatch):
    """The op's choice: small 16-bit batches go to the kernel, x's unreadable rows
    copied first (never F.linear for them: a decode graph's aligned buffers
    would take the kernel); too many tokens, too many bytes, an unreadable
    weight, fp32 or the switch off: F.linear."""
    from csrc_free_kernels.routing import router_sm90_launch

    launches = sm90_kernels_on_cpu
    monkeypatch.setattr(router_sm90_launch, "ROUTER_MAX_TOKENS", 6)
    bf16 = torch.bfloat16
    w = torch.randn(8, 64, dtype=bf16)
    x = torch.randn(3, 64, dtype=bf16)
    assert (ops.router_logits(x, w) == 7).all() and launches[-1][1] is x
    odd = torch.randn(3 * 64 + 1, dtype=bf16)[1:].view(3, 64)  # 2-byte offset
    assert (ops.router_logits(odd, w) == 7).all()
    assert launches[-1][1] is not odd and torch.equal(launches[-1][1], odd)
    assert launches[-1][1].data_ptr() % 16 == 0
    strided = torch.randn(3, 68, dtype=bf16)[:, :64]  # 136-byte rows
    assert (ops.router_logits(strided, w) == 7).all() and launches[-1][1].stride(0) == 64
    count = len(launches)
    big_w = torch.randn(4096, 4096, dtype=bf16)
    assert router_sm90_launch.router_read_bytes(2, 4096, 4096) > \
        router_sm90_launch.ROUTER_KERNEL_MAX_READ
    for args in ((torch.randn(7, 64, dtype=bf16), w), (torch.randn(2, 4096, dtype=bf16), big_w),
                 (x, torch.randn(8, 65, dtype=bf16)[:, :64]), (x.float(), w.float()),
                 (torch.randn(3, 60, dtype=bf16), torch.randn(8, 60, dtype=bf16))):
        assert torch.equal(ops.router_logits(*args), torch.nn.functional.linear(*args))
    ops.use_router_kernel(False)
    assert torch.equal(ops.router_logits(x, w), torch.nn.functional.linear(x, w))
    assert len(launches) == count


def test_route_op_splits_large_batches_with_the_router_kernels(sm90_kernels_on_cpu):
    """With use_router_kernel, a batch of at least ROUTE_SPLIT_MIN_WORK tokens x
    logits per lane is routed on many CTAs, then sorted (two launches); smaller
    ones, or the switch off, take the one-CTA kernel (one launch); past its
    1024 slots, the references (none)."""
    from csrc_free_kernels.routing import router_sm90_launch

    launches = sm90_kernels_on_cpu
    assert router_sm90_launch.ROUTE_SPLIT_MIN_WORK == 128
    cases = [((32, 128), ["route_topk", "sort_slots"]), ((31, 128), ["route_slots"]),
             ((16, 256), ["route_topk", "sort_slots"]), ((15, 256), ["route_slots"]),
             ((128, 8), ["route_topk", "sort_slots"]), ((127, 8), ["route_slots"]),
             ((1025, 8), [])]
    for (tokens, experts), taken in cases:
        launches.clear()
        logits = torch.randn(tokens, experts)
        w, ex, slots = ops.route_slots(logits, 1)
        assert [name for name, _ in launches] == taken, (tokens, experts)
        w_ref, ex_ref = reference.route(logits, 1)
        assert torch.equal(w, w_ref) and torch.equal(ex, ex_ref)
        for got, want in zip(slots, reference.sort_slots(ex_ref, experts), strict=True):
            assert torch.equal(got, want)
    ops.use_router_kernel(False)
    launches.clear()
    ops.route_slots(torch.randn(64, 128), 8)
    assert launches == [("route_slots", 4)]  # the build for 128 experts: 4 logits a lane


def test_use_router_kernel_returns_the_previous_setting():
    assert ops.router_kernel_enabled() is False
    assert ops.use_router_kernel() is False and ops.router_kernel_enabled() is True
    assert ts_moe.use_router_kernel(False) is True and ops.router_kernel_enabled() is False


def test_router_logits_keeps_gradients():
    x = torch.randn(3, 16, requires_grad=True)
    w = torch.randn(4, 16, requires_grad=True)
    ops.router_logits(x, w).square().sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.linear(x2, w2).square().sum().backward()
    assert torch.allclose(x.grad, x2.grad) and torch.allclose(w.grad, w2.grad)


@pytest.mark.parametrize("args,exc,match", [
    ((torch.randn(3, 8), torch.randn(4, 6)), ValueError, r"weight must be \(E, H\) with H ="),
    ((torch.randn(3, 8), torch.randn(4, 8, dtype=torch.float64)), TypeError, "weight must have"),
    ((torch.randn(3, 8, 1), torch.randn(4, 8)), ValueError, "x must be 2-D"),
    ((torch.ones(3, 8, dtype=torch.int32), torch.randn(4, 8)), TypeError, "x must be floating"),
    (([[1.0]], torch.randn(4, 1)), TypeError, "x must be a torch.Tensor"),
    ((torch.randn(3, 8), torch.randn(4, 8, device="meta")), ValueError, "weight is on meta"),
])
def test_router_logits_bad_arguments_name_them(args, exc, match):
    with pytest.raises(exc, match=match):
        ops.router_logits(*args)
    with pytest.raises(Exception, match=match):  # compiled: the same error, wrapped
        torch.compile(ops.router_logits, fullgraph=True)(*args)


def test_ops_keep_gradients():
    """Where the logits or the expert outputs need a gradient, the differentiable
    torch functions run: the router still learns."""
    logits = torch.randn(4, 8, requires_grad=True)
    w, _, slots = ops.route_slots(logits, 2)
    y = torch.randn(8, 16, requires_grad=True)
    ops.combine(y, w, slots.inverse).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    assert y.grad is not None and y.grad.abs().sum() > 0


def test_ops_bad_arguments_name_them():
    with pytest.raises(ValueError, match="top_k"):
        ops.route_slots(torch.randn(3, 4), 5)
    with pytest.raises(TypeError, match="logits"):
        ops.route_slots(torch.ones(3, 4, dtype=torch.int32), 1)
    with pytest.raises(TypeError, match="experts"):
        ops.sort_slots(torch.ones(3, 2), 4)
    with pytest.raises(ValueError, match="inverse"):
        ops.combine(torch.randn(6, 8), torch.rand(3, 2), torch.arange(5))


def test_opcheck():
    torch.library.opcheck(torch.ops.ts_moe.router_logits.default,
                          (torch.randn(3, 16), torch.randn(8, 16)))
    logits = torch.randn(6, 8)
    torch.library.opcheck(torch.ops.ts_moe.route_slots.default, (logits, 2))
    ex = torch.randint(0, 8, (6, 2))
    torch.library.opcheck(torch.ops.ts_moe.sort_slots.default, (ex, 8))
    slots = reference.sort_slots(ex, 8)
    torch.library.opcheck(torch.ops.ts_moe.combine.default,
                          (torch.randn(12, 16), torch.rand(6, 2), slots.inverse))


def test_layer_compiles_with_the_ops():
    moe = ts_moe.MoE(16, 32, 4, 2)
    x = torch.randn(5, 16)
    with torch.no_grad():
        eager = moe(x)
        compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    assert torch.allclose(eager, compiled, atol=1e-6)


def test_small_kernels_only_where_the_sm90_kernels_run(monkeypatch):
    """``paths.device_backends``: the sm_90 routing, row and activation kernels on
    a CUDA device whose calls take the sm_90 kernels, the references on the
    CPU and where the path is another."""
    from csrc_free_kernels.routing import route_sm90_launch

    class CudaTensor:  # what the choice reads of a tensor on cuda:0
        device = torch.device("cuda", 0)

        def get_device(self):
            return 0

    reference = paths.TABLE[paths.Path.REFERENCE][paths.Op.SORT_SLOTS]
    monkeypatch.setattr(paths, "_capability", lambda index: (9, 0))
    assert paths.device_backends(paths.Op.SORT_SLOTS, CudaTensor()) == (
        route_sm90_launch.SORT_SLOTS, reference)
    assert paths.device_backends(paths.Op.SORT_SLOTS, torch.ones(1)) == (reference,)
    monkeypatch.setattr(paths, "_capability", lambda index: (10, 0))  # a B200: torch's GEMMs
    assert paths.device_backends(paths.Op.SORT_SLOTS, CudaTensor()) == (reference,)


def test_kernels_decline_batches_past_their_tables():
    """The backends decline, saying why, a batch past the one CTA's tables (a batch of
    2,560 slots once ran past them: an illegal address); the op refuses a top_k past E."""
    from csrc_free_kernels.routing import route_sm90_launch as r

    declined = r.ROUTE_SLOTS.choose_config(torch.zeros(64, 64, dtype=torch.bfloat16), 40)
    assert not declined and "1 to 1024 slots" in declined.reason
    declined = r.SORT_SLOTS.choose_config(torch.zeros(4, 2, dtype=torch.int64), 257)
    assert not declined and "257 experts" in declined.reason
    declined = r.SORT_SLOTS.choose_config(torch.zeros(0, 2, dtype=torch.int64), 8)
    assert not declined and "0 slots" in declined.reason
    with pytest.raises(ValueError, match=r"top_k"):
        ops.route_slots(torch.zeros(1, 8, dtype=torch.bfloat16), 9)
