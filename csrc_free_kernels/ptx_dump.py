"""Compile kernels for one arch without a GPU and keep their PTX.

    CUTE_DSL_ARCH=sm_90a python -m csrc_free_kernels.ptx_dump OUT_DIR '["NAME", ...]'

writes ``OUT_DIR/NAME.ptx`` for each named build (see :data:`BUILDS`) and beside it
``NAME.facts.json``, what the pre-flight needs that the PTX does not say (the TMA maps,
shared memory, the cubin's registers: :mod:`.preflight`).  The DSL reads the
arch and the keep/dump settings once, at import, so each arch needs its own process:
:func:`dump` runs one.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile


def _gemm(config, b_n_major=True, dtype="bfloat16", out="same", swiglu=False,
          prefetch=False, store_warp=False, **kw):
    def build():
        import dataclasses

        import cutlass
        import cutlass.cute as cute

        from .hopper import grouped_gemm_sm90 as g
        from .hopper.grouped_gemm_sm90_config import CONFIGS
        from .hopper.grouped_gemm_sm90_launch import _fake_args

        cfg = dataclasses.replace(CONFIGS[config], **kw)
        ab = getattr(cutlass, {"bfloat16": "BFloat16", "float16": "Float16"}[dtype])
        c = cutlass.Float32 if out == "float32" else ab
        cls = g.GroupedGemmSwigluSm90 if swiglu else g.GroupedGemmSm90
        if store_warp:
            from .hopper import grouped_gemm_sm90_store_warp as sw
            cls = sw.GroupedGemmSwigluStoreWarpSm90 if swiglu else sw.GroupedGemmStoreWarpSm90
        return cls(cfg, prefetch_weights=prefetch), (
            *_fake_args(ab, c, b_n_major, cls), cutlass.Int32(1),
            cute.runtime.make_fake_stream())
    build.config = (config, kw)  # for the PTX tests: the configuration built
    build.prefetch_weights = prefetch  # requested (GroupedGemmSm90 says if it took)
    build.swiglu = swiglu
    build.store_warp = store_warp
    return build


def _gemm100(config, b_n_major=True, gather=True, swiglu=False, out="same"):
    def build():
        import cutlass
        import cutlass.cute as cute

        from .sm100 import grouped_gemm_sm100 as g
        from .sm100.grouped_gemm_sm100_config import CONFIGS
        from .sm100.grouped_gemm_sm100_launch import fake_args

        cfg = CONFIGS[config]
        c = cutlass.Float32 if out == "float32" else cutlass.BFloat16
        return g.GroupedGemmSm100(cfg, gather=gather, b_n_major=b_n_major, swiglu=swiglu), (
            *fake_args(cutlass.BFloat16, c, b_n_major, swiglu, gather), cutlass.Int32(2),
            cute.runtime.make_fake_stream())
    build.config = (config, {"gather": gather, "swiglu": swiglu})
    return build


def _dw(config, dtype="bfloat16", out="same"):
    def build():
        import cutlass

        from .hopper import grouped_gemm_dw_sm90 as g
        from .hopper.grouped_gemm_dw_sm90_config import CONFIGS
        from .hopper.grouped_gemm_dw_sm90_launch import _fake_args

        ab = getattr(cutlass, {"bfloat16": "BFloat16", "float16": "Float16"}[dtype])
        c = cutlass.Float32 if out == "float32" else ab
        return g.GroupedGemmDwSm90(CONFIGS[config]), (
            *_fake_args(ab, c), cutlass.Int32(1), cutlass.cute.runtime.make_fake_stream())
    build.config = (config, {"dtype": dtype, "out": out})
    return build


def _swiglu_ew(backward, dtype="bfloat16"):
    def build():
        import cutlass

        from .hopper import swiglu_sm90 as s
        from .hopper.swiglu_sm90_launch import fake_args

        ab = getattr(cutlass, {"bfloat16": "BFloat16", "float16": "Float16"}[dtype])
        return s.SwigluElementwise(backward), fake_args(ab, backward)
    build.config = {"backward": backward, "dtype": dtype}
    return build


def _route(from_logits, dtype="bfloat16", per_lane=8):
    def build():
        import cutlass

        from .routing import route_sm90 as r
        from .routing.route_sm90_launch import route_fake_args

        c = getattr(cutlass, {"bfloat16": "BFloat16", "float32": "Float32",
                              "int64": "Int64", "int32": "Int32"}[dtype])
        return r.RouteSlots(from_logits, per_lane), route_fake_args(c, from_logits)
    build.config = {"from_logits": from_logits, "dtype": dtype, "per_lane": per_lane}
    return build


def _router(dtype="bfloat16"):
    def build():
        import cutlass

        from .routing import router_sm90 as r
        from .routing.router_sm90_launch import router_fake_args

        c = getattr(cutlass, {"bfloat16": "BFloat16", "float16": "Float16"}[dtype])
        return r.RouterLogits(), router_fake_args(c)
    build.config = {"dtype": dtype}
    return build


def _topk(dtype="bfloat16", per_lane=8):
    def build():
        import cutlass

        from .routing import router_sm90 as r
        from .routing.router_sm90_launch import topk_fake_args

        c = getattr(cutlass, {"bfloat16": "BFloat16", "float32": "Float32"}[dtype])
        return r.RouteTopK(per_lane), topk_fake_args(c)
    build.config = {"dtype": dtype, "per_lane": per_lane}
    return build


def _rowsum(weighted, index="int64"):
    def build():
        import cutlass

        from .routing import route_sm90 as r
        from .routing.route_sm90_launch import rowsum_fake_args

        return r.WeightedRowSum(weighted), rowsum_fake_args(
            cutlass.BFloat16, getattr(cutlass, index.capitalize()), weighted)
    build.config = {"weighted": weighted, "index": index}
    return build


def _fp8(config, recipe, swiglu=False, out="bfloat16", regs=0):
    def build():
        import cutlass
        import cutlass.cute as cute

        from .fp8 import grouped_gemm_fp8_sm90 as k
        from .fp8.grouped_gemm_fp8_sm90_config import CONFIGS
        from .fp8.grouped_gemm_fp8_sm90_launch import fake_args

        cls = k.GroupedGemmFp8SwigluSm90 if swiglu else k.GroupedGemmFp8Sm90
        kernel = cls(CONFIGS[config], recipe)
        if regs:  # the MMA warpgroups' register cap, lowered: must still not spill
            kernel.mma_regs = regs
        c = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
             "float32": cutlass.Float32}[out]
        return kernel, (*fake_args(recipe, c, swiglu), cutlass.Int32(1),
                        cute.runtime.make_fake_stream())
    build.config = (config, {"recipe": recipe, "swiglu": swiglu, "out": out, "regs": regs})
    return build


def _quantize(recipe, dtype):
    def build():
        import cutlass

        from .fp8 import quantize_fp8_sm90 as q
        from .fp8.quantize_fp8_sm90_launch import fake_args

        c = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
             "float32": cutlass.Float32}[dtype]
        return q.QuantizeFp8Sm90(recipe), fake_args(recipe, c)
    build.config = (recipe, {"dtype": dtype})
    return build


FP8_CONFIGS = ("fp8_decode16", "fp8_decode16_n64", "fp8_decode", "fp8_mid", "fp8_prefill",
               "fp8_prefill_c2")
FP8_RECIPES = ("blockwise", "rowwise", "tensorwise")


def fp8_name(config, recipe, swiglu=False, out="bfloat16", regs=0) -> str:
    return (f"{config}_{recipe}" + ("_swiglu" if swiglu else "")
            + ("" if out == "bfloat16" else f"_{out}") + (f"_r{regs}" if regs else ""))


def _fp8_builds() -> dict:
    """Every FP8 configuration x recipe x (plain, SwiGLU) with bf16 out; the other
    output dtypes once; the widest mainloops (SwiGLU blockwise) with the MMA
    warpgroups capped at 168 registers; the activation quantizer per recipe and dtype."""
    specs = [(c, r, s, "bfloat16", 0) for c in FP8_CONFIGS for r in FP8_RECIPES
             for s in (False, True)]
    specs += [("fp8_mid", "blockwise", False, o, 0) for o in ("float16", "float32")]
    specs += [(c, "blockwise", True, "bfloat16", 168) for c in ("fp8_decode", "fp8_mid")]
    builds = {fp8_name(*spec): _fp8(*spec) for spec in specs}
    builds.update({f"quantize_{r}_{d}": _quantize(r, d)
                   for r in ("blockwise_1x128", "rowwise", "tensorwise")
                   for d in ("bfloat16", "float16", "float32")})
    return builds


BUILDS = {
    "gemm_decode": _gemm("decode"),
    "gemm_decode_bk": _gemm("decode", b_n_major=False),
    "gemm_decode_fp16": _gemm("decode", dtype="float16"),
    "gemm_decode16": _gemm("decode16"),
    "gemm_decode16_bk": _gemm("decode16", b_n_major=False),
    "gemm_decode16_n64": _gemm("decode16_n64"),
    "gemm_decode16_n64_bk": _gemm("decode16_n64", b_n_major=False),
    # weights streaming before the kernel ahead ends (the MoE block's GEMMs)
    "gemm_decode16_bk_prefetch": _gemm("decode16", b_n_major=False, prefetch=True),
    "gemm_decode16_n64_bk_prefetch": _gemm("decode16_n64", b_n_major=False, prefetch=True),
    "gemm_prefill_bk_prefetch": _gemm("prefill", b_n_major=False, prefetch=True),
    "gemm_decode_p2": _gemm("decode_p2"),
    "gemm_decode_p2_bk": _gemm("decode_p2", b_n_major=False),
    "gemm_prefill_c2": _gemm("prefill_c2"),
    "gemm_prefill_c2_bk": _gemm("prefill_c2", b_n_major=False),
    "gemm_prefill_p2": _gemm("prefill_p2"),
    "gemm_prefill_p2_bk": _gemm("prefill_p2", b_n_major=False),
    "gemm_mid": _gemm("mid"),
    "gemm_prefill": _gemm("prefill"),
    "gemm_prefill_bk": _gemm("prefill", b_n_major=False),
    "gemm_prefill_f32_out": _gemm("prefill", out="float32"),
    "gemm_prefill_whole_experts": _gemm("prefill", band_m=0),
    # the output tile staged whole, stored by warp 3 (store_warp: opt-in, A/B)
    "gemm_prefill_sw": _gemm("prefill", store_warp=True),
    "gemm_prefill_sw_bk": _gemm("prefill", b_n_major=False, store_warp=True),
    "gemm_mid_sw": _gemm("mid", store_warp=True),
    "gemm_prefill_c2_sw": _gemm("prefill_c2", store_warp=True),
    "gemm_prefill_p2_sw": _gemm("prefill_p2", store_warp=True),
    "gemm_prefill_sw_prefetch": _gemm("prefill", b_n_major=False, prefetch=True,
                                      store_warp=True),
    "swiglu_prefill_sw": _gemm("prefill", b_n_major=False, swiglu=True, store_warp=True),
    "swiglu_decode": _gemm("decode", b_n_major=False, swiglu=True),
    "swiglu_prefill": _gemm("prefill", b_n_major=False, swiglu=True),
    "swiglu_decode16": _gemm("decode16", b_n_major=False, swiglu=True),
    "swiglu_decode16_n64": _gemm("decode16_n64", b_n_major=False, swiglu=True),
    "swiglu_decode16_prefetch": _gemm("decode16", b_n_major=False, swiglu=True,
                                      prefetch=True),
    "swiglu_decode16_n64_prefetch": _gemm("decode16_n64", b_n_major=False, swiglu=True,
                                          prefetch=True),
    "swiglu_decode_p2": _gemm("decode_p2", b_n_major=False, swiglu=True),
    "swiglu_prefill_c2": _gemm("prefill_c2", b_n_major=False, swiglu=True),
    "swiglu_prefill_p2": _gemm("prefill_p2", b_n_major=False, swiglu=True),
    # k-grouped GEMM (weight gradient), sm_90a
    "dw_128x256": _dw("dw_128x256"),
    "dw_128x256_fp16": _dw("dw_128x256", dtype="float16"),
    "dw_128x256_f32_out": _dw("dw_128x256", out="float32"),
    "dw_128x128": _dw("dw_128x128"),
    "dw_128x128_f32_out": _dw("dw_128x128", out="float32"),
    # SwiGLU activation / gradient, elementwise, sm_90a
    "swiglu_ew_fwd": _swiglu_ew(False),
    "swiglu_ew_fwd_fp16": _swiglu_ew(False, "float16"),
    "swiglu_ew_bwd": _swiglu_ew(True),
    "swiglu_ew_bwd_fp16": _swiglu_ew(True, "float16"),
    # routing, slot order, combine and row gather of the decode block, sm_90a
    "router_logits": _router(),
    "router_logits_fp16": _router("float16"),
    "route_slots": _route(True),
    "route_slots_f32": _route(True, "float32"),
    "route_slots_e32": _route(True, per_lane=1),     # up to 32 experts (Mixtral)
    "route_topk": _topk(),                            # the routing alone, many CTAs
    "route_topk_f32": _topk("float32", per_lane=4),
    "sort_slots_i64": _route(False, "int64"),
    "sort_slots_i32": _route(False, "int32"),
    "combine_rows": _rowsum(True),
    "gather_rows_i32": _rowsum(False, "int32"),
    # sm_100a (Blackwell): compile- and schedule-verified only
    "sm100_gemm_n256": _gemm100("n256"),
    "sm100_gemm_n256_bk": _gemm100("n256", b_n_major=False),
    "sm100_gemm_n256_dense": _gemm100("n256", gather=False),
    "sm100_gemm_n256_f32_out": _gemm100("n256", out="float32"),
    "sm100_gemm_n128": _gemm100("n128"),
    "sm100_swiglu_n256": _gemm100("n256", b_n_major=False, swiglu=True),
    "sm100_swiglu_n128": _gemm100("n128", b_n_major=False, swiglu=True),
    # FP8 grouped GEMM and the activation quantizer, sm_90a
    **_fp8_builds(),
}


def reference_module_available() -> bool:
    try:
        from cutlass.experimental.task_scheduling import pipeline  # noqa: F401
    except ImportError:
        return False
    return True


def main(out_dir: str, names: list, builds: dict = BUILDS) -> None:
    """Compile each of ``names`` (keys of ``builds``) for the arch of this process,
    writing ``NAME.ptx`` and ``NAME.facts.json`` to ``out_dir``."""
    import cutlass.cute as cute

    from . import preflight
    out = pathlib.Path(out_dir)
    dump_dir = pathlib.Path(os.environ["CUTE_DSL_DUMP_DIR"])
    for name in names:
        if name.endswith("_reference") and not reference_module_available():
            continue
        kernel, args = builds[name]()
        with preflight.recording() as facts:
            cute.compile(kernel, *args)
        (out / f"{name}.ptx").write_text(preflight.collect(dump_dir, facts))
        (out / f"{name}.facts.json").write_text(facts.to_json())


def dump(arch: str, names: list, out_dir: str, timeout: float = 600,
         main_module: str = "csrc_free_kernels.ptx_dump") -> dict:
    """Compile ``names`` for ``arch`` in a fresh process; returns ``{name: ptx text}``.

    The child runs ``python -m main_module OUT_DIR NAMES``: this module, or one
    whose ``__main__`` calls :func:`main` with more builds than :data:`BUILDS`
    (the tests' probes: ``tests.kernels.probe_builds``), so that this package
    never imports what is not in it."""
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory(prefix="ts_moe_ptx_") as scratch:
        env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_KEEP="ptx,cubin",
                   CUTE_DSL_DUMP_DIR=scratch, TS_MOE_NO_DISK_CACHE="1")
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run([sys.executable, "-m", main_module, out_dir, json.dumps(names)],
                              env=env, capture_output=True, text=True, timeout=timeout, cwd=root)
    if proc.returncode:
        raise RuntimeError(f"PTX build for {arch} failed:\n{proc.stdout}\n{proc.stderr}")
    return {p.stem: p.read_text() for p in pathlib.Path(out_dir).glob("*.ptx")}


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
