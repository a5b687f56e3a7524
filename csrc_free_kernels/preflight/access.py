"""Ordinary (non-TMA) loads and stores (:mod:`.preflight`): alignment and shared-memory
bounds.

- ``access-align``: every ``ld``/``st``/``atom``/``red`` on shared memory, and every
  vector one (``.v2``, ``.v4``) on global memory, has an address that is a multiple of the
  bytes it moves (PTX ISA, "Vectors" and the ld/st state spaces: an access must be
  naturally aligned, a vector to its whole size; a misaligned one faults with a
  misaligned address).  The address's alignment is the dataflow's
  (:meth:`~.ptx.Kernel.alignment`): shared symbols by their declared alignment, global
  tensors by what the launch promises of their base and strides (global accesses are
  checked where the launch's operand types were recorded, as in every build since
  ``BuildFacts.operands``).  A global scalar's alignment is its element's, which the
  tensor's type gives; it is not re-checked.
- ``smem-bounds``: a shared-memory access whose offset has a known range (constants,
  thread values, ring counters: :mod:`.ranges`) stays inside the shared memory it names.
  One whose offset is not known is not checked (most are: an index from data).
"""

import re

from .ranges import shared_size, sym_range

_ACCESS = re.compile(r"^(ld|st|atom|red)\.")
_VECTOR = re.compile(r"\.v(\d)\.")
_WIDTH = re.compile(r"\.[bsuf](\d+)$")


def _bytes(op: str) -> int:
    """The bytes one thread's access moves (``st.shared.v4.b32``: 16)."""
    vec = _VECTOR.search(op)
    width = _WIDTH.search(op)
    return (int(vec.group(1)) if vec else 1) * (int(width.group(1)) // 8 if width else 4)


def check_access(pf) -> None:
    promised = getattr(pf.facts, "operands", None) is not None
    for ins in pf.k.instrs:
        if not _ACCESS.match(ins.op):
            continue
        shared = ".shared" in ins.op
        if not shared and not (promised and ".global" in ins.op and _VECTOR.search(ins.op)):
            continue
        addr = next((a for a in ins.args if a.startswith("[")), None)
        if addr is None:
            continue
        size = _bytes(ins.op)
        need = size.bit_length() - 1
        if pf.aligned_to(addr) < need:
            pf.fail("access-align", ins, f"moves {size} bytes from {addr}, which is not "
                                         f"provably {size}-byte aligned")
        if shared:
            _bounds(pf, ins, addr, size)


def _bounds(pf, ins, addr, size) -> None:
    sym = pf.addrs.operand(addr)
    symbols = sym.symbols()
    if len(symbols) != 1 or symbols[0][1] != 1:
        return
    rng = sym_range(pf, sym, ins)
    limit = shared_size(pf, symbols[0][0])
    if rng is None or limit is None:
        return
    if rng[0] < 0 or rng[1] + size > limit:
        pf.fail("smem-bounds", ins, f"touches bytes [{int(rng[0])}, {int(rng[1]) + size}) "
                                    f"of {symbols[0][0]}, which has {limit}")
