"""Scaled number formats as data: one descriptor per operand format, read by the op layer
(``ts_moe.fp8.recipes``: parsing, checks, references, the dequantize fallback) and by the
kernels (their scale layouts), so that adding a format is a descriptor plus its kernels.

A :class:`ScaleFormat` says what one operand ``(..., R, C)`` holds: its elements' type
and largest finite value, its scales' type, the block of elements one scale covers
(``None``: the whole dimension) and how a fresh scale tensor is laid out (``contiguous``,
or ``m_major``: the rows contiguous, their count padded to ``row_align``, so that one
column block's scales of a tile of rows are one TMA box).  Scales are dequantization
multipliers: real ~ element x scale.  Importing this module imports no DSL.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ScaleFormat:
    """One operand's scaled format (module docstring)."""

    name: str
    element: str  # torch dtype name of the elements
    element_max: float  # their largest finite magnitude
    scale: str  # torch dtype name of the scales
    block: tuple  # (rows, columns) one scale covers; None: the whole dimension
    layout: str = "contiguous"  # or "m_major"
    row_align: int = 1  # m_major: the scale's row count padded to a multiple of this

    @property
    def power_of_two(self) -> bool:
        """Scales that are powers of two (an exponent alone, e8m0)."""
        return self.scale == "float8_e8m0fnu"

    def scale_shape(self, shape) -> tuple:
        """The scale's shape over an operand of ``shape`` (..., R, C)."""
        *lead, rows, cols = shape
        br, bc = self.block
        return (*lead, *(() if br is None else (-(-rows // br),)),
                *(() if bc is None else (-(-cols // bc),)))

    def scale_strides(self, shape) -> tuple:
        """The strides of a fresh scale over an operand of ``shape``: contiguous, or
        m_major (stride 1 on the rows, the rows padded to ``row_align``: the transpose of
        a contiguous (..., blocks, R padded) tensor)."""
        sshape = self.scale_shape(shape)
        if self.layout == "m_major":
            *lead, rows, blocks = sshape
            padded = self.padded_rows(rows)
            inner, step = (1, padded), padded * blocks
        else:
            lead, inner, step = sshape, (), 1
        outer = []
        for size in reversed(lead):
            outer.insert(0, step)
            step *= size
        return (*outer, *inner)

    def padded_rows(self, rows: int) -> int:
        """An m_major scale's row count: ``rows`` rounded up to ``row_align``."""
        return -(-rows // self.row_align) * self.row_align


E4M3, E4M3_MAX = "float8_e4m3fn", 448.0
FORMATS = {f.name: f for f in (
    ScaleFormat("tensorwise", E4M3, E4M3_MAX, "float32", (None, None)),
    ScaleFormat("rowwise", E4M3, E4M3_MAX, "float32", (1, None)),
    # activations per token per 128 channels (DeepSeek-V3), M-major for the GEMM's TMA box
    # (16-byte columns: four fp32 scales)
    ScaleFormat("blockwise_1x128", E4M3, E4M3_MAX, "float32", (1, 128), "m_major", 4),
    # weights per 128 x 128 block: the checkpoints' weight_scale_inv
    ScaleFormat("blockwise_128x128", E4M3, E4M3_MAX, "float32", (128, 128)),
    # MXFP8 (OCP Microscaling v1.0): e4m3 elements, an e8m0 scale per 32 along K
    ScaleFormat("mx_1x32", E4M3, E4M3_MAX, "float8_e8m0fnu", (1, 32)),
)}
"""Every format, by name (the name of its ``ts_moe.fp8.recipes.Recipe``)."""
