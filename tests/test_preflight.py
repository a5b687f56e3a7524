"""CPU: the pre-flight of the hardware's rules (``csrc_free_kernels.preflight.rules``) passes every
kernel build, fails the FP8 build that faulted on the H200 naming its scale load, and
each of its rules fails a build mutated to break it."""

import dataclasses
import json
import pathlib
import re

import pytest

from csrc_free_kernels import preflight, ptx_dump
from csrc_free_kernels.preflight.ptx import CTA, THREAD, WARP, WARPGROUP, Kernel
from csrc_free_kernels.preflight.trace import BuildFacts, TmaMap, parse_atom
from csrc_free_kernels.preflight.uniform import UniformityFlow

from .kernels.probe_builds import ALL_BUILDS, SM100

DATA = pathlib.Path(__file__).parent / "data"
SM90 = [n for n in ALL_BUILDS if n not in SM100
        and (not n.endswith("_reference") or ptx_dump.reference_module_available())]


def _arch(name):
    return "sm_100a" if name in SM100 else "sm_90a"


@pytest.fixture(scope="module")
def builds(ptx_store):
    """{name: (PTX, facts)} of every build, compiled once for the session."""
    found = {}
    for arch, names in (("sm_90a", SM90), ("sm_100a", SM100)):
        for name, text in ptx_store.get(arch, names).items():
            found[name] = (text, ptx_store.facts(arch, name))
    return found


# probes compiled to show a pipeline's barrier traffic, never run, that would hang or
# release early if they did: each must fail with the rules named (the findings:
# bench/notes/2026-12-06-preflight-rules.md)
KNOWN_BAD = {
    # leader_arms=False: no warp arms the full barrier its TMA loads complete on
    "probe90_P3_no_leader": {"expect-tx", "mbarrier-init"},
    # 2-SM pairs whose UMMA-side commits run in both CTAs (two arrivals a phase, count
    # 1), and cp.async arrivals that cannot reach the even CTA's 256-count barrier
    "probe100_async_load_2cta": {"mbarrier-init"},
    "probe100_async_thread_2cta": {"mbarrier-init"},
    "probe100_umma_umma_2cta": {"mbarrier-init"},
}


@pytest.mark.parametrize("name", [n for n in SM90 + SM100 if n not in KNOWN_BAD])
def test_every_build_passes(builds, name):
    text, facts = builds[name]
    found = preflight.check(name, text, facts)
    assert found == [], "\n".join(map(str, found))
    assert facts.registers and facts.frame_bytes == 0 and facts.cluster
    # every tensor-map parameter of the PTX is tied to an atom the DSL made
    maps = [p for p, align, size in Kernel(text).params if size == 128 and align == 64]
    assert len(maps) == len(facts.map_params)


@pytest.mark.parametrize("name", sorted(KNOWN_BAD))
def test_the_probes_that_would_hang_fail(builds, name):
    text, facts = builds[name]
    found = preflight.check(name, text, facts)
    assert {v.rule for v in found} == KNOWN_BAD[name], "\n".join(map(str, found))
    assert all(v.line for v in found if v.rule != "missing-fact")


def test_every_family_is_checked():
    prefixes = ("gemm_", "swiglu_", "fp8_", "dw_", "route_", "router_", "sort_slots",
                "combine_", "gather_", "swiglu_ew_", "quantize_", "sm100_", "probe90_",
                "probe100_")
    for p in prefixes:
        assert any(n.startswith(p) for n in SM90 + SM100), p


def _old_fp8():
    return ((DATA / "fp8_decode16_blockwise_b40e1e3.ptx").read_text(),
            BuildFacts.from_json((DATA / "fp8_decode16_blockwise_b40e1e3.facts.json")
                                 .read_text()))


def test_the_fp8_build_that_faulted_fails_on_its_scale_load():
    """The blockwise FP8 build as it ran on the H200 (b40e1e3): its activation-scale box
    starts at the expert's first row, so the one violation is that load.  (Its facts
    were recorded before launches recorded the cluster shape and the shared-memory
    allocations; added to them: no cluster, [1, 1, 1], as it launched, and the
    allocations of today's build of it, but for the activation scales' 2048 bytes
    then (its PTX puts the A stages at +7168), which add up to its 211968 bytes.)"""
    text, facts = _old_fp8()
    found = preflight.check("fp8_decode16_blockwise@b40e1e3", text, facts)
    assert [v.rule for v in found] == ["tma-coordinate"], found
    (v,) = found
    assert "f32" in v.why and "multiple of 4" in v.why
    line = int(re.search(r"PTX line (\d+)", v.where).group(1))
    load = text.splitlines()[line - 1]
    assert "cp.async.bulk.tensor.2d" in load and "{%r27, %r658}" in load
    # ...and the instruction is the load of the f32 map: the scale atom
    kernel = preflight.rules.Preflight("old", text, facts)
    (ins,) = [i for i in kernel.k.instrs if i.line == line]
    assert kernel.tensor_map(ins).dtype == "f32"


# ------------------------------------------------------------- mutations
def _mutated(builds, name, old, new, count=1):
    text, facts = builds[name]
    assert text.count(old) >= count, old
    return preflight.check(name, text.replace(old, new, count), facts)


def _rules(found):
    return sorted({v.rule for v in found})


def test_an_unmasked_scale_row_fails(builds):
    text, _ = builds["fp8_decode16_blockwise"]
    (mask,) = re.findall(r"and\.b32\s+(%r\d+),\s*(%r\d+),\s*-4;", text)
    found = _mutated(builds, "fp8_decode16_blockwise", f"and.b32 \t{mask[0]}, {mask[1]}, -4;",
                     f"mov.b32 \t{mask[0]}, {mask[1]};")
    assert _rules(found) == ["tma-coordinate"]


def test_a_stricter_mask_on_the_scale_row_passes(builds):
    text, _ = builds["fp8_decode16_blockwise"]
    (mask,) = re.findall(r"and\.b32\s+(%r\d+),\s*(%r\d+),\s*-4;", text)
    found = _mutated(builds, "fp8_decode16_blockwise", f"and.b32 \t{mask[0]}, {mask[1]}, -4;",
                     f"and.b32 \t{mask[0]}, {mask[1]}, -8;")
    assert found == [], found


def test_a_wrong_armed_byte_count_fails(builds):
    text, _ = builds["gemm_prefill_c2"]
    arm = re.search(r"expect_tx\.shared\.b64 \S+, \[\S+\], (%r\d+);", text).group(1)
    value = re.search(rf"mov\.b32\s+{re.escape(arm)}, (\d+);", text).group(1)
    found = _mutated(builds, "gemm_prefill_c2", f"{arm}, {value};", f"{arm}, {int(value) - 8192};")
    assert _rules(found) == ["expect-tx"] and "49152" in found[0].why  # what the loads give


@pytest.mark.parametrize("new, why", [("244", "multiple of 8"), ("256", "pool of 64512")])
def test_setmaxnreg_outside_the_budget_fails(builds, new, why):
    found = _mutated(builds, "gemm_mid", "setmaxnreg.inc.sync.aligned.u32 \t232;",
                     f"setmaxnreg.inc.sync.aligned.u32 \t{new};")
    assert _rules(found) == ["setmaxnreg"] and why in str(found)


@pytest.mark.parametrize("change, why", [
    ({"frame_bytes": 16}, "local memory"),
    ({"smem_bytes": 232449}, "over 232448"),
    ({"registers": 176}, "176 registers x 384 threads > 65536"),
])
def test_a_build_over_budget_fails(builds, change, why):
    text, facts = builds["gemm_prefill"]
    found = preflight.check("gemm_prefill", text, dataclasses.replace(facts, **change))
    assert "budget" in _rules(found) and why in str(found), found


def test_a_build_at_its_budget_passes(builds):
    text, facts = builds["gemm_prefill"]
    found = preflight.check("gemm_prefill", text, dataclasses.replace(facts, smem_bytes=232448))
    assert found == [], found


def test_a_misaligned_tma_destination_and_barrier_fail(builds):
    text, _ = builds["fp8_decode16_blockwise"]
    load = re.search(r"cp\.async\.bulk\.tensor\.3d[^\n]*\[(%r\d+)\+(\d+)\], \[%rd\d+, [^\]]*\], "
                     r"\[(%r\d+)\]", text)
    dst, off, bar = load.groups()
    moved = load.group(0).replace(f"[{dst}+{off}]", f"[{dst}+{int(off) + 64}]")
    found = preflight.check("x", text.replace(load.group(0), moved), builds[
        "fp8_decode16_blockwise"][1])
    assert _rules(found) == ["tma-smem"] and "1024-byte" in str(found)
    moved = load.group(0).replace(f"[{bar}]", f"[{bar}+4]")
    found = preflight.check("x", text.replace(load.group(0), moved), builds[
        "fp8_decode16_blockwise"][1])
    assert "mbarrier-align" in _rules(found) and "8-byte" in str(found)


def test_a_warpgroup_instruction_under_a_per_thread_branch_fails(builds):
    text, facts = builds["gemm_decode16"]
    fence = "\twgmma.fence.sync.aligned;\n"
    diverge = ("\tmov.u32 \t%r9990, %tid.x;\n\tsetp.eq.u32 \t%p9990, %r9990, 7;\n"
               "\t@%p9990 bra \t$L__PREFLIGHT;\n" + fence + "$L__PREFLIGHT:\n")
    found = preflight.check("x", text.replace(fence, diverge, 1), facts)
    assert _rules(found) == ["warpgroup-uniform"] and "per-thread" in str(found)
    # a branch on the warp index that splits a warpgroup (warp 5 of 4..7) fails too
    warp = ("\tmov.u32 \t%r9990, %tid.x;\n\tshr.u32 \t%r9991, %r9990, 5;\n"
            "\tsetp.lt.u32 \t%p9990, %r9991, 6;\n\t@%p9990 bra \t$L__PREFLIGHT;\n" + fence
            + "$L__PREFLIGHT:\n")
    found = preflight.check("x", text.replace(fence, warp, 1), facts)
    assert _rules(found) == ["warpgroup-uniform"] and "warp-uniform" in str(found)


@pytest.mark.parametrize("change, why", [
    ({"strides": (1, ("div", 4))}, "stride of dimension 1"),
    ({"box": (64, 300)}, "outside 1..256"),
    ({"box": (4, 16)}, "not a multiple of 16"),
    ({"box": (128, 16)}, "beyond the swizzle span"),
    ({"align": 8}, "aligned to 8 bytes"),
])
def test_a_bad_tensor_map_fails(builds, change, why):
    text, facts = builds["gemm_decode16"]
    maps = list(facts.maps)
    maps[0] = dataclasses.replace(maps[0], **change)
    found = preflight.check("x", text, dataclasses.replace(facts, maps=maps))
    assert "tensor-map" in _rules(found) and why in str(found)


@pytest.mark.parametrize("change", [{"strides": (1, ("div", 8))}, {"box": (64, 256)},
                                    {"align": 32}])
def test_a_tensor_map_at_its_limits_passes(builds, change):
    text, facts = builds["gemm_decode16"]
    maps = list(facts.maps)
    maps[0] = dataclasses.replace(maps[0], **change)
    found = preflight.check("x", text, dataclasses.replace(facts, maps=maps))
    assert "tensor-map" not in _rules(found), found


# ------------------------------------------------------------- the readers
_SNIPPET = """
.visible .entry k(.param .u64 k_param_0)
.reqntid 256, 1, 1
{{
	mov.u32 	%r1, %tid.x;
	shr.u32 	%r2, %r1, 5;
	shfl.sync.idx.b32 	%r3, %r2, 0, 31, -1;
	setp.{cmp}.s32 	%p1, %r3, {c};
	@%p1 bra 	$L__BB0_2;
	mov.u32 	%r4, %ctaid.x;
	shl.b32 	%r5, %r4, 6;
	mad.lo.s32 	%r6, %r5, 3, 128;
	and.b32 	%r7, %r1, -8;
	add.s32 	%r8, %r6, %r7;
$L__BB0_2:
	ret;
}}
"""


@pytest.mark.parametrize("cmp, c, level", [("ge", 4, WARPGROUP), ("lt", 4, WARPGROUP),
                                           ("ge", 3, WARP), ("eq", 0, WARP),
                                           ("gt", 100, CTA)])
def test_role_branches_are_as_uniform_as_their_boundary(cmp, c, level):
    k = Kernel(_SNIPPET.format(cmp=cmp, c=c))
    flow = UniformityFlow(k).run()
    assert flow.branch_level.get(0, CTA) == level
    align = k.alignment()
    assert align["%r5"] == 6 and align["%r6"] == 6 and align["%r7"] == 3 and align["%r8"] == 3
    assert align["%r1"] == 0


def test_a_thread_value_branch_is_per_thread():
    k = Kernel(_SNIPPET.format(cmp="lt", c=4).replace("%r3, %r2, 0, 31", "%r3, %r1, 0, 31")
               .replace("shfl.sync.idx", "shfl.sync.bfly"))
    assert UniformityFlow(k).run().branch_level.get(0, CTA) == THREAD


def test_atom_types_are_read():
    m = parse_atom("load", '!cute.memref<bf16, gmem, align<16>, "((64,2,?),?,?):((?{i64 div=8},'
                   '?{i64 div=8},?{i64 div=512}),1,?{i64 div=8})">',
                   '!cute_nvgpu.atom.non_exec_tiled_tma_load<sm_100_2sm, bf16, copy_bits = '
                   '65536, tma_gbasis = <"(64,64,1,1,(1)):(1@1,1@0@0,1@1@0,1@2@0,(1@2))">, '
                   'tma_format = BF16_RN>', "S<3,4,3> o 0 o ...", 1)
    assert m == TmaMap("load", "bf16", 16, (64, 64, 1, 1, 1),
                       (1, ("div", 8), ("div", 8), ("div", 512), ("div", 8)), 16, 3, 65536, 1)
    assert BuildFacts.from_json(json.dumps({"maps": [dataclasses.asdict(m)], "map_params": [0],
                                            "smem_bytes": 1, "registers": 2,
                                            "frame_bytes": 0})).maps == [m]
    with pytest.raises(ValueError, match="unreadable"):
        parse_atom("load", "!cute.memref<bf16, rmem>", "x", "", 1)
