"""``wgmma-descriptor`` (:mod:`.preflight`): a ``wgmma`` (sm_90a) or ``tcgen05.mma``
(sm_100a) shared-memory matrix descriptor must describe the layout that the TMA load
writing that memory produced, or the MMA reads the right bytes in the wrong order:
wrong results, no fault.  Notes: ``bench/notes/2026-12-06-preflight-rules.md``.

A descriptor is 64 bits (PTX ISA, "Matrix Descriptor Format" for wgmma and tcgen05):
the start address >> 4 in bits 0-13, the leading-dimension byte offset >> 4 in 16-29,
the stride-dimension byte offset >> 4 in 32-45, the base offset in 49-51, and the
swizzle mode (sm_90: bits 62-63, 1 = 128B, 2 = 64B, 3 = 32B; sm_100: bits 61-63,
2 = 128B, 4 = 64B, 6 = 32B, with bits 46-48 fixed at 0b001).  The descriptor is
evaluated symbolically (:mod:`.addr`): its constant part holds the fields
and the start's offset from the shared symbol.  The TMA load whose box region holds
that offset wrote the operand; then:

- the swizzle mode is the one the TMA's shared layout used (its ``Swizzle<B,4,3>``:
  B = 3, 2, 1 is 128, 64, 32 bytes);
- a TMA writes its box densely, a row of ``box[0]`` elements after another, so 8 rows
  (the core matrices' group, one swizzle pattern) are ``8 x box[0] x element bytes``
  apart: the stride byte offset;
- for a ``wgmma`` operand stored MN-major (its transpose immediate) that spans more
  than one swizzle atom along M/N, the leading byte offset steps from one atom to the
  next, which the TMA writes as its next box: the box's bytes.  K-major swizzled
  operands do not use it, nor does one atom; a ``tcgen05.mma``'s shape and majorness
  are in its run-time instruction descriptor, so its leading offset is not checked.
"""

_SWIZZLE_SM90 = {3: 1, 2: 2, 1: 3, 0: 0}    # Swizzle<B,4,3> -> descriptor mode
_SWIZZLE_SM100 = {3: 2, 2: 4, 1: 6, 0: 0}
_FIELD = 0x3FFF


def _fields(value: int, sm100: bool) -> dict:
    return {"start": (value & _FIELD) * 16, "lbo": (value >> 16 & _FIELD) * 16,
            "sbo": (value >> 32 & _FIELD) * 16, "base": value >> 49 & 7,
            "swizzle": value >> 61 & 7 if sm100 else value >> 62 & 3,
            "fixed": value >> 46 & 7}


def _operands(ins):
    """``[(descriptor register, "a"/"b", MN-major: True/False/None)]`` of an MMA."""
    a = ins.args
    if ins.op.startswith("wgmma.mma_async"):
        fp8 = ".e4m3" in ins.op or ".e5m2" in ins.op
        rs = a[1].startswith("{")
        trans = [x.strip() for x in a[3:]]
        if fp8:
            majors = (False, False)
        elif len(trans) < 2:
            majors = (None, None)
        elif rs:
            majors = (None, trans[-1] == "1")
        else:
            majors = (trans[-2] == "1", trans[-1] == "1")
        found = [] if rs else [(a[1].strip(), "A", majors[0])]
        return found + [(a[2].strip(), "B", majors[1])]
    if ins.op.startswith("tcgen05.mma"):
        found = [] if a[1].startswith("[") else [(a[1].strip(), "A", None)]
        return found + [(a[2].strip(), "B", None)]
    return []


def _tma_regions(pf) -> list:
    """``[(symbol, lo, hi, map)]`` of the TMA loads' shared-memory boxes."""
    from .bulk import box_region

    found = []
    for ins, _ in pf.tma_sites():
        if ".global.shared" in ins.op:
            continue
        tmap = pf.tensor_map(ins)
        region = box_region(pf, ins, tmap) if tmap is not None else None
        if isinstance(region, tuple):
            found.append((region[0], region[1], region[2] + region[3], tmap))
    return found


def check_descriptors(pf) -> None:
    mmas = [ins for ins in pf.k.instrs if ins.op.startswith(("wgmma.mma_async",
                                                             "tcgen05.mma"))]
    if not mmas:
        return
    regions = _tma_regions(pf)
    seen = set()
    for ins in mmas:
        sm100 = ins.op.startswith("tcgen05")
        for reg, which, mn_major in _operands(ins):
            if (reg, which) in seen:
                continue
            seen.add((reg, which))
            _check_one(pf, ins, reg, which, mn_major, sm100, regions)


def _check_one(pf, ins, reg, which, mn_major, sm100, regions) -> None:
    sym = pf.addrs.value(reg)
    symbols = sym.symbols()
    if len(symbols) != 1 or sym.const.denominator != 1:
        return  # not a TMA-written tile this reader can follow (e.g. thread-written)
    name, coef = symbols[0]
    if coef != sym.const.__class__(1, 16):
        return
    fields = _fields(int(sym.const), sm100)
    start = fields["start"]
    if sm100 and fields["fixed"] != 1:
        pf.fail("wgmma-descriptor", ins, f"{which} descriptor bits 46-48 are "
                                         f"{fields['fixed']:#05b}, not the fixed 0b001")
    writers = [(lo, hi, m) for sym_name, lo, hi, m in regions
               if sym_name == name and lo <= start < hi]
    if not writers:
        return
    tmap = writers[0][2]
    want = (_SWIZZLE_SM100 if sm100 else _SWIZZLE_SM90).get(tmap.swizzle_bits)
    if fields["swizzle"] != want:
        pf.fail("wgmma-descriptor", ins, f"{which} descriptor swizzle mode "
                                         f"{fields['swizzle']}, but the TMA wrote the tile "
                                         f"with a {16 << tmap.swizzle_bits if tmap.swizzle_bits else 0}"
                                         f"-byte swizzle (mode {want})")
    if not tmap.swizzle_bits:
        return  # the interleaved layout's offsets are not the swizzle's
    row = tmap.box[0] * tmap.element_bytes
    if fields["sbo"] != 8 * row:
        pf.fail("wgmma-descriptor", ins, f"{which} descriptor stride byte offset "
                                         f"{fields['sbo']}, but the TMA's rows are {row} "
                                         f"bytes apart: 8 rows are {8 * row}")
    if fields["base"]:
        pf.fail("wgmma-descriptor", ins, f"{which} descriptor base offset {fields['base']}"
                                         f" with a pattern-aligned tile")
    extent = _mn_bytes(ins, which)
    if mn_major and extent and extent > 16 << tmap.swizzle_bits \
            and fields["lbo"] != tmap.box_bytes:
        pf.fail("wgmma-descriptor", ins, f"{which} descriptor leading byte offset "
                                         f"{fields['lbo']}, but the TMA writes the next "
                                         f"swizzle atom along M/N {tmap.box_bytes} bytes on")


def _mn_bytes(ins, which: str):
    """The bytes a wgmma operand spans along M (A: 64 rows) or N (its shape's n), or
    None (tcgen05.mma: the shape is in a run-time instruction descriptor)."""
    import re

    m = re.search(r"\.m(\d+)n(\d+)k\d+\.\w+\.(\w+)\.", ins.op)
    if not ins.op.startswith("wgmma") or m is None:
        return None
    size = {"bf16": 2, "f16": 2, "tf32": 4, "e4m3": 1, "e5m2": 1}.get(m.group(3))
    return None if size is None else int(m.group(1 if which == "A" else 2)) * size

