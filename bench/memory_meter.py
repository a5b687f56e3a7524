"""What a torch function allocates and moves, counted op by op on any device, fake tensors
included (so a DeepSeek-V3-sized call can be measured on a CPU without its memory).

:class:`MemoryMeter` is a ``TorchDispatchMode``: every aten op's outputs whose storage is
new are counted as allocated until their last tensor is gone (a weak reference on each
tensor that shares the storage), which gives the **peak transient bytes** of the call;
every op's input and output bytes add up to the **bytes moved** (what each op reads and
writes, an upper bound of the memory traffic: views move nothing, a gather reads what it
gathers; a grouped GEMM counts its whole weight stack, the experts without rows too).
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ops that read only the elements they gather: counted as their output, read and written
_GATHERS = {torch.ops.aten.index, torch.ops.aten.index_select, torch.ops.aten.gather,
            torch.ops.aten.embedding}


def _storage_key(t: torch.Tensor) -> int:
    """The storage's identity (its C++ object), shared by every view of it."""
    return t.untyped_storage()._cdata


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MemoryMeter(TorchDispatchMode):
    """``peak``: the most bytes of new storages alive at once; ``moved``: the bytes the
    ops read and wrote; ``allocated``: the bytes of every new storage."""

    def __init__(self):
        super().__init__()
        self.live: dict = {}      # storage key -> [bytes, live tensors]
        self.current = self.peak = self.moved = self.allocated = 0
        self.seen: set = set()    # storages that existed before (inputs)
        self.by_op: dict = {}     # op -> bytes moved

    def _release(self, key):
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def _track(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key in self.seen and key not in self.live:
            return
        if key not in self.live:
            size = t.untyped_storage().nbytes()
            self.live[key] = [size, 0]
            self.current += size
            self.allocated += size
            self.peak = max(self.peak, self.current)
        self.live[key][1] += 1
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        for t in inputs:
            key = _storage_key(t)
            if key not in self.live:
                self.seen.add(key)
        out = func(*args, **kwargs)
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if outputs and not getattr(func, "is_view", False):  # not metadata, not a view
            if func.overloadpacket in _GATHERS:  # reads what it gathers, not its source
                moved = 2 * sum(_nbytes(o) for o in outputs) + sum(
                    _nbytes(t) for t in inputs[1:])
            else:
                moved = sum(_nbytes(t) for t in inputs) + sum(_nbytes(o) for o in outputs)
            self.moved += moved
            name = str(func.overloadpacket)
            self.by_op[name] = self.by_op.get(name, 0) + moved
        for o in outputs:
            self._track(o)
        return out
