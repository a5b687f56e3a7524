"""What a kernel build's PTX does not say, recorded while the DSL traces it: the TMA
tensor maps (their element type, box, swizzle, global layout, multicast) and the shared
memory the kernel allocates.

CuTeDSL packs each 128-byte tensor map in its own host code and never calls
``cuTensorMapEncodeTiled``, so nothing checks a map's parameters before a GPU runs it;
and the dynamic shared-memory size is resolved by a compiler pass, after the PTX's
``.extern .shared`` array is declared without one.  :func:`recording` watches the two DSL
entry points every kernel goes through (the ``cute_nvgpu`` ops that make a non-executable
TMA atom, and :class:`cutlass.memory.SmemAllocator`'s one allocation primitive) and keeps
their arguments as plain data (:class:`TmaMap`, :class:`BuildFacts`) for
:mod:`csrc_free_kernels.preflight.rules`.

The DSL's types are read from their printed form (``!cute.memref<f32, gmem, align<16>,
"(?,?):(1,?{i64 div=4})">``, ``tma_gbasis = <"(16,1):(1@0,1@1)">``): a release that
prints them differently fails :func:`parse_atom` loudly rather than passing a check.
"""

import contextlib
import dataclasses
import json
import re

# element widths in bits of the DSL's printed element types
ELEMENT_BITS = {"bf16": 16, "f16": 16, "f32": 32, "f64": 64, "i8": 8, "i16": 16, "i32": 32,
                "i64": 64, "f8E4M3FN": 8, "f8E5M2": 8, "ui8": 8, "i1": 8}


@dataclasses.dataclass(frozen=True)
class TmaMap:
    """One TMA tensor map as the DSL will encode it.

    ``box``: the box's extents in the map's dimension order (innermost first);
    ``strides``: the global stride of each of those dimensions in elements, an int when
    static or ``("div", d)`` when dynamic and known to be a multiple of ``d``; ``align``:
    the global base address's assumed alignment in bytes; ``swizzle_bits``: the shared
    layout's swizzle ``B`` (0: none; the span is ``16 << B`` bytes); ``copy_bits``: the
    bits one box moves; ``multicast``: the CTAs one load is multicast to."""

    kind: str          # "load", "store" or "reduce"
    dtype: str
    element_bits: int
    box: tuple
    strides: tuple
    align: int
    swizzle_bits: int
    copy_bits: int
    multicast: int

    @property
    def element_bytes(self) -> int:
        return max(self.element_bits // 8, 1)

    @property
    def box_bytes(self) -> int:
        return self.copy_bits // 8


@dataclasses.dataclass
class BuildFacts:
    """A build's TMA maps in the order the DSL made them; ``map_params``: for each
    tensor-map parameter of the kernel, in parameter order, the index of its map (an
    atom passed twice is two parameters); its shared-memory bytes; from the cubin the
    DSL produced, the registers per thread and the stack frame (0: no local memory);
    from the launch, the cluster shape (x, y, z) and the printed types of the kernel's
    operands in order (a tensor's address alignment and strides' divisibility); the
    shared-memory allocations (each field of an allocated struct) as ``[start, end)``
    byte ranges; ``pdl_early_reads``, whether the kernel declared global reads before
    its ``griddepcontrol.wait`` (:func:`declare_pdl_early_reads`); and ``turn_groups``,
    ``[first_thread, threads, groups]`` where the kernel declared that those threads
    form ``groups`` equal groups taking turns (:func:`declare_turn_groups`).  None: not
    recorded, which the pre-flight reports wherever a rule needs it."""

    maps: list = dataclasses.field(default_factory=list)
    map_params: list = dataclasses.field(default_factory=list)
    smem_bytes: int = 0
    registers: int | None = None
    frame_bytes: int | None = None
    cluster: list | None = None
    operands: list | None = None
    smem_regions: list | None = None
    pdl_early_reads: bool | None = None
    turn_groups: list | None = None

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self),
                           "maps": [dataclasses.asdict(m) for m in self.maps]})

    @staticmethod
    def from_json(text: str) -> "BuildFacts":
        raw = json.loads(text)
        raw["maps"] = [TmaMap(**{k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
                                 if isinstance(v, list) else v for k, v in m.items()})
                       for m in raw["maps"]]  # JSON lists back to the tuples they were
        return BuildFacts(**raw)


_MEMREF = re.compile(r'!cute\.memref<(\w+), gmem, (?:align<(\d+)>, )?"(.*)">')
_ATOM = re.compile(r'<(?:sm_\w+, )?(\w+), copy_bits = (\d+), tma_gbasis = <"(.*?)">')
_SWIZZLE = re.compile(r"S<(\d+),(\d+),(\d+)>")


def _split_top(text: str) -> list:
    """``"(a,(b,c),d)"`` -> ``["a", "(b,c)", "d"]``; a bare item -> ``[item]``."""
    if not (text.startswith("(") and text.endswith(")")):
        return [text]
    items, depth, start = [], 0, 1
    for i, ch in enumerate(text[1:-1], start=1):
        if ch in "({":
            depth += 1
        elif ch in ")}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:-1])
    return items


def _stride(text: str):
    """One printed stride: ``"1"`` -> 1, ``"?{i64 div=8}"`` -> ("div", 8), ``"?"`` ->
    ("div", 1)."""
    if text.lstrip("-").isdigit():
        return int(text)
    m = re.fullmatch(r"\?(?:\{(?:i\d+ )?div=(\d+)\})?", text)
    if m is None:
        raise ValueError(f"unreadable stride {text!r}")
    return ("div", int(m.group(1) or 1))


def leaves(text: str, path=()) -> dict:
    """A printed (nested) tuple's leaves by their mode path: ``"((a,b),c)"`` ->
    ``{(0, 0): "a", (0, 1): "b", (1,): "c"}``."""
    items = _split_top(text)
    if len(items) == 1 and items[0] == text:
        return {path: text}
    found = {}
    for i, item in enumerate(items):
        found.update(leaves(item, (*path, i)))
    return found


def _basis_path(text: str) -> tuple:
    """The global mode a TMA basis element walks: ``"1@1@0"`` -> (0, 1) (the printed
    indices run from the innermost mode out)."""
    m = re.fullmatch(r"1((?:@\d+)+)", text.strip("()"))
    if m is None:
        raise ValueError(f"unreadable TMA basis element {text!r}")
    return tuple(int(i) for i in reversed(m.group(1).strip("@").split("@")))


def parse_atom(kind: str, gmem_type: str, atom_type: str, smem: str,
               multicast: int) -> TmaMap:
    """A :class:`TmaMap` from the printed types of one ``atom_make_non_exec_*`` call."""
    mem = _MEMREF.fullmatch(gmem_type)
    atom = _ATOM.search(atom_type)
    if mem is None or atom is None:
        raise ValueError(f"unreadable TMA atom: {gmem_type} / {atom_type}")
    dtype, align, layout = mem.group(1), int(mem.group(2) or 1), mem.group(3)
    if dtype not in ELEMENT_BITS:
        raise ValueError(f"unknown element type {dtype!r} in {gmem_type}")
    gshape, gstride = layout.split(":")
    strides = {path: _stride(s) for path, s in leaves(gstride).items()}
    if strides.keys() != leaves(gshape).keys():
        raise ValueError(f"unreadable global layout {layout!r}")
    bshape, bbasis = atom.group(3).split(":")
    box = tuple(int(v) for v in leaves(bshape).values())
    dims = [_basis_path(b) for b in leaves(bbasis).values()]
    if len(dims) != len(box) or any(d not in strides for d in dims):
        raise ValueError(f"TMA basis {atom.group(3)!r} does not fit the layout {layout!r}")
    sw = _SWIZZLE.search(smem)
    return TmaMap(kind, dtype, ELEMENT_BITS[dtype], box, tuple(strides[d] for d in dims),
                  align, int(sw.group(1)) if sw else 0, int(atom.group(2)),
                  int(multicast or 1))


_ATOM_OPS = {"atom_make_non_exec_tiled_tma_load": "load",
             "atom_make_non_exec_tiled_tma_store": "store",
             "atom_make_non_exec_tiled_tma_reduce": "reduce"}


_RECORDING: list = []  # the facts of the builds being traced, innermost last


def declare_pdl_early_reads() -> None:
    """Called by a kernel while it traces: this build reads global memory before its
    ``griddepcontrol.wait`` on purpose (data the kernel ahead does not write), which the
    ``pdl-order`` rule then allows for L2 and TMA loads.  Outside :func:`recording`, nothing."""
    if _RECORDING:
        _RECORDING[-1].pdl_early_reads = True


def declare_turn_groups(first_thread: int, threads: int, groups: int) -> None:
    """Called by a kernel while it traces: threads ``first_thread .. + threads`` of each
    CTA are ``groups`` equal groups that take turns through one traced body (ping-pong
    MMA warpgroups), so each phase of a barrier they arrive on gets the arrivals of one
    group: the ``mbarrier-init`` rule then counts their arrivals once a group.
    Outside :func:`recording`, nothing."""
    if _RECORDING:
        _RECORDING[-1].turn_groups = [first_thread, threads, groups]


@contextlib.contextmanager
def recording():
    """Within it, every TMA atom and shared-memory allocation the DSL makes, and the
    tensor maps the kernel launch passes, are added to the yielded :class:`BuildFacts`
    (one kernel build at a time)."""
    import cutlass._mlir.dialects.cute_nvgpu as nvgpu_ir
    import cutlass.cute as cute
    from cutlass.cutlass_dsl.cutlass import CutlassBaseDSL
    from cutlass.memory import smem

    facts = BuildFacts(pdl_early_reads=False)
    saved = {name: getattr(nvgpu_ir, name) for name in _ATOM_OPS}
    atoms = []  # the atoms' IR values, in the order of facts.maps

    def watch(name, make):
        def wrapped(gmem_tensor, smem_layout, cta_v_map, *args, **kwargs):
            res = make(gmem_tensor, smem_layout, cta_v_map, *args, **kwargs)
            atoms.append(res[0])
            smem_text = str(getattr(smem_layout, "type", smem_layout))
            facts.maps.append(parse_atom(_ATOM_OPS[name], str(gmem_tensor.type),
                                         str(res[0].type), smem_text,
                                         kwargs.get("num_multicast") or 1))
            return res
        return wrapped

    alloca = smem.SmemAllocator._smem_alloca

    def counted_alloca(self, layout, dtype, byte_alignment, *args, **kwargs):
        align = max(byte_alignment, dtype.width // 8)
        start = -(-facts.smem_bytes // align) * align
        facts.smem_bytes = start + cute.cosize(layout) * max(dtype.width // 8, 1)
        fields = kwargs.get("struct_fields") or [("", facts.smem_bytes - start, 0)]
        facts.smem_regions = (facts.smem_regions or []) + [
            [start + offset, start + offset + size] for _, size, offset in fields]
        return alloca(self, layout, dtype, byte_alignment, *args, **kwargs)

    launch = CutlassBaseDSL.cuda_launch_func

    def recorded_launch(*args, **kwargs):
        operands = next((a for a in args if isinstance(a, (list, tuple)) and any(
            str(getattr(v, "type", "")).startswith(_ATOM_TYPE) for v in a)), [])
        facts.map_params = [next(i for i, v in enumerate(atoms) if v == op)
                            for op in operands
                            if str(getattr(op, "type", "")).startswith(_ATOM_TYPE)]
        kernel_operands = args[8] if len(args) > 8 else kwargs.get("kernel_operands", [])
        facts.operands = [str(getattr(v, "type", "")) for v in kernel_operands]
        dims = [kwargs.get(f"cluster_size_{d}") for d in "xyz"]
        facts.cluster = [1 if v is None else v if isinstance(v, int) else None
                         for v in dims]
        if None in facts.cluster:  # a dynamic cluster shape: not known here
            facts.cluster = None
        return launch(*args, **kwargs)

    for name, make in saved.items():
        setattr(nvgpu_ir, name, watch(name, make))
    smem.SmemAllocator._smem_alloca = counted_alloca
    CutlassBaseDSL.cuda_launch_func = staticmethod(recorded_launch)
    _RECORDING.append(facts)
    try:
        yield facts
    finally:
        _RECORDING.remove(facts)
        for name, make in saved.items():
            setattr(nvgpu_ir, name, make)
        smem.SmemAllocator._smem_alloca = alloca
        CutlassBaseDSL.cuda_launch_func = staticmethod(launch)


_ATOM_TYPE = "!cute_nvgpu.atom.non_exec_tiled_tma_"
# .nv.info attributes (EIATTR_*) of a cubin: a kernel's registers, its stack frame
_REGCOUNT, _FRAME_SIZE = 0x2F, 0x11


def cubin_facts(cubin: bytes) -> dict:
    """``{"registers": n, "frame_bytes": n}`` of the one kernel in a cubin (ELF64), from
    its ``.nv.info`` attributes: what ``ptxas -v`` reports, without ptxas."""
    import struct

    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
                for i in range(shnum)]
    names = sections[shstrndx][4]
    found = {}
    for sec in sections:
        if cubin[names + sec[0]:cubin.index(b"\0", names + sec[0])] != b".nv.info":
            continue
        data, i = cubin[sec[4]:sec[4] + sec[5]], 0
        while i + 2 <= len(data):
            fmt, attr = data[i], data[i + 1]
            if fmt == 0x04:  # EIFMT_SVAL: a u16 size, then the value
                size = struct.unpack_from("<H", data, i + 2)[0]
                if attr in (_REGCOUNT, _FRAME_SIZE) and size == 8:
                    found["registers" if attr == _REGCOUNT else "frame_bytes"] = \
                        struct.unpack_from("<II", data, i + 4)[1]
                i += 4 + size
            else:  # EIFMT_HVAL: a u16 value; EIFMT_NVAL: none
                i += 4 if fmt == 0x03 else 2
    return found


def collect(dump_dir, facts: BuildFacts) -> str:
    """The PTX of the build just compiled with ``CUTE_DSL_KEEP=ptx,cubin`` into
    ``dump_dir`` (the newest files: the DSL names them after the host function, so
    builds of one class overwrite each other's), with the cubin's facts added to
    ``facts``; both files are removed."""
    import pathlib

    newest = {ext: max(pathlib.Path(dump_dir).glob(f"*.{ext}"),
                       key=lambda p: p.stat().st_mtime_ns) for ext in ("ptx", "cubin")}
    for key, value in cubin_facts(newest["cubin"].read_bytes()).items():
        setattr(facts, key, value)
    text = newest["ptx"].read_text()
    for path in newest.values():
        path.unlink()
    return text
