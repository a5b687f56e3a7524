"""The TMA rules (:mod:`.preflight`): where a box starts in global memory, what its
tensor map says, and where it lands in shared memory.  Notes:
``bench/notes/2026-12-05-preflight.md``, ``bench/notes/2026-12-06-preflight-rules.md``.

- ``tma-coordinate``: every ``cp.async.bulk.tensor`` load and store starts its box at a
  global address that is a provable multiple of 16 bytes: its innermost coordinate
  times the element size (:meth:`~.ptx.Kernel.alignment`; unproven fails);
- ``tensor-map``: each map's parameters (:class:`~.trace.TmaMap`): global
  address and strides 16-byte multiples, innermost stride 1, box dims 1..256, inner box
  bytes a multiple of 16 and within the swizzle span, rank 1..5 (CUDA driver API,
  ``cuTensorMapEncodeTiled``: CuTeDSL packs the map itself and never calls it);
- ``tma-smem``: the shared-memory box is aligned to 128 bytes, or to its swizzle
  pattern's repeat (1024 bytes for 128B), and lies inside the allocation
  (:func:`~.bulk.check_bounds`).
"""

import re


def check_tma(pf) -> None:
    for ins, _ in pf.tma_sites():
        tmap = pf.tensor_map(ins)
        if tmap is None:
            pf.fail("tma-coordinate", ins, "its tensor map cannot be tied to a TMA atom of "
                                           "the build")
            continue
        store = ".global.shared" in ins.op
        operand = ins.args[0] if store else ins.args[1]
        coords = re.search(r"\{([^}]*)\}", operand)
        inner = coords.group(1).split(",")[0].strip() if coords else ""
        k = pf.aligned_to(inner)
        need = max(16 // tmap.element_bytes, 1)
        if (1 << min(k, 30)) % need:
            pf.fail("tma-coordinate", ins,
                    f"the box's innermost coordinate {inner} is not provably a multiple of "
                    f"{need} {tmap.dtype} elements (16 bytes): its start address may be "
                    f"misaligned (proven: a multiple of {1 << min(k, 30)})")
        smem = ins.args[1] if store else ins.args[0]
        repeat = 8 << (tmap.swizzle_bits + 4) if tmap.swizzle_bits else 128
        if (1 << min(pf.aligned_to(smem), 30)) % repeat:
            pf.fail("tma-smem", ins, f"the shared-memory box {smem} is not provably "
                                     f"{repeat}-byte aligned")


def check_maps(pf) -> None:
    for i, m in enumerate(pf.facts.maps):
        where = f"TMA atom {i} ({m.kind}, {m.dtype}, box {m.box})"
        eb = m.element_bytes
        inner = m.box[0] * eb
        problems = []
        if not 1 <= len(m.box) <= 5:
            problems.append(f"rank {len(m.box)} outside 1..5")
        if any(not 1 <= b <= 256 for b in m.box):
            problems.append(f"a box dimension outside 1..256: {m.box}")
        if inner % 16:
            problems.append(f"inner box bytes {inner} not a multiple of 16")
        if m.swizzle_bits and inner > 16 << m.swizzle_bits:
            problems.append(f"inner box bytes {inner} beyond the swizzle span "
                            f"{16 << m.swizzle_bits}")
        if m.align % 16:
            problems.append(f"global address aligned to {m.align} bytes, not 16")
        if m.strides and m.strides[0] != 1:
            problems.append(f"innermost stride {m.strides[0]}, not 1")
        for d, s in enumerate(m.strides[1:], start=1):
            step = s[1] if isinstance(s, tuple) else s
            if (step * eb) % 16 or (not isinstance(s, tuple) and s * eb >= 1 << 40):
                problems.append(f"stride of dimension {d} ({s} elements) not a 16-byte "
                                f"multiple below 2**40")
        for p in problems:
            pf.fail("tensor-map", where, p)
