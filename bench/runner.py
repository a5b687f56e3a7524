"""Run a suite: for each case, make the inputs once, compute the reference,
then per backend: prepare, check every input copy against the reference,
and only if it is right, time it.  One record per (case, backend) of the
backends that apply to the case (a factory's ``applies(case)``, where it has
one).  Suites that ask for it also get each backend's peak memory over one
call (on CUDA), or both its eager and its CUDA-graph time (``graph_timing``:
``ms`` eager, ``graph_ms`` graph replays, on CUDA), and the case's
weight-streaming floor (``floor_bytes``: ``floor_ms`` at the measured HBM
roof, ``floor_frac`` and ``graph_floor_frac`` of each backend's times)."""

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import backends as gemm_backends
from . import cases as case_lib
from . import fp8, moe_block, moe_layer, training
from .backends import Factory, Unavailable
from .cases import Case
from .roofs import roof_fraction
from .timing import l2_bytes, measure, nvtx_range, profiled, rotation_copies

TOLERANCE = 1e-2  # bf16 output: rounding alone is ~2e-3 relative


@dataclass(frozen=True)
class Suite:
    """What differs between suites: inputs, reference, backends."""

    name: str
    make_inputs: Callable[[Case, torch.device], object]
    reference: Callable[[object], object]  # fp32 result (a tensor, or a tuple of them)
    backends: Callable[[], dict[str, Factory]]
    default_backends: tuple[str, ...]
    default_target_ms: float = 100.0  # timed work per backend and case on a GPU
    memory: bool = False  # record each backend's peak memory over one call (CUDA)
    # time each backend eagerly (ms) and, on CUDA, as CUDA-graph replays (graph_ms), in
    # the same run; --graphs then changes nothing
    graph_timing: bool = False
    graph_max_t: int = 1024  # --graph-max-t's default
    # bytes of the weights a call must stream (the floor_ms of its records), or None
    floor_bytes: Callable[[Case], int] | None = None


SUITES = {
    "grouped_gemm": Suite("grouped_gemm", gemm_backends.make_gemm_inputs,
                          gemm_backends.reference_grouped_gemm,
                          lambda: gemm_backends.Registry(gemm_backends.BACKENDS),
                          gemm_backends.DEFAULT_BACKENDS),
    "moe_layer": Suite("moe_layer", moe_layer.make_layer_inputs, moe_layer.reference_layer,
                       moe_layer.layer_backends, moe_layer.DEFAULT_BACKENDS),
    "training": Suite("training", training.make_training_inputs, training.reference_training,
                      training.training_backends, training.DEFAULT_BACKENDS,
                      default_target_ms=training.TARGET_MS, memory=True),
    "moe_block": Suite("moe_block", moe_block.make_block_inputs, moe_block.reference_block,
                       moe_block.block_backends, moe_block.DEFAULT_BACKENDS,
                       graph_timing=True, graph_max_t=max(case_lib.BLOCK_T),
                       floor_bytes=moe_block.floor_bytes),
    "fp8": Suite("fp8", fp8.make_fp8_inputs, fp8.reference_fp8, fp8.fp8_backends,
                 fp8.DEFAULT_BACKENDS),
}


@dataclass
class Settings:
    device: torch.device
    target_ms: float = 100.0
    min_iters: int = 5
    max_iters: int = 200
    graphs: bool = False
    graph_max_t: int = 1024
    input_budget_bytes: int = 36 << 30
    tolerance: float = TOLERANCE
    rounds: int = 2  # timing passes per backend, interleaved (:func:`timing_orders`)


CHUNK_ELEMENTS = 1 << 26  # rel_err compares larger tensors a slab at a time


def _slabs(t: torch.Tensor):
    """``t`` in slabs along dim 0 of at most about CHUNK_ELEMENTS elements."""
    if t.dim() == 0 or t.numel() <= CHUNK_ELEMENTS:
        yield t
        return
    step = max(1, CHUNK_ELEMENTS // max(1, t[0].numel()))
    for i in range(0, t.shape[0], step):
        yield t[i:i + step]


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in fp32; inf for a wrong shape or non-finite output.

    A tuple (several results of one call, e.g. a layer's output and gradients)
    against a tuple: the largest error of its members.  Large tensors are
    compared a slab at a time, so no fp32 copy of a whole (E, K, N) weight
    gradient is made; ``ref`` may be in host memory (the layer's weight gradients
    of a large model: :data:`bench.training.HOST_GRAD_BYTES`)."""
    if isinstance(ref, (tuple, list)):
        if not isinstance(out, (tuple, list)) or len(out) != len(ref):
            return math.inf
        return max((rel_err(o, r) for o, r in zip(out, ref)), default=0.0)
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return math.inf
    if ref.numel() <= CHUNK_ELEMENTS and ref.device == out.device:
        diff = (out.float() - ref).norm().item()
        norm = ref.norm().item()
    else:  # slab by slab; a reference kept in host memory comes over a slab at a time
        diff2 = norm2 = 0.0
        for o, r in zip(_slabs(out), _slabs(ref)):
            r = r.to(o.device)
            diff2 += (o.float() - r).norm().item() ** 2
            norm2 += r.norm().item() ** 2
        diff, norm = math.sqrt(diff2), math.sqrt(norm2)
    if not math.isfinite(diff):
        return math.inf
    return diff / norm if norm else (0.0 if diff == 0 else math.inf)


def check(runs, ref: torch.Tensor) -> float:
    """Largest relative error over the bound copies (each copy has its own pointers)."""
    return max(rel_err(run(), ref) for run in runs)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def case_record(case: Case) -> dict:
    """The fields every record of a case shares."""
    return {
        **case.key(),
        "E": case.E, "M": case.M, "N": case.N, "K": case.K, "top_k": case.model.top_k,
        "weight_layout": case.weight_layout,
        "touched_experts": case.touched_experts,
        "skew": case_lib.skew(case.counts),
        "flops": case_lib.flops(case),
        "bytes": case_lib.bytes_moved(case),
        **({"flop_roof": "fp8_dense_tflops"} if case.step in case_lib.FP8_RECIPES else {}),
    }


def peak_memory(run, device: torch.device) -> int | None:
    """Bytes one call of ``run`` allocates at its peak beyond what was allocated
    before it (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``,
    less ``memory_allocated`` before; what the call returns counts); None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    return peak


def applies(factory: Factory, case: Case) -> bool:
    """Whether the backend has a result for the case (a factory without ``applies``: always)."""
    check_case = getattr(factory, "applies", None)
    return check_case is None or check_case(case)


def _empty(base: dict, backend: str, status: str, **extra) -> dict:
    return {**base, "backend": backend, "status": status, "ms": None, "tflops": None,
            "tbps": None, "max_rel_err": None, **extra}


def prepare_backend(factory: Factory, case: Case, copies, ref, settings: Settings,
                    base: dict, name: str):
    """Bind and check one backend: ``(runs, err)``, or a failure record."""
    try:
        with nvtx_range(f"{name} prepare"):
            bind = factory(case, settings.device)
            runs = [bind(inp) for inp in copies]
        with nvtx_range(f"{name} check"):
            # a backend with a yardstick of its own (an FP8 block: its quantized weights)
            own = getattr(factory, "reference", None)
            err = check(runs, ref if own is None else own(copies[0]))
    except (ImportError, Unavailable) as exc:
        return _empty(base, name, "unavailable", reason=str(exc))
    except torch.OutOfMemoryError as exc:
        return _empty(base, name, "oom", reason=str(exc).splitlines()[0])
    except Exception as exc:  # a broken backend must not end the run
        return _empty(base, name, "error", reason=f"{type(exc).__name__}: {exc}")
    if not err <= settings.tolerance:
        return _empty(base, name, "wrong", max_rel_err=err)
    return runs, err


def measure_memory(run, base: dict, name: str, device: torch.device):
    """A checked backend's peak memory (bytes, or None off CUDA), or its failure record."""
    try:
        return peak_memory(run, device)
    except torch.OutOfMemoryError as exc:
        return _empty(base, name, "oom", reason=str(exc).splitlines()[0])
    except Exception as exc:  # a broken backend must not end the run
        return _empty(base, name, "error", reason=f"{type(exc).__name__}: {exc}")


def graph_skip_reason(case: Case, settings: Settings) -> str | None:
    """Why a case's calls are not timed as CUDA-graph replays, or None."""
    if settings.device.type != "cuda":
        return "no CUDA graphs off CUDA"
    if case.T > settings.graph_max_t:
        return f"T > --graph-max-t {settings.graph_max_t}"
    return None


def timing_orders(names: list, rounds: int) -> list[list]:
    """The backends' order in each of ``rounds`` timing passes: every pass times each
    backend once, the passes alternate forward and reversed and each pair starts one
    place further on (two rounds: the list, then reversed).  Over ``2 * len(names)``
    rounds (or a multiple) every backend takes every place equally often; fewer
    rounds balance only first against last."""
    orders = []
    for i in range(rounds):
        shift = (i // 2) % max(1, len(names))
        order = names[shift:] + names[:shift]
        orders.append(order if i % 2 == 0 else order[::-1])
    return orders


def time_backend(runs, case: Case, settings: Settings, target_ms: float,
                 graph: bool | None = None):
    """One timing pass of a checked backend: a :class:`bench.timing.Timing`, or the exception.
    ``graph`` None: CUDA-graph replays where ``settings.graphs`` asks for them."""
    device = settings.device
    if graph is None:
        graph = settings.graphs and graph_skip_reason(case, settings) is None
    try:
        return measure(runs, device, target_ms=target_ms, min_iters=settings.min_iters,
                       max_iters=settings.max_iters, graph=graph)
    except Exception as exc:  # a broken backend must not end the run
        return exc


def timed_record(base: dict, name: str, err: float, passes, roofs) -> dict:
    """The record of a backend timed in two passes (or the failure of one)."""
    for t in passes:
        if isinstance(t, torch.OutOfMemoryError):
            return _empty(base, name, "oom", reason=str(t).splitlines()[0])
        if isinstance(t, Exception):
            return _empty(base, name, "error", reason=f"{type(t).__name__}: {t}")
    ms = statistics.median([x for t in passes for x in t.samples])
    frac, bound = roof_fraction(ms, base["flops"], base["bytes"], roofs,
                                base.get("flop_roof", "bf16_dense_tflops"))
    seconds = ms * 1e-3
    return {**base, "backend": name, "status": "ok", "ms": ms,
            "tflops": base["flops"] / seconds / 1e12, "tbps": base["bytes"] / seconds / 1e12,
            "max_rel_err": err, "iters": sum(t.iters for t in passes),
            "pass_ms": [t.ms for t in passes], "graphed": passes[0].graphed,
            "roof_frac": frac, "bound": bound, **_floor_frac(base, ms, "floor_frac")}


def floor_ms(nbytes: int, roofs) -> float | None:
    """The time the measured HBM read roof needs for ``nbytes``, or None without roofs."""
    if not roofs:
        return None
    return nbytes / (roofs["hbm_read_tbps"] * 1e12) * 1e3


def _floor_frac(base: dict, ms: float, key: str) -> dict:
    """``{key: floor_ms / ms}`` where the case has a floor (else nothing, or None)."""
    if "floor_ms" not in base:
        return {}
    floor = base["floor_ms"]
    return {key: floor / ms if floor is not None and ms else None}


def graph_fields(record: dict, passes, skip_reason: str | None, roofs) -> dict:
    """``record`` with its CUDA-graph time: ``graph_ms`` (median over both passes),
    ``graph_status`` ("ok"; "unavailable" with a ``graph_reason``: not on CUDA, T over
    the limit, or the capture or a replay failed; "oom"), ``graph_iters``,
    ``graph_pass_ms``, ``graph_roof_frac``, ``graph_floor_frac``.  A record that was
    not timed eagerly keeps the case's empty graph fields."""
    if record["status"] != "ok":
        return record
    if skip_reason is not None or not passes:
        return {**record, "graph_status": "unavailable",
                "graph_reason": skip_reason or "not timed"}
    for t in passes:
        if isinstance(t, torch.OutOfMemoryError):
            return {**record, "graph_status": "oom", "graph_reason": str(t).splitlines()[0]}
        if isinstance(t, Exception):
            first = (str(t).strip().splitlines() or [""])[0]
            return {**record, "graph_status": "unavailable",
                    "graph_reason": f"capture or replay failed: {type(t).__name__}: {first}"}
    ms = statistics.median([x for t in passes for x in t.samples])
    frac, _ = roof_fraction(ms, record["flops"], record["bytes"], roofs,
                            record.get("flop_roof", "bf16_dense_tflops"))
    return {**record, "graph_ms": ms, "graph_status": "ok",
            "graph_iters": sum(t.iters for t in passes), "graph_pass_ms": [t.ms for t in passes],
            "graph_roof_frac": frac, **_floor_frac(record, ms, "graph_floor_frac")}


def prepare_inputs(suite: Suite, case: Case, settings: Settings):
    """(reference, copies): the case's inputs and enough clones to rotate through."""
    first = suite.make_inputs(case, settings.device)
    ref = suite.reference(first)
    read = case_lib.weight_bytes(case) + case_lib.traffic(case)["act_in"]
    n = rotation_copies(read, first.nbytes, l2_bytes(settings.device),
                        settings.input_budget_bytes)
    return ref, [first] + [first.clone() for _ in range(n - 1)]


def run_case(suite: Suite, case: Case, factories: dict[str, Factory], settings: Settings,
             roofs) -> list[dict]:
    """All backends of one case on the same inputs; the inputs are freed after."""
    device = settings.device
    base = case_record(case)
    if suite.memory:
        base["peak_mem_bytes"] = None
    if suite.floor_bytes is not None:
        base["floor_bytes"] = suite.floor_bytes(case)
        base["floor_ms"] = floor_ms(base["floor_bytes"], roofs)
    if suite.graph_timing:
        base.update(graph_ms=None, graph_status=None)
    names = [name for name in factories if applies(factories[name], case)]
    if not names:
        return []
    reason = None
    try:
        ref, copies = prepare_inputs(suite, case, settings)
    except torch.OutOfMemoryError as exc:
        reason = str(exc).splitlines()[0]
    if reason is not None:  # outside the except: the traceback no longer pins tensors
        _free(device)
        return [_empty(base, name, "oom", reason=reason) for name in names]
    base["copies"] = len(copies)
    # check everything first, then time in interleaved passes (two by default, in
    # order and reversed; --rounds more) and take the median of all: timed once, in
    # list order, one kernel measured up to 15 % slower as the fourth of five
    # backends than as the second (Qwen3 T=4096, H200, 2026-12-02), so a backend's
    # place in the list must not decide its time; two passes still left 12 % between
    # runs of a few-per-cent A/B (bench/notes/2026-12-07-tma-store-epilogue-ab.md)
    checked, records, peaks = {}, {}, {}
    for name in names:
        with nvtx_range(f"{name} {case.describe()}"):
            got = prepare_backend(factories[name], case, copies, ref, settings, base, name)
        if isinstance(got, dict):
            records[name] = got
            if got["status"] == "oom":  # give the next backend a clean pool
                _free(device)
        else:
            checked[name] = got
    if suite.memory:  # one call each, before any timing: the peak of a warmed-up call
        for name in list(checked):
            with nvtx_range(f"{name} memory"):
                got = measure_memory(checked[name][0][0], base, name, device)
            if isinstance(got, dict):
                records[name] = got
                del checked[name]
                _free(device)
            else:
                peaks[name] = got
    eager = False if suite.graph_timing else None  # graph_timing: ms is always eager
    passes = {name: [] for name in checked}
    for order in timing_orders(list(checked), settings.rounds):
        for name in order:
            with nvtx_range(f"{name} {case.describe()}"):
                passes[name].append(time_backend(checked[name][0], case, settings,
                                                 settings.target_ms / settings.rounds,
                                                 graph=eager))
    if suite.graph_timing:  # after every eager pass: a failed capture cannot touch those
        skip = graph_skip_reason(case, settings)
        graph_passes = time_graphs(checked, passes, case, settings) if skip is None else {}
    for name, (_, err) in checked.items():
        records[name] = timed_record(base, name, err, passes[name], roofs)
        fields = getattr(factories[name], "fields", None)  # a backend's own measurements
        if fields is not None and records[name]["status"] == "ok":
            records[name].update(fields(case))
        if name in peaks and records[name]["status"] == "ok":
            records[name]["peak_mem_bytes"] = peaks[name]
        if suite.graph_timing:
            records[name] = graph_fields(records[name], graph_passes.get(name), skip, roofs)
    records = [records[name] for name in names]
    del ref, copies
    _free(device)
    return records


def time_graphs(checked: dict, passes: dict, case: Case, settings: Settings) -> dict:
    """CUDA-graph timing passes of the backends whose eager passes all ran, in the
    eager passes' orders; a backend whose capture or replay failed is
    not tried again (its one exception is its list)."""
    ok = [n for n in checked if not any(isinstance(t, Exception) for t in passes[n])]
    graph_passes = {name: [] for name in ok}
    for order in timing_orders(ok, settings.rounds):
        for name in order:
            if any(isinstance(t, Exception) for t in graph_passes[name]):
                continue
            with nvtx_range(f"{name} graph {case.describe()}"):
                t = time_backend(checked[name][0], case, settings,
                                 settings.target_ms / settings.rounds, graph=True)
            if isinstance(t, Exception):  # its frames pin the capture's tensors: drop them
                t = t.with_traceback(None)
                t.__context__ = t.__cause__ = None
            graph_passes[name].append(t)
            if isinstance(t, Exception):  # give the next backend a clean pool
                del t
                _settle(settings.device)
    return graph_passes


def _settle(device: torch.device) -> None:
    """After a failed capture: wait for the device (an error here is the capture's,
    already recorded) and free the cached memory."""
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001  (the failure is recorded with the backend)
            pass
    _free(device)


def _progress_line(i: int, total: int, case: Case, records, seconds: float) -> str:
    parts = []
    for r in records:
        if r["status"] == "ok":
            graph = ""  # a graph time, or a graph that was tried and failed
            if r.get("graph_ms") is not None:
                graph = f" (graph {r['graph_ms']:.3f})"
            elif r.get("graph_status") == "oom" or \
                    str(r.get("graph_reason", "")).startswith("capture"):
                graph = f" (graph {r['graph_status']})"
            parts.append(f"{r['backend']} {r['ms']:.3f} ms{graph}")
        else:
            parts.append(f"{r['backend']} {r['status']}")
    return f"[{i}/{total}] {case.describe()}: {', '.join(parts)} ({seconds:.1f} s)"


def run_suite(suite: Suite, cases: list[Case], backend_names, settings: Settings,
              roofs=None, factories: dict[str, Factory] | None = None,
              progress=None) -> list[dict]:
    """Every case x backend; one progress line per case on ``progress`` (None:
    quiet).  ``factories`` overrides the suite's registry (tests)."""
    registry = factories if factories is not None else suite.backends()
    unknown = [n for n in backend_names if n not in registry]
    if unknown:
        raise ValueError(f"unknown {suite.name} backends {unknown}; known: {sorted(registry)}")
    chosen = {n: registry[n] for n in backend_names}
    records = []
    with profiled(settings.device):
        for i, case in enumerate(cases, 1):
            t0 = time.perf_counter()
            with nvtx_range(f"case {case.describe()}"):
                case_records = run_case(suite, case, chosen, settings, roofs)
            records.extend(case_records)
            if progress is not None:
                print(_progress_line(i, len(cases), case, case_records,
                                     time.perf_counter() - t0), file=progress, flush=True)
    return records
