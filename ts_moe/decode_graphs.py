"""Decode calls of the layer as CUDA-graph replays: an eager block call in three launches.

At decode sizes an eager MoE block is bound by its host: six launches and the
Python that checks and dispatches them cost 170-360 us per call on the H200's
hosts, where the GPU needs 50-200 us (bench/RESULTS.md, "Issue 21").  So
:func:`ts_moe.moe_forward` and :func:`ts_moe.experts_forward`, called eagerly
with few tokens, replay a CUDA graph of themselves (:class:`DecodeGraphs`):

- a call's *signature* is what the captured kernels bake in: the token count,
  the inputs' shapes and dtypes, the weights' addresses, shapes and strides,
  the static arguments, the device, the current stream and the inference
  mode.  The first call of a signature runs eagerly (it compiles or loads the
  kernels); the second captures the call (no host sync: the capture runs on a
  side stream, nothing executes) and replays it; later ones replay it;
- a replay copies the per-call inputs into the graph's own input buffers,
  launches the graph on the current stream and returns fresh copies of its
  outputs: three launches, 42-51 us of host time per block call on the H200's
  host (bench/RESULTS.md, "Issue 21, second pass"), whatever the block does
  inside.  The graph reads the weights in place, so weights
  updated in place are seen; new weight tensors are a new signature;
- graphs of one (device, stream) share one memory pool (their replays are
  ordered on that stream) and are kept in least-recently-used order, at most
  ``max_graphs`` of them; each holds its own input and output buffers (for a
  block, two ``T x H`` tensors).  ``graphs.clear()`` frees them all.

Only calls that a graph can replay exactly are graphed: CUDA tensors (no
subclass), at most ``max_tokens`` tokens, no gradient wanted, no autocast,
outside ``torch.compile`` tracing and outside another capture, on a path of
:mod:`ts_moe.ops` that never syncs with the host (:func:`ts_moe.ops.capturable`).
Everything else, and every call with ``TS_MOE_DECODE_GRAPHS=0`` or after
:func:`DecodeGraphs.disable`, runs eagerly as before.  A replay gives the
eager call's result bit for bit (``tests/test_decode_graphs_gpu.py``).
"""

import collections
import os
import threading

import torch
from torch import nn

from . import ops

MAX_TOKENS = 128  # the decode regime of the targets (T <= 128)
MAX_GRAPHS = 512  # a 48-layer model at ten batch sizes, with room

_PLAIN = (torch.Tensor, nn.Parameter)
_STATIC = (int, bool, float, str, type(None))


class _Graph:
    """One captured call: its graph, its input buffers and its outputs.  A replay
    holds the graph's lock from the input copy to the output clone: two threads
    on one stream would otherwise interleave their copies before the replays."""

    __slots__ = ("graph", "inputs", "outputs", "single", "lock")

    def __init__(self, graph, inputs, outputs, single):
        self.graph, self.inputs, self.outputs, self.single = graph, inputs, outputs, single
        self.lock = threading.Lock()

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
    graph), ``fixed`` the weights (read in place by address), ``static``
    hashable arguments; ``fn`` returns a tensor or a tuple of tensors and
    runs ``num_experts`` experts (which decides its path in ops).
    """

    def __init__(self, max_tokens: int = MAX_TOKENS, max_graphs: int = MAX_GRAPHS):
        self.max_tokens, self.max_graphs = max_tokens, max_graphs
        self.enabled = os.environ.get("TS_MOE_DECODE_GRAPHS", "1") != "0"
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self._seen: collections.OrderedDict = collections.OrderedDict()  # met once, not captured
        self._eager: set = set()  # signatures whose capture failed: eager for good
        self._pools: dict = {}
        self._side: dict = {}
        self._lock = threading.Lock()
        self.captures = 0  # graphs captured so far (tests, benchmarks)

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
            self._pools.clear()
            self.captures = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def call(self, fn, num_experts: int, dynamic: tuple, fixed: tuple, *static):
        key = self._signature(fn, num_experts, dynamic, fixed, static) if self.enabled else None
        if key is None:
            return fn(*dynamic, *fixed, *static)
        entry = self._graphs.get(key)
        if entry is not None:
            try:
                self._graphs.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile: this replay still holds it
                pass
            return entry.replay(dynamic)
        if key in self._seen:
            entry = self._capture_once(key, fn, dynamic, fixed, static)
            if entry is not None:
                return entry.replay(dynamic)
        out = fn(*dynamic, *fixed, *static)
        if key not in self._eager:  # a call that succeeded eagerly: capture the next one
            with self._lock:
                self._seen[key] = None
                if len(self._seen) > self.max_graphs:
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
        if any(type(s) not in _STATIC for s in static):
            return None
        grad = torch.is_grad_enabled()
        parts = [fn, x.get_device(), torch.is_inference_mode_enabled(), static]
        for t in dynamic:
            if type(t) not in _PLAIN or (grad and t.requires_grad):
                return None
            parts.append((t.shape, t.dtype, t.get_device()))
        for t in fixed:
            if type(t) not in _PLAIN or (grad and t.requires_grad):
                return None
            parts.append((t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device()))
        device = parts[1]
        if (torch.is_autocast_enabled("cuda") or torch.cuda.is_current_stream_capturing()
                or not ops.capturable(device, x.dtype, num_experts)):
            return None
        parts.append(torch._C._cuda_getCurrentRawStream(device))
        return tuple(parts)

    # ------------------------------------------------------------- capture
    def _capture_once(self, key, fn, dynamic, fixed, static):
        """The graph of a signature met once before, or None: captured already by
        another thread, or ``fn`` raised while captured (the signature then
        stays eager and the eager call raises the error itself)."""
        with self._lock:
            if self._seen.pop(key, True) is not None or key in self._graphs:
                return self._graphs.get(key)
            entry = self._capture(key, fn, dynamic, fixed, static)
            if entry is None:
                self._eager.add(key)
                return None
            self._graphs[key] = entry
            self.captures += 1
            if len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
            return entry

    def _capture(self, key, fn, dynamic, fixed, static) -> _Graph | None:
        device, stream = key[1], key[-1]
        pool = self._pools.get((device, stream))
        if pool is None:
            pool = self._pools[(device, stream)] = torch.cuda.graph_pool_handle()
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.cuda.Stream(device)
        inputs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in dynamic]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = fn(*inputs, *fixed, *static)
            except Exception:  # a Python error (bad arguments): nothing is half-captured
                graph.capture_end()
                return None
            graph.capture_end()  # a CUDA error here propagates: torch's capture state is lost
        single = isinstance(out, torch.Tensor)
        return _Graph(graph, inputs, (out,) if single else tuple(out), single)


graphs = DecodeGraphs()
