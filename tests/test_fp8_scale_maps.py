"""CPU: the FP8 kernel's scale-coordinate maps pinned against the reference.

Which ``scale_a`` / ``scale_b`` element each MMA thread multiplies into which accumulator
element is taken from the kernel's own layout objects: each thread's tile coordinates
(``GroupedGemmFp8Sm90.tile_coords``, the partition the kernel runs) and the static
:class:`FragmentScaleMap` it derives from thread 0, evaluated at trace time on the host
for every thread of every configuration.  A torch emulation of the kernel then applies
those maps tile by tile and k-block by k-block, with the kernel's memory semantics (TMA
zero fill past M, N and K; token-box rows the stage never loaded are NaN; the blockwise
scale box from the tile's first row rounded down to a multiple of 4, read shifted back,
with the kernel's own ``sfa_box_start`` / ``sfa_row_shift``; the warpgroup skip; the
epilogue's row and column predicates; the launch glue's ``a_index`` gather), and must
reproduce a float64 dequantize-then-multiply reference.
"""

import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
import torch

CONFIG_NAMES = ("fp8_decode16", "fp8_decode16_n64", "fp8_decode", "fp8_mid", "fp8_prefill",
                "fp8_prefill_c2")
RECIPES = ("blockwise", "rowwise", "tensorwise")

_TRACE = """
import json, sys
import cutlass, cutlass.cute as cute
from cutlass.tensor_utils import LayoutEnum
from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90 as K
from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_config as C
maps = {}
for name in json.loads(sys.argv[1]):
    for swiglu in (False, True):
        cls = K.GroupedGemmFp8SwigluSm90 if swiglu else K.GroupedGemmFp8Sm90
        kernel = cls(C.CONFIGS[name], "blockwise")
        key = f"{kernel.cfg.tile_m}x{kernel.cfg.tile_n}:{int(swiglu)}"
        if key in maps:  # the map depends on the MMA tile and the kernel class only
            continue
        entry = {}

        @cute.jit
        def trace(x: cute.Tensor):
            kernel._setup(cutlass.Float8E4M3FN, cutlass.BFloat16, LayoutEnum.ROW_MAJOR,
                          LayoutEnum.ROW_MAJOR, LayoutEnum.ROW_MAJOR)
            fmap = kernel.fragment_scale_map(kernel.tiled_mma)
            entry["row_slot"], entry["row_rep"], entry["part"] = (
                list(fmap.row_slot), list(fmap.row_rep), list(fmap.part))
            coords = []
            for t in cutlass.range_constexpr(kernel.num_mma_threads):
                c = kernel.tile_coords(kernel.tiled_mma, t)
                coords.append([[int(v) for v in c[i]] for i in range(cute.size(c))])
            entry["coords"] = coords

        cute.compile(trace, cute.runtime.make_fake_compact_tensor(cutlass.Float32, (4,)))
        maps[key] = entry
print(json.dumps(maps))
"""


@pytest.fixture(scope="module")
def maps():
    """{"MxN:swiglu": {"coords": [thread][element] -> [row, col], "row_slot",
    "row_rep", "part"}} for each MMA tile of the configurations, traced for sm_90a in a
    fresh process; :func:`_entry` looks a configuration's up."""
    root = pathlib.Path(__file__).resolve().parent.parent
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", TS_MOE_NO_DISK_CACHE="1",
               CUTE_DSL_DUMP_DIR=tempfile.mkdtemp(prefix="ts_moe_fp8_maps_"),
               PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = pathlib.Path(tempfile.mkdtemp(prefix="ts_moe_fp8_trace_")) / "trace_maps.py"
    script.write_text(_TRACE)  # the DSL reads a jit function's source from its file
    proc = subprocess.run([sys.executable, str(script), json.dumps(CONFIG_NAMES)], env=env,
                          cwd=root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _entry(maps, name, swiglu):
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_config as C

    cfg = C.CONFIGS[name]
    return maps[f"{cfg.tile_m}x{cfg.tile_n}:{int(swiglu)}"]


def _kernel(name, swiglu, recipe="blockwise"):
    """The kernel object (host-side methods only: no tracing)."""
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90 as K
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_config as C

    cls = K.GroupedGemmFp8SwigluSm90 if swiglu else K.GroupedGemmFp8Sm90
    return cls(C.CONFIGS[name], recipe)


def _tile_sources(entry, tile_m, tile_n, row_slot=None):
    """(tile_m, tile_n) maps from the traced ones: the tile row whose activation scale
    element (m, n) takes (the row of its thread's ``row_rep`` element), and its scale
    part; every element owned by exactly one (thread, element)."""
    row_slot = row_slot or entry["row_slot"]
    owner = torch.zeros(tile_m, tile_n, dtype=torch.int64)
    row_src = torch.full((tile_m, tile_n), -1, dtype=torch.int64)
    part_src = torch.full((tile_m, tile_n), -1, dtype=torch.int64)
    for coords in entry["coords"]:
        for i, (m, n) in enumerate(coords):
            owner[m, n] += 1
            row_src[m, n] = coords[entry["row_rep"][row_slot[i]]][0]
            part_src[m, n] = entry["part"][i]
    return owner, row_src, part_src


@pytest.mark.parametrize("name", CONFIG_NAMES)
@pytest.mark.parametrize("swiglu", [False, True])
def test_maps_cover_the_tile_with_the_own_row_and_block(maps, name, swiglu):
    """Every accumulator element of the tile belongs to one thread, takes the activation
    scale of its own row and the weight scale block its column's weight row lies in."""
    kernel = _kernel(name, swiglu)
    cfg = kernel.cfg
    entry = _entry(maps, name, swiglu)
    assert len(entry["coords"]) == 128 * cfg.mma_warpgroups
    assert len(entry["row_rep"]) == 2  # two rows per thread per 64-row MMA block
    owner, row_src, part_src = _tile_sources(entry, cfg.tile_m, cfg.tile_n)
    assert bool((owner == 1).all())
    assert torch.equal(row_src, torch.arange(cfg.tile_m).unsqueeze(1).expand_as(row_src))
    n_cols = 3 * 128  # SwiGLU: I (the output's columns); the plain kernel: N
    for n_tile in range(3):
        for n in range(cfg.tile_n):
            weight_row = kernel.weight_column(n, n_tile, n_cols)
            block = kernel.scale_block_row(n_tile, int(part_src[0, n]), n_cols) // 128
            assert weight_row // 128 == block, (n_tile, n)
            assert bool((part_src[:, n] == part_src[0, n]).all())


# ------------------------------------------------------------ emulation
def _segments(offs, m, num_experts):
    """(expert, start, end) of each expert and the zero-filled tail (expert E)."""
    ends, run = [], 0
    for o in offs.tolist():
        run = max(run, min(max(o, 0), m))
        ends.append(run)
    start = 0
    for e, end in enumerate(ends + [m]):
        yield (e if e < num_experts else num_experts), start, end
        start = end


def _silu(x):
    return x / (1 + torch.exp(-x))


def emulate(kernel, entry, recipe, a, b, sfa, sfb, offs, n_out):
    """The kernel's output, float64, NaN where it writes nothing: ``a`` (M, K) and ``b``
    (E, K, N) the e4m3 values, ``sfa`` / ``sfb`` as the kernel reads them."""
    cfg = kernel.cfg
    m_rows, k = a.shape
    num_experts, _, n = b.shape
    kb_count = -(-k // 128)
    pad = kb_count * 128 - k
    a = torch.nn.functional.pad(a.double(), (0, pad))
    b = torch.nn.functional.pad(b.double(), (0, 0, 0, pad))
    _, row_src, part_src = _tile_sources(entry, cfg.tile_m, cfg.tile_n)
    out = torch.full((m_rows, n_out), float("nan"), dtype=torch.float64)
    out_tile_n = kernel.out_tile_n
    n_tiles = -(-n_out // out_tile_n)
    nan = float("nan")
    for e, start, end in _segments(offs, m_rows, num_experts):
        for mt in range(math.ceil((end - start) / (cfg.rows * cfg.cluster_m))):
            for n_tile in range(n_tiles):
                for rank in range(cfg.cluster_m):
                    row0 = start + (mt * cfg.cluster_m + rank) * cfg.rows
                    rows_valid = min(end - row0, cfg.rows)
                    acc = torch.zeros(cfg.tile_m, cfg.tile_n, dtype=torch.float64)
                    if e < num_experts:
                        # the stage's token rows: TMA zero fill past M, NaN past the box
                        r = torch.arange(cfg.tile_m) + row0
                        loaded = torch.arange(cfg.tile_m) < cfg.rows
                        tile_a = torch.where((r < m_rows).unsqueeze(1),
                                             a[r.clamp(max=m_rows - 1)], 0.0)
                        tile_a[~loaded] = nan
                        cols = torch.tensor([kernel.weight_column(c, n_tile, n_out)
                                             for c in range(cfg.tile_n)])
                        tile_b = torch.where(cols < n, b[e][:, cols.clamp(max=n - 1)], 0.0)
                        for kb in range(kb_count):
                            ks = slice(kb * 128, (kb + 1) * 128)
                            part = tile_a[:, ks] @ tile_b[ks]
                            if recipe == "blockwise":
                                # the stage's scale column: the box from the aligned
                                # start (zero past M), NaN past it; read shifted
                                box = (kernel.sfa_box_start(row0)
                                       + torch.arange(kernel.sfa_box_rows))
                                stage = torch.full((kernel.sfa_stage_words,), nan,
                                                   dtype=torch.float64)
                                stage[:len(box)] = torch.where(
                                    box < m_rows, sfa[box.clamp(max=m_rows - 1), kb].double(),
                                    0.0)
                                blocks = torch.tensor(
                                    [kernel.scale_block_row(n_tile, p, n_out) // 128
                                     for p in range(kernel.scale_parts)])
                                sa = stage[row_src + kernel.sfa_row_shift(row0)]
                                part = part * sa * sfb[e, blocks, kb].double()[part_src]
                            acc += part
                        if recipe == "rowwise":
                            rows = (row0 + row_src).clamp(max=m_rows - 1)
                            acc *= sfa[rows].double() * sfb[e, cols.clamp(max=n - 1)].double()
                        elif recipe == "tensorwise":
                            acc *= float(sfa[0]) * float(sfb[e])
                        # a warpgroup whose rows are all past the expert's end skips
                        for wg in range(cfg.mma_warpgroups):
                            if rows_valid <= 64 * wg:
                                acc[64 * wg:64 * (wg + 1)] = 0.0
                    if kernel.scale_parts == 2:  # SwiGLU: gate columns, then up
                        acc = _silu(acc[:, :out_tile_n]) * acc[:, out_tile_n:]
                    for mi in range(max(rows_valid, 0)):
                        c0 = n_tile * out_tile_n
                        width = min(out_tile_n, n_out - c0)
                        out[row0 + mi, c0:c0 + width] = acc[mi, :width]
    return out


def reference(recipe, a, b, sfa, sfb, offs, swiglu):
    """float64 dequantize-then-multiply: rows of expert e times b[e], zeros past the
    last expert (``sfa`` (M, KB) / (M,) / (1,), ``sfb`` (E, NB, KB) / (E, N) / (E,))."""
    m_rows, k = a.shape
    num_experts, _, n = b.shape
    a = a.double()
    b = b.double()
    if recipe == "blockwise":
        a = a * sfa.double().repeat_interleave(128, 1)[:, :k]
        b = b * sfb.double().repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[
            :, :, :k].transpose(1, 2)
    elif recipe == "rowwise":
        a = a * sfa.double().unsqueeze(1)
        b = b * sfb.double().unsqueeze(1)
    else:
        a = a * float(sfa[0])
        b = b * sfb.double().view(-1, 1, 1)
    out = torch.zeros(m_rows, n, dtype=torch.float64)
    for e, start, end in _segments(offs, m_rows, num_experts):
        if e < num_experts and end > start:
            out[start:end] = a[start:end] @ b[e]
    if swiglu:
        out = _silu(out[:, :n // 2]) * out[:, n // 2:]
    return out


def _quantized(shape, gen):
    return (torch.randn(shape, generator=gen) * 3).to(torch.float8_e4m3fn)


def _scales(recipe, m_rows, k, num_experts, n, gen):
    kb, nb = -(-k // 128), -(-n // 128)
    if recipe == "blockwise":
        return (torch.rand(m_rows, kb, generator=gen) + 0.5,
                torch.rand(num_experts, nb, kb, generator=gen) + 0.5)
    if recipe == "rowwise":
        return (torch.rand(m_rows, generator=gen) + 0.5,
                torch.rand(num_experts, n, generator=gen) + 0.5)
    return torch.rand(1, generator=gen) + 0.5, torch.rand(num_experts, generator=gen) + 0.5


def _check(kernel, entry, recipe, a, b, sfa, sfb, offs, swiglu, expected=None):
    n_out = b.shape[2] // 2 if swiglu else b.shape[2]
    got = emulate(kernel, entry, recipe, a, b, sfa, sfb, offs, n_out)
    if expected is None:
        expected = reference(recipe, a, b, sfa, sfb, offs, swiglu)
    assert not got.isnan().any(), "every output element written, none from an unloaded row"
    scale = expected.abs().amax(1, keepdim=True).clamp(min=1e-30)
    assert float(((got - expected).abs() / scale).max()) < 1e-9
    return got


@pytest.mark.parametrize("name", CONFIG_NAMES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("swiglu", [False, True])
def test_emulated_kernel_matches_reference(maps, name, recipe, swiglu):
    """Ragged, unaligned experts (one empty, one over several tiles), rows past offs[-1],
    tails in N (plain) and K (rowwise, tensorwise; blockwise K is a multiple of 128)."""
    gen = torch.Generator().manual_seed(7)
    kernel = _kernel(name, swiglu, recipe)
    m_rows, k = 211, (256 if recipe == "blockwise" else 272)
    n = 256 if swiglu else 200
    num_experts = 4
    a, b = _quantized((m_rows, k), gen), _quantized((num_experts, k, n), gen)
    sfa, sfb = _scales(recipe, m_rows, k, num_experts, n, gen)
    offs = torch.tensor([5, 5, 77, 199], dtype=torch.int32)
    _check(kernel, _entry(maps, name, swiglu), recipe, a, b, sfa, sfb, offs, swiglu)


@pytest.mark.parametrize("name", ["fp8_decode16", "fp8_mid", "fp8_prefill_c2"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_emulated_kernel_with_a_index(maps, name, recipe):
    """``a_index`` through the launch glue's gather (rows and scales; out-of-range
    indices give zero rows), blockwise scales landing in the kernel's fast layout."""
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_launch as L

    gen = torch.Generator().manual_seed(11)
    kernel = _kernel(name, False, recipe)
    m_rows, k, n, num_experts = 60, 256, 136, 3
    a, b = _quantized((m_rows, k), gen), _quantized((num_experts, k, n), gen)
    sfa, sfb = _scales(recipe, m_rows, k, num_experts, n, gen)
    index = torch.randint(-5, m_rows + 5, (150,), generator=gen)
    index[:3] = torch.tensor([-1, m_rows, 0])
    offs = torch.tensor([40, 41, 140], dtype=torch.int32)
    rows, scales = L._gather(a, sfa, index, recipe)
    if recipe == "blockwise":
        assert scales.stride(0) == 1 and scales.stride(1) % 4 == 0
        assert scales.stride(1) >= index.shape[0]
    valid = (index >= 0) & (index < m_rows)
    ref_a = torch.where(valid.unsqueeze(1), a.double()[index.clamp(0, m_rows - 1)], 0.0)
    ref_sfa = sfa if recipe == "tensorwise" else torch.where(
        valid.view(-1, *([1] * (sfa.dim() - 1))), sfa[index.clamp(0, m_rows - 1)], 0.0)
    expected = reference(recipe, ref_a, b, ref_sfa, sfb, offs, False)
    _check(kernel, _entry(maps, name, False), recipe, rows, b, scales, sfb, offs, False, expected)


def test_a_wrong_row_map_is_caught(maps):
    """The emulation discriminates: a map that gives each element the other row's
    activation scale fails against the reference."""
    gen = torch.Generator().manual_seed(3)
    kernel = _kernel("fp8_mid", False)
    entry = dict(_entry(maps, "fp8_mid", False))
    entry["row_slot"] = [1 - s for s in entry["row_slot"]]
    a, b = _quantized((100, 256), gen), _quantized((2, 256, 128), gen)
    sfa, sfb = _scales("blockwise", 100, 256, 2, 128, gen)
    offs = torch.tensor([30, 100], dtype=torch.int32)
    with pytest.raises(AssertionError):
        _check(kernel, entry, "blockwise", a, b, sfa, sfb, offs, False)


def test_fast_scale_a_layout():
    """The blockwise activation scales the kernel reads: M-major, 16-byte column stride
    and start; kept as is when so, re-strided otherwise (values unchanged)."""
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_launch as L

    row_major = torch.rand(10, 3)
    fast = L.fast_scale_a(row_major)
    assert fast.stride() == (1, 12) and torch.equal(fast, row_major)
    assert L.fast_scale_a(fast) is fast
    odd = torch.rand(3, 11)[:, :10].t()  # M-major, column stride 11
    assert L.fast_scale_a(odd).stride() == (1, 12)
