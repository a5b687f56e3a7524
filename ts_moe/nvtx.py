"""NVTX ranges in the ``ts_moe`` domain, for Nsight Systems (the layer's stages,
the benchmark's cases): one domain for every range ts_moe and its harness open."""

import contextlib
import functools

import torch

try:
    import nvtx
except ImportError:  # the ranges are optional
    nvtx = None

NVTX_DOMAIN = "ts_moe"


@functools.cache
def _annotation(name: str):
    return nvtx.annotate(name, domain=NVTX_DOMAIN)


def nvtx_range(name: str):
    """Context manager: an NVTX range ``name`` in the ``ts_moe`` domain.

    A no-op without the ``nvtx`` package and while ``torch.compile`` traces (a
    host-side range inside a compiled graph would break ``fullgraph=True``).
    One annotation object per name, made once (the layer opens four ranges a
    call); it may be entered again while open (nested ranges of one name).
    """
    if nvtx is None or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _annotation(name)
