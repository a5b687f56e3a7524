"""Decode calls of the layer as CUDA-graph replays: an eager block call in three launches.

At decode sizes an eager MoE block is bound by its host: six launches and the
Python that checks and dispatches them cost 170-360 us per call on the H200's
hosts, where the GPU needs 50-200 us (bench/notes/2026-12-04-decode-graphs.md).  So
:func:`ts_moe.moe_forward` and :func:`ts_moe.experts_forward`, called eagerly
with few tokens, replay a CUDA graph of themselves (:class:`DecodeGraphs`):

- a call's *signature* is what the captured kernels bake in: the token count,
  the inputs' shapes and dtypes, the weights' addresses, shapes and strides,
  the static arguments, the device, the current stream and the inference
  mode.  The first call of a signature runs eagerly (it compiles or loads the
  kernels); the second runs once more on a side stream, on the graph's own
  input buffers (so the capture launches nothing for the first time), is
  captured there (no host sync) and replayed; later ones replay it;
- a replay copies the per-call inputs into the graph's own input buffers,
  launches the graph on the current stream and returns fresh copies of its
  outputs: three launches, 42-51 us of host time per block call on the H200's
  host (bench/notes/2026-12-04-decode-graphs.md), whatever the block does
  inside.  The graph reads the weights in place, so weights updated in place
  are seen; new weight tensors are a new signature;
- graphs of one (device, stream) share one memory pool, one side stream to
  capture on and one lock (a replay's copy, launch and clone run as a unit);
  at most ``max_graphs`` graphs are held, admitted and evicted as
  :class:`DecodeGraphs` says; each holds its own input and output buffers (for
  a block, two ``T x H`` tensors).  ``graphs.clear()`` frees them all.

Only calls that a graph can replay exactly are graphed: CUDA tensors (no
subclass), at most ``max_tokens`` tokens, no gradient wanted (nor forward-mode
AD), no autocast, outside ``torch.compile`` tracing and outside another
capture, on a path of :mod:`ts_moe.ops` that never syncs with the host
(:func:`ts_moe.ops.graph_path`, which is part of the signature, as are
:func:`ts_moe.ops.paths.switches`, the families' switches, and cuBLAS's
reduced-precision switches).
Everything else, and every call while ``ts_moe.settings.decode_graphs`` is off
(``TS_MOE_DECODE_GRAPHS=0``; read at each call) or after
:func:`DecodeGraphs.disable` (which, like :func:`DecodeGraphs.enable`, outranks
the setting), runs eagerly as before.
A replay gives the eager call's result bit for bit
(``tests/test_decode_graphs_gpu.py``).
"""

import collections
import itertools
import threading
import warnings

import torch
from torch import nn
from torch.autograd import forward_ad as _forward_ad

from . import ops
from .experts import ExpertWeights
from .settings import settings

MAX_TOKENS = 128  # the decode regime of the targets (T <= 128)
MAX_GRAPHS = 512  # a 48-layer model at ten batch sizes, with room

_PLAIN = (torch.Tensor, nn.Parameter)
# cuBLAS's reduced-precision switches (the router GEMM's rounding), where torch has them
_bf16_reduced = getattr(torch._C, "_get_cublas_allow_bf16_reduced_precision_reduction",
                        lambda: None)
_fp16_reduced = getattr(torch._C, "_get_cublas_allow_fp16_reduced_precision_reduction",
                        lambda: None)
_STATIC = (int, bool, float, str, type(None))


class _Lane:
    """What the graphs of one (device, stream) share: a memory pool, a side stream
    to capture on (its own: the cuBLAS workspace that torch keeps per stream is
    baked into the graphs), and a lock held from a replay's input copy to its
    output clone (graphs of one pool may reuse each other's scratch memory)."""

    __slots__ = ("pool", "side", "lock")

    def __init__(self, device: int):
        self.pool = torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream(device)
        self.lock = threading.Lock()


class _Graph:
    """One captured call: its graph, its input buffers and its outputs."""

    __slots__ = ("graph", "inputs", "outputs", "single", "lock", "last_use")

    def __init__(self, graph, inputs, outputs, single, lock):
        self.graph, self.inputs, self.outputs, self.single = graph, inputs, outputs, single
        self.lock, self.last_use = lock, 0

    def replay(self, dynamic):
        with self.lock:
            for buffer, t in zip(self.inputs, dynamic):
                buffer.copy_(t)
            self.graph.replay()
            if self.single:
                return self.outputs[0].clone()
            return tuple(o.clone() for o in self.outputs)


class DecodeGraphs:
    """CUDA graphs of decode-sized calls, keyed by signature (module docstring).

    ``call(fn, num_experts, dynamic, fixed, *static)`` returns ``fn(*dynamic,
    *fixed, *static)``: ``dynamic`` the per-call tensors (copied into the
    graph), ``fixed`` the weights (read in place by address: tensors, or the
    experts' value of :mod:`ts_moe.experts`, whose tensors and kind count),
    ``static`` hashable arguments; ``fn`` returns a tensor or a tuple of tensors and
    runs ``num_experts`` experts (which decides its path in ops).

    Admission: a signature is captured at its second call while it is among
    the last ``IDLE_FACTOR * max_graphs`` signatures met once.  With
    ``max_graphs`` graphs held, the least recently used one makes room only if
    it has been idle for ``IDLE_FACTOR * max_graphs`` graphable calls;
    otherwise the new signature runs eagerly.  So a working set larger than
    the cache costs eager calls, never a capture per call.
    """

    IDLE_FACTOR = 8

    def __init__(self, max_tokens: int = MAX_TOKENS, max_graphs: int = MAX_GRAPHS):
        self.max_tokens, self.max_graphs = max_tokens, max_graphs
        self._switch: bool | None = None  # enable()/disable(); None: the setting
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self._seen: collections.OrderedDict = collections.OrderedDict()  # met once, not captured
        self._eager: set = set()  # signatures whose capture failed: eager for good
        self._lanes: dict = {}
        self._lock = threading.Lock()
        self._order = threading.Lock()  # the graphs' LRU order; never held over a capture
        # graphable calls so far: each call takes its own number (next() of a count is
        # one step for the interpreter; `+= 1` on a shared attribute loses steps between
        # threads and can even step back, which would stall every eviction)
        self._ticks = itertools.count(1)
        self.captures = 0  # graphs captured so far (tests, benchmarks)

    @property
    def enabled(self) -> bool:
        """Whether calls may be graphed: as :meth:`enable` / :meth:`disable` set it,
        else ``ts_moe.settings.decode_graphs``, read now (set it at any time)."""
        if self._switch is not None:
            return self._switch
        return settings.decode_graphs

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._switch = bool(value)

    def enable(self) -> None:
        self.enabled = True

    def disable(self) -> None:
        """Run every call eagerly and free the graphs."""
        self.enabled = False
        self.clear()

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()
            self._seen.clear()
            self._eager.clear()
            self._lanes.clear()
            self.captures = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def call(self, fn, num_experts: int, dynamic: tuple, fixed: tuple, *static):
        key = self._signature(fn, num_experts, dynamic, fixed, static) if self.enabled else None
        if key is None:
            return fn(*dynamic, *fixed, *static)
        tick = next(self._ticks)
        entry = self._graphs.get(key)
        if entry is not None:
            entry.last_use = tick
            with self._order:  # an eviction walks the order under this lock
                try:
                    self._graphs.move_to_end(key)
                except KeyError:  # evicted by another thread meanwhile: this replay holds it
                    pass
            return entry.replay(dynamic)
        if key in self._seen:
            entry = self._capture_once(key, fn, dynamic, fixed, static, tick)
            if entry is not None:
                return entry.replay(dynamic)
        out = fn(*dynamic, *fixed, *static)
        if key not in self._eager and key not in self._graphs:  # capture at the next call
            with self._lock:
                self._seen[key] = None
                if len(self._seen) > self.IDLE_FACTOR * self.max_graphs:
                    self._seen.popitem(last=False)
        return out

    # ---------------------------------------------------------------- keys
    def _signature(self, fn, num_experts, dynamic, fixed, static):
        """The call's signature, or None where it must run eagerly."""
        x = dynamic[0]
        if torch.compiler.is_compiling() or type(x) not in _PLAIN or not x.is_cuda:
            return None
        if x.dim() == 0 or x.shape[-1] == 0 or not 0 < x.numel() // x.shape[-1] <= self.max_tokens:
            return None
        if any(type(s) not in _STATIC for s in static) or _forward_ad._current_level >= 0:
            return None
        grad = torch.is_grad_enabled()
        # the types too: True == 1, but top_k=True must fail as it does eagerly
        parts = [fn, x.get_device(), torch.is_inference_mode_enabled(), static,
                 tuple(map(type, static))]
        for t in dynamic:
            if type(t) not in _PLAIN or (grad and t.requires_grad):
                return None
            parts.append((t.shape, t.dtype, t.get_device()))
        for f in fixed:  # a tensor, or the experts' value: its tensors and its kind
            experts = isinstance(f, ExpertWeights)
            for t in f.tensors if experts else (f,):
                if type(t) not in _PLAIN or (grad and t.requires_grad):
                    return None
                parts.append((t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device()))
            if experts:
                parts.append((type(f), f.kind))
        device = parts[1]
        if torch.is_autocast_enabled("cuda") or torch.cuda.is_current_stream_capturing():
            return None
        path = ops.graph_path(device, x.dtype, num_experts)
        if path is None:
            return None
        parts += (path, ops.paths.switches(), _bf16_reduced(), _fp16_reduced(),
                  torch._C._cuda_getCurrentRawStream(device))
        return tuple(parts)

    # ------------------------------------------------------------- capture
    def _capture_once(self, key, fn, dynamic, fixed, static, tick: int):
        """The graph of a signature met once before, or None: captured already by
        another thread, no room (see the class docstring), or the capture
        failed (the signature then stays eager; an error in ``fn`` is raised
        again by the eager call)."""
        with self._lock:
            if self._seen.pop(key, True) is not None or key in self._graphs:
                return self._graphs.get(key)
            if len(self._graphs) >= self.max_graphs:
                with self._order:  # replays reorder the graphs without self._lock
                    oldest = next(iter(self._graphs.values()))
                    if tick - oldest.last_use < self.IDLE_FACTOR * self.max_graphs:
                        return None
                    self._graphs.popitem(last=False)
            try:
                entry = self._capture(key, fn, dynamic, fixed, static)
            except Exception as exc:  # CUDA refused the capture: warn, and stay eager
                warnings.warn(f"ts_moe: a decode call could not be captured in a CUDA graph "
                              f"and runs eagerly from now on: {exc}", RuntimeWarning)
                entry = None
            if entry is None:
                self._eager.add(key)
                return None
            entry.last_use = tick
            self._graphs[key] = entry
            self.captures += 1
            return entry

    def _lane(self, device: int, stream: int) -> _Lane:
        lane = self._lanes.get((device, stream))
        if lane is None:
            lane = self._lanes[(device, stream)] = _Lane(device)
        return lane

    def _capture(self, key, fn, dynamic, fixed, static) -> _Graph | None:
        """Capture ``fn`` on the lane's side stream; None if ``fn`` raises (a Python
        error: nothing half-captured).  A warm-up call on the side stream first,
        on the graph's own input buffers, runs outside the capture whatever the
        capture will launch for the first time (kernel loads, the side stream's
        cuBLAS workspace) on exactly the paths the capture takes."""
        lane = self._lane(key[1], key[-1])
        current = torch.cuda.current_stream()
        inputs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in dynamic]
        for buffer, t in zip(inputs, dynamic):
            buffer.copy_(t)
        graph = torch.cuda.CUDAGraph()
        lane.side.wait_stream(current)
        try:
            with torch.cuda.stream(lane.side):
                try:
                    fn(*inputs, *fixed, *static)
                except Exception:
                    return None
                graph.capture_begin(pool=lane.pool, capture_error_mode="thread_local")
                try:
                    out = fn(*inputs, *fixed, *static)
                except Exception:
                    graph.capture_end()
                    return None
                graph.capture_end()
        finally:
            current.wait_stream(lane.side)
        single = isinstance(out, torch.Tensor)
        return _Graph(graph, inputs, (out,) if single else tuple(out), single, lane.lock)


graphs = DecodeGraphs()
