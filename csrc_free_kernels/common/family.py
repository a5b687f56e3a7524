"""A kernel family's record: declared once, by its package, read by everything else.

A family is the kernels of one launch module: its configurations, classes and
backends.  Its record (:class:`Family`) says what the family is (name, title,
arch), how far it is proven on hardware (:class:`Proof`, the evidence and the
GPU :class:`Run`), which ``ts_moe.settings`` switch turns it on where it is
opt-in, and which op families it serves (:class:`Op`).  Importing the record
imports no DSL: ``load`` is the family's import guard's body, a static import
of its launch module that returns the module's :class:`Kernels` (the backends
per op family, the build space, the expert limit).

Everything else is derived from the records (``csrc_free_kernels.families``):
``ts_moe``'s kernel table and paths (a device takes the families whose arch
serves its compute capability, higher :attr:`Family.precedence` first, each
within its kernels' dtypes and expert limit), ``ts-moe info``, ``python -m ts_moe
compile``, the PTX tests' and the pre-flight's build lists.  Two families that
serve one op family on one capability at one precedence are refused
(:func:`check`): a call could take either.  A build
(:class:`Build`) is one compile: the key the run-time cache stores it under and
a thunk that makes the kernel object and its fake arguments, so that what is
checked on the CPU is what a call compiles.
"""

import dataclasses
import enum
import re
from collections.abc import Callable, Iterable, Mapping


class Op(enum.Enum):
    """The op families a backend serves (``ts_moe.ops.backend`` has their protocols)."""

    GROUPED_GEMM = "grouped_gemm"
    GROUPED_GEMM_K = "grouped_gemm_k"
    GROUPED_GEMM_SWIGLU = "grouped_gemm_swiglu"
    SWIGLU_ACTIVATION = "swiglu_activation"
    ROUTE_SLOTS = "route_slots"
    ROUTE_TOPK = "route_topk"
    SORT_SLOTS = "sort_slots"
    ROW_SUM = "row_sum"
    COMBINE_GRAD = "combine_grad"
    ROUTER_LOGITS = "router_logits"
    SCALED_GROUPED_GEMM = "scaled_grouped_gemm"
    SCALED_GROUPED_GEMM_SWIGLU = "scaled_grouped_gemm_swiglu"
    QUANTIZE_FP8 = "quantize_fp8"


class Proof(enum.Enum):
    VERIFIED = "verified on hardware"
    COMPILED = "compiled and model-checked only"


@dataclasses.dataclass(frozen=True)
class Run:
    """A GPU run a status rests on: the commit of the tree, the device, the day, what
    happened."""

    commit: str
    device: str
    date: str
    result: str

    def __str__(self) -> str:
        return f"{self.device}, {self.commit}, {self.date}: {self.result}"


@dataclasses.dataclass(frozen=True)
class Build:
    """One compile of a family's kernel: ``key`` is the run-time cache key
    (``common.compile.get_compiled``), ``make`` returns ``(kernel, fake arguments)``,
    ``name`` is what the PTX tests and the pre-flight call it, ``spec`` the choices it
    was made from (configuration, dtypes, layout, ...)."""

    name: str
    key: tuple
    make: Callable[[], tuple]
    spec: Mapping = dataclasses.field(default_factory=dict)


def every_build(build: Build) -> bool:
    """Every build: the family's space is small enough to check whole on the CPU."""
    return True


@dataclasses.dataclass(frozen=True)
class Kernels:
    """What a family's launch module serves once imported: a backend per op family;
    its build space, every build a call can reach (``builds``), and which of them the
    PTX tests and the pre-flight compile on the CPU (``checked``); the most experts its
    kernels take (None: no expert dimension); the operand dtypes they take, which the
    paths read (a call of another dtype, or naming none, skips them; empty: its
    ``choose_config`` decides alone)."""

    backends: Mapping[Op, object]
    builds: Callable[[], Iterable[Build]]
    checked: Callable[[Build], bool] = every_build
    max_experts: int | None = None
    dtypes: tuple = ()


ARCH = re.compile(r"sm_(?P<major>\d+)(?P<minor>\d)[af]?")
"""A target the DSL compiles for: ``sm_90a`` serves compute capability 9.0, ``sm_100a``
10.0 (the ``a`` and ``f`` targets run on their own capability only)."""


@dataclasses.dataclass(frozen=True)
class Family:
    """One kernel family.  ``arch``: the target it compiles for (:data:`ARCH`), which
    gives the compute capability it serves; ``serves``: the op families its backends
    serve (empty: no path of the ops takes it; the harness names it); ``precedence``:
    among the families serving one op family on one capability, the higher is tried
    first (its path comes before the others'); ``setting``: the ``ts_moe.settings``
    attribute that turns it on (None: on by default); ``load``: imports the launch
    module (the import guard's body)."""

    name: str
    title: str
    arch: str
    proof: Proof
    evidence: str
    load: Callable[[], Kernels]
    serves: tuple[Op, ...] = ()
    run: Run | None = None
    setting: str | None = None
    precedence: int = 0

    def __post_init__(self):
        if not (isinstance(self.arch, str) and ARCH.fullmatch(self.arch)):
            raise ValueError(f"kernel family {self.name!r}: arch {self.arch!r} is not a "
                             f"target of the form sm_<major><minor>[a|f] (sm_90a, sm_100a)")
        if type(self.precedence) is not int or self.precedence < 0:
            raise ValueError(f"kernel family {self.name!r}: precedence "
                             f"{self.precedence!r} is not an int >= 0")

    @property
    def in_ops(self) -> bool:
        return bool(self.serves)

    @property
    def capability(self) -> tuple[int, int]:
        """The compute capability its arch serves: ``sm_90a`` (9, 0)."""
        found = ARCH.fullmatch(self.arch)
        return int(found["major"]), int(found["minor"])


def check(families: Iterable[Family]) -> None:
    """Refuse records a call could not choose between: two families serving one op
    family on one compute capability at one precedence, or of one name (a ValueError
    naming both)."""
    seen, names = {}, set()
    for family in families:
        if family.name in names:
            raise ValueError(f"two kernel families named {family.name!r}")
        names.add(family.name)
        for op in family.serves:
            key = (family.capability, family.precedence, op)
            other = seen.setdefault(key, family)
            if other is not family:
                major, minor = family.capability
                raise ValueError(
                    f"kernel families {other.name!r} ({other.arch}) and {family.name!r} "
                    f"({family.arch}) both serve {op.value} on compute capability "
                    f"{major}.{minor} at precedence {family.precedence}: a call could take "
                    f"either; give one a higher precedence (Family.precedence: the higher "
                    f"is tried first) or drop one")
