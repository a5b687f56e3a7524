"""Helpers shared by the tests (the yardsticks, the recorders, the inputs)."""

import os
import threading
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ts_moe.reference import swiglu, swiglu_backward


def sm90_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or inf anywhere fails."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class OpRecorder(TorchDispatchMode):
    """The names of the operators that run under it."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.name()))
        return func(*args, **(kwargs or {}))


def counts_to_offs(counts):
    """Cumulative row ends (int32, on the GPU) of rows per expert."""
    return torch.cumsum(torch.as_tensor(counts), 0).to(torch.int32).cuda()


def random_counts(m, e, skew=0.0):
    """``m`` rows over ``e`` experts at random; ``skew``: Zipf popularities."""
    w = torch.rand(e) + 1e-3
    if skew:
        w = torch.arange(1, e + 1, dtype=torch.float).pow(-skew)[torch.randperm(e)]
    idx = torch.multinomial(w, m, replacement=True) if m else torch.zeros(0, dtype=torch.long)
    return torch.bincount(idx, minlength=e)


def swiglu_ref(h):
    """fp32 ``silu(g) * u`` of bf16/fp16 ``h`` (the project's reference)."""
    return swiglu(h.float(), torch.float32)


def swiglu_grad_ref(dy, h):
    """fp32 d(SwiGLU)/dh (the project's reference)."""
    return swiglu_backward(dy, h, torch.float32)


# ------------------------------------------- loops: the yardsticks of the routing
def route_loop(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ts_moe.reference.route``, one token at a time in float64 with a Python sort."""
    weights = torch.empty(logits.shape[0], top_k, dtype=torch.float32)
    experts = torch.empty(logits.shape[0], top_k, dtype=torch.int64)
    for t, row in enumerate(logits.double().cpu()):
        p = torch.exp(row - row.max())
        p = (p / p.sum()).tolist()
        chosen = sorted(range(len(p)), key=lambda e: (-row[e].item(), e))[:top_k]
        total = sum(p[e] for e in chosen)
        weights[t] = torch.tensor([p[e] / total for e in chosen])
        experts[t] = torch.tensor(chosen)
    return weights.to(logits.device), experts.to(logits.device)


def permute_loop(x: torch.Tensor, experts: torch.Tensor, num_experts: int):
    """``ts_moe.reference.permute`` by a loop over the experts and their slots;
    the dropped slots (ids outside [0, E)) last, in slot order."""
    from ts_moe.reference import Dispatch

    top_k = experts.shape[1]
    flat = experts.reshape(-1).tolist()
    slots = [s for e in range(num_experts) for s in range(len(flat)) if flat[s] == e]
    slots += [s for s in range(len(flat)) if not 0 <= flat[s] < num_experts]  # dropped
    counts = [sum(1 for v in flat if v == e) for e in range(num_experts)]
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    inverse = torch.empty(len(flat), dtype=torch.int64)
    for row, s in enumerate(slots):
        inverse[s] = row
    x_sorted = torch.stack([x[s // top_k] for s in slots]) if slots else x[:0]
    return Dispatch(x_sorted, offs.to(x.device), inverse.to(x.device))


def combine_loop(y_sorted: torch.Tensor, weights: torch.Tensor,
                 inverse: torch.Tensor) -> torch.Tensor:
    """``ts_moe.reference.combine``, one token and one slot at a time in fp32."""
    tokens, top_k = weights.shape
    out = torch.zeros(tokens, y_sorted.shape[1], dtype=torch.float32, device=y_sorted.device)
    for t in range(tokens):
        for k in range(top_k):
            row = int(inverse[t * top_k + k])
            out[t] += float(weights[t, k]) * y_sorted[row].float()
    return out.to(y_sorted.dtype)


def router_logits_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (T, E): float64 products and sums, one rounding to x's dtype
    (the yardstick of ``ts_moe.ops.router_logits``)."""
    return (x.double() @ weight.double().t()).to(x.dtype)


def fake_route_kernel(launches: list):
    """Stands in for ``route_sm90_launch._route_kernel`` on the CPU: its launches
    append ``(name, per_lane)`` and write the references' results."""
    from ts_moe import reference

    def route_kernel(from_logits, dtype, per_lane=1):
        def launch(logits, weights, experts, token_index, offs, inverse):
            launches.append(("route_slots" if from_logits else "sort_slots", per_lane))
            if from_logits:
                w, ex = reference.route(logits, experts.shape[1])
                weights.copy_(w), experts.copy_(ex)
            for got, want in zip((token_index, offs, inverse),
                                 reference.sort_slots(experts, offs.shape[0])):
                got.copy_(want)
        return launch

    return route_kernel


class FifoWatch:
    """A FIFO at ``path``; a thread opens its write end whenever a reader waits on it,
    so a loader that opens it reads EOF instead of blocking the test forever, and
    ``opened`` says whether anything did."""

    def __init__(self, path):
        os.mkfifo(path)
        self.path, self.opened, self._stop = path, False, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self):
        while not self._stop.is_set():
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader
                time.sleep(0.005)
                continue
            self.opened = True
            os.close(fd)

    def close(self):
        self._stop.set()
        self._thread.join()


def on_path(path, op) -> tuple:
    """One path's backend of op family ``op`` (``ts_moe.ops.paths.TABLE``), as the
    candidates of an op's ``run_*`` that a test forces onto that path."""
    from ts_moe.ops import paths

    return (paths.TABLE[path][op],)


def pairs_on_path(path, fused, split) -> tuple:
    """One path's ``(fused, GEMM)`` backends, as :func:`on_path` for a SwiGLU op."""
    from ts_moe.ops import paths

    return ((paths.TABLE[path][fused], paths.TABLE[path][split]),)


def kernel_package(tmp_path, packages: dict, records: list, op: str | None = None) -> dict:
    """A copy of ``csrc_free_kernels`` under ``tmp_path`` with throwaway families added
    as a new family is (no other module edited): ``packages`` ``{package: {file name:
    text}}``, each package's ``records`` (``(package, NAME)``) imported in
    ``families.py`` and listed first; with ``op``, a new op family (``Op.<op>``) in the
    records' vocabulary.  Returns the environment a child process imports it with."""
    import pathlib
    import shutil

    root = pathlib.Path(__file__).resolve().parent.parent
    pkg = tmp_path / "csrc_free_kernels"
    shutil.copytree(root / "csrc_free_kernels", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for package, files in packages.items():
        (pkg / package).mkdir()
        for name, text in files.items():
            (pkg / package / name).write_text(text)
    families = pkg / "families.py"
    text = families.read_text()
    imports = "".join(f"from .{package} import {name}\n" for package, name in records)
    text = text.replace("from .fp8 import", imports + "from .fp8 import", 1)
    names = "".join(f"{name}, " for _, name in records)
    families.write_text(text.replace("FAMILIES = (", f"FAMILIES = ({names}", 1))
    if op:
        family = pkg / "common" / "family.py"
        last = '    QUANTIZE_FP8 = "quantize_fp8"\n'
        family.write_text(family.read_text().replace(
            last, last + f'    {op.upper()} = "{op}"\n', 1))
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{root}", "PATH": "/usr/bin:/bin",
            "TS_MOE_NO_DISK_CACHE": "1"}
