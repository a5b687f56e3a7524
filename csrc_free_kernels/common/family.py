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
``ts_moe``'s kernel table and paths, ``ts-moe info``, ``python -m ts_moe
compile``, the PTX tests' and the pre-flight's build lists.  A build
(:class:`Build`) is one compile: the key the run-time cache stores it under and
a thunk that makes the kernel object and its fake arguments, so that what is
checked on the CPU is what a call compiles.
"""

import dataclasses
import enum
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
    kernels take (None: no expert dimension)."""

    backends: Mapping[Op, object]
    builds: Callable[[], Iterable[Build]]
    checked: Callable[[Build], bool] = every_build
    max_experts: int | None = None


@dataclasses.dataclass(frozen=True)
class Family:
    """One kernel family.  ``serves``: the op families its backends serve (empty: no
    path of the ops takes it; the harness names it); ``setting``: the
    ``ts_moe.settings`` attribute that turns it on (None: on by default);
    ``load``: imports the launch module (the import guard's body)."""

    name: str
    title: str
    arch: str
    proof: Proof
    evidence: str
    load: Callable[[], Kernels]
    serves: tuple[Op, ...] = ()
    run: Run | None = None
    setting: str | None = None

    @property
    def in_ops(self) -> bool:
        return bool(self.serves)
