"""The DSL toolchain the kernels are compiled with, and how far their GPU runs carry to it.

A kernel family's GPU status (its record, ``csrc_free_kernels.families``) holds for the code that
GPU ran: the PTX the DSL generated and the cubin the DSL's assembler made from it.  Both
depend on the ``nvidia-cutlass-dsl`` release and on its CUDA flavour: a plain install
has the cu12 compiler; ``nvidia-cutlass-dsl[cu13]``, which vLLM and SGLang install, adds
the cu13 one, which the DSL takes on a CUDA 13 driver and on a machine without a driver.

:data:`COMPARED` says, per release and flavour, which builds' PTX differs from that of
the GPU runs' toolchain (:data:`VERIFIED`), over every build of
``csrc_free_kernels.ptx_dump`` and of the probes, for sm_90a and sm_100a; CI compiles
them on the oldest supported release in both flavours and checks it
(``scripts/compare_ptx.py``).  :data:`GPU_RUNS` are the whole-suite GPU passes each
flavour's own code has had: a toolchain holds the statuses if its code ran there, or is
byte-identical to one that did.  :data:`FRAMEWORKS` are the releases ts_moe installs
beside, with the toolchain each pins (``scripts/resolve_beside.py`` checks both).
TVM-FFI does not enter the PTX.  The evidence: bench/notes/2026-12-06-dsl-4.8.0-and-cu13.md,
bench/notes/2026-12-07-cu12-gpu-pass.md.
"""

import dataclasses

EVERY_BUILD = "every build"


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """An ``nvidia-cutlass-dsl`` release and the CUDA flavour of its compiler ("cu12", "cu13")."""

    dsl: str
    flavor: str

    def __str__(self) -> str:
        return f"nvidia-cutlass-dsl {self.dsl} ({self.flavor})"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The builds whose PTX on ``toolchain`` differs from :data:`VERIFIED`'s (``()``: none,
    or :data:`EVERY_BUILD`), and why; ``same_as``, a toolchain whose every build it
    matches byte for byte (how CI checks two toolchains that both differ from VERIFIED)."""

    toolchain: Toolchain
    differs: tuple | str
    why: str
    same_as: Toolchain | None = None


@dataclasses.dataclass(frozen=True)
class GpuRun:
    """A pass of the whole GPU suite (``scripts/gpu_check.py``) on code a toolchain compiled:
    the commit of the tree, the device, the check's summary line and where it is kept."""

    commit: str
    device: str
    summary: str
    evidence: str

    def __str__(self) -> str:
        counts = self.summary.removeprefix("GPU check: ").split(" in ")[0]
        return f"the whole GPU suite, {counts}, at {self.commit[:7]} on {self.device}"


@dataclasses.dataclass(frozen=True)
class Framework:
    """A serving framework's release (``requirement``) and what it pins: the DSL (with
    the flavour it takes on a CUDA 13 driver), TVM-FFI and torch."""

    requirement: str
    dsl: Toolchain
    tvm_ffi: str
    torch: str


# the toolchain of the families' GPU runs, as ``ts-moe info`` printed it on the GPU machine
# (CUDA 13 driver, the DSL installed with its cu13 compiler): bench/notes/2026-12-06-h100-run.md
VERIFIED = Toolchain("4.8.1", "cu13")
TVM_FFI_VERIFIED = "0.1.15"  # the GPU runs' TVM-FFI, calling the compiled kernels
TVM_FFI_OLDEST = "0.1.11"
_CU12 = ("the cu12 flavour writes PTX ISA 8.8 instead of 9.4, the same instructions, and "
         "assembles it with CUDA 12's ptxas: every cubin differs")
_H100_NOTE = "bench/notes/2026-12-07-cu12-gpu-pass.md"
_H100 = "an NVIDIA H100 80GB HBM3 (driver 580.159.04)"
GPU_RUNS = {
    VERIFIED: GpuRun("38ed62d31b46a7c90aea8f28c51d6e3586798144", _H100,
                     "GPU check: 643 passed, 0 failed, 0 errors, 0 skipped in 17 files "
                     "(0 not run), 458 s", _H100_NOTE),
    Toolchain("4.8.1", "cu12"): GpuRun("38ed62d31b46a7c90aea8f28c51d6e3586798144", _H100,
                                       "GPU check: 643 passed, 0 failed, 0 errors, 0 skipped "
                                       "in 17 files (0 not run), 522 s",
                                       _H100_NOTE),
}
COMPARED = {c.toolchain: c for c in (
    Comparison(VERIFIED, (), "the toolchain of the GPU runs"),
    Comparison(Toolchain("4.8.0", "cu13"), (),
               "every build's PTX, pre-flight facts and cubin are byte-identical to 4.8.1's"),
    Comparison(Toolchain("4.8.1", "cu12"), EVERY_BUILD, _CU12),
    Comparison(Toolchain("4.8.0", "cu12"), EVERY_BUILD, _CU12,
               same_as=Toolchain("4.8.1", "cu12")),
)}
FRAMEWORKS = (
    Framework("vllm==0.33.0", Toolchain("4.8.0", "cu13"), "0.1.11", "2.14.0"),
    Framework("sglang==0.5.23", Toolchain("4.8.0", "cu13"), "0.1.11", "2.14.1"),
)


def current() -> Toolchain:
    """The toolchain this process compiles with: the DSL's release, and the flavour of
    the compiler it loaded."""
    import cutlass

    from csrc_free_kernels.common.kernel_cache import dsl_flavor

    return Toolchain(cutlass.__version__, dsl_flavor())


def verdict(toolchain: Toolchain) -> str:
    """Whether the kernel families' GPU statuses hold for code compiled on ``toolchain``:
    its own code passed the whole GPU suite (:data:`GPU_RUNS`), or it is byte for byte
    the code of a toolchain whose did."""
    c = COMPARED.get(toolchain)
    if c is None:
        return f"not compared with {VERIFIED}, the GPU runs' one: every kernel unproven on a GPU"
    if toolchain in GPU_RUNS:
        return f"the statuses hold (its own code on a GPU: {GPU_RUNS[toolchain]})"
    if not c.differs:
        return f"the statuses hold ({c.why})"
    if c.same_as in GPU_RUNS:
        return (f"the statuses hold (its code is byte-identical to {c.same_as}'s, which ran: "
                f"{GPU_RUNS[c.same_as]})")
    which = "every kernel" if c.differs == EVERY_BUILD else ", ".join(c.differs)
    return f"{which} unproven on a GPU ({c.why})"


def lines() -> list[str]:
    """``ts-moe info``'s toolchain section: this process's, every one compared, and the
    frameworks ts_moe installs beside."""
    import tvm_ffi

    here = current()
    out = [f"toolchain: {here}, apache-tvm-ffi {tvm_ffi.__version__}: {verdict(here)}",
           f"  the statuses above are for {VERIFIED}; on the others compared, build by build:"]
    out += [f"    {t}: {verdict(t)}" for t in COMPARED if t != VERIFIED]
    out += [f"  {t} on a GPU: \"{run.summary}\" at {run.commit[:12]} on {run.device} "
            f"({run.evidence})" for t, run in GPU_RUNS.items()]
    out.append(f"  apache-tvm-ffi is not in the kernels' code (on {TVM_FFI_OLDEST} their "
               f"compiled objects are the same bytes); the GPU runs called them through "
               f"{TVM_FFI_VERIFIED}")
    out += [f"  installs beside {f.requirement}: {f.dsl} on a CUDA 13 driver, apache-tvm-ffi "
            f"{f.tvm_ffi}, torch {f.torch}" for f in FRAMEWORKS]
    return out
