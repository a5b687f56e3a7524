"""A safetensors file read through an open descriptor, without a memory map.

safetensors' own reader maps the whole file, so a file cut short while it is mapped
(another process rewriting the checkpoint, a ``cp`` over a shard) turns the next read
of a page past the new end into SIGBUS, which kills the process.  :class:`ShardFile`
reads the header and each tensor with ``pread`` on the descriptor the checkpoint reader
opened and checked (:meth:`ts_moe.checkpoint._Checkpoint.safetensors`): a file cut short
is a short read, a ValueError naming the file.  It offers what the loaders use of
``safe_open``: :meth:`~ShardFile.keys`, :meth:`~ShardFile.get_slice` (``get_shape()``,
``get_dtype()``, and rows ``[start:stop]`` of the first dim) and
:meth:`~ShardFile.get_tensor`.

The header is checked as safetensors checks it before any tensor is read: 8 bytes of
little-endian length, at most :data:`HEADER_LIMIT` bytes of a JSON object, each
tensor's dtype one of :data:`BITS`, its shape non-negative ints and its
``data_offsets`` the bytes of that shape, the tensors' data back to back and filling
the rest of the file.  Anything else is a ValueError saying the file is not a valid
safetensors file and why.
"""

import json
import math
import os
from typing import NamedTuple

import torch

HEADER_LIMIT = 100_000_000  # safetensors' own bound on a header
_LENGTH = 8  # the header's length field
# bits per element of each dtype of the format (safetensors' Dtype), and its torch dtype
BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
        "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
        "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
TORCH_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
                "F8_E5M2": torch.float8_e5m2, "F8_E4M3": torch.float8_e4m3fn,
                "F8_E8M0": torch.float8_e8m0fnu, "I16": torch.int16, "U16": torch.uint16,
                "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
                "U32": torch.uint32, "F32": torch.float32, "C64": torch.complex64,
                "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64}


class _Entry(NamedTuple):
    """A tensor of the header: its dtype's name, shape, and where its bytes start in the file."""

    dtype: str
    shape: tuple
    start: int


class ShardFile:
    """The safetensors file open at ``fd`` (the caller keeps it open while this is
    used, and closes it), named ``name`` in errors; tensors are read onto ``device``.
    ``what`` says who named the file (an index entry), for a header error."""

    def __init__(self, fd: int, name: str, what: str, device: str = "cpu"):
        self.fd, self.name, self.device = fd, name, device
        self._entries = self._header(what)

    def _invalid(self, what: str, why: str) -> ValueError:
        return ValueError(f"{what}: {self.name!r} is not a valid safetensors file ({why})")

    def _header(self, what: str) -> dict[str, _Entry]:
        size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, _LENGTH, 0)
        if len(head) < _LENGTH:
            raise self._invalid(what, f"{size} bytes: too short for the header's 8-byte length")
        length = int.from_bytes(head, "little")
        if length > HEADER_LIMIT or _LENGTH + length > size:
            raise self._invalid(what, f"a header of {length} bytes, in a file of {size} "
                                      f"(at most {HEADER_LIMIT})")
        text = self._read_bytes(_LENGTH, length, "the header")
        try:
            header = json.loads(text)
        except RecursionError:
            raise self._invalid(what, "the header is nested too deeply to parse") from None
        except ValueError as exc:  # bad JSON or UTF-8
            raise self._invalid(what, f"the header is not valid JSON: {exc}") from None
        if not isinstance(header, dict):
            raise self._invalid(what, "the header is not a JSON object")
        entries, spans = {}, []
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype, shape, offsets = _fields(info)
            nbits = BITS.get(dtype)
            if nbits is None or shape is None or offsets is None:
                raise self._invalid(what, f"the header's entry {key!r} is not a dtype of the "
                                          f"format, a shape and two data offsets: "
                                          f"{repr(info)[:200]}")
            begin, end = offsets
            bits = math.prod(shape) * nbits
            if end < begin or bits % 8 or end - begin != bits // 8:
                raise self._invalid(what, f"tensor {key!r}: data_offsets {list(offsets)} do not "
                                          f"hold {dtype} of shape {list(shape)}")
            entries[key] = _Entry(dtype, shape, _LENGTH + length + begin)
            spans.append((begin, end, key))
        data, at = size - _LENGTH - length, 0
        for begin, end, key in sorted(spans):
            if begin != at:
                raise self._invalid(what, f"tensor {key!r} starts at byte {begin} of the data, "
                                          f"not at {at}, where the one before it ends")
            at = end
        if at != data:
            raise self._invalid(what, f"the tensors hold {at} bytes of data, the file {data}")
        return entries

    def _read_bytes(self, offset: int, nbytes: int, what: str) -> bytearray:
        out = bytearray(nbytes)
        self._read_into(memoryview(out), offset, what)
        return out

    def _read_into(self, buffer: memoryview, offset: int, what: str) -> None:
        """``buffer`` filled from ``offset``, else a ValueError: the file ends early."""
        done = 0
        while done < len(buffer):
            got = os.preadv(self.fd, [buffer[done:]], offset + done)
            if got == 0:
                raise ValueError(f"{self.name!r} ends at byte {offset + done}, before the "
                                 f"{len(buffer)} bytes of {what} from byte {offset} that its "
                                 f"header says it holds (cut short while it was read?)")
            done += got

    def keys(self) -> list[str]:
        return list(self._entries)

    def _entry(self, key: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"{self.name!r} holds no tensor {key!r}")
        return entry

    def get_slice(self, key: str) -> "TensorSlice":
        return TensorSlice(self, key, self._entry(key))

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.get_slice(key)[:]

    def read(self, key: str, entry: _Entry, rows: range) -> torch.Tensor:
        """Rows ``rows`` (a step-1 range of the first dim) of the tensor ``key``."""
        dtype = TORCH_DTYPES.get(entry.dtype)
        if dtype is None:
            raise ValueError(f"{self.name!r}: tensor {key!r} is {entry.dtype}, a dtype ts_moe "
                             f"does not read")
        shape = (len(rows), *entry.shape[1:]) if entry.shape else ()
        row_bytes = math.prod(entry.shape[1:]) * dtype.itemsize
        out = torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8)
        if out.numel():
            self._read_into(memoryview(out.numpy()), entry.start + rows.start * row_bytes,
                            f"tensor {key!r}")
        out = out.view(dtype).reshape(shape)
        return out if self.device == "cpu" else out.to(self.device)


class TensorSlice:
    """A tensor of a :class:`ShardFile`, unread: its shape and dtype from the header,
    and rows of its first dim read on indexing (``[start:stop]``, step 1; ``[:]`` all)."""

    def __init__(self, file: ShardFile, key: str, entry: _Entry):
        self.file, self.key, self.entry = file, key, entry

    def get_shape(self) -> list[int]:
        return list(self.entry.shape)

    def get_dtype(self) -> str:
        return self.entry.dtype

    def __getitem__(self, index) -> torch.Tensor:
        if not isinstance(index, slice):
            raise TypeError(f"rows of {self.key!r} are read by a slice, got {index!r}")
        if not self.entry.shape:
            if index != slice(None):
                raise TypeError(f"{self.key!r} is a scalar: read it whole ([:])")
            return self.file.read(self.key, self.entry, range(1))
        rows = range(self.entry.shape[0])[index]
        if rows.step != 1:
            raise ValueError(f"rows of {self.key!r} are read with step 1, got {index!r}")
        return self.file.read(self.key, self.entry, rows)


def _fields(info) -> tuple:
    """``(dtype, shape, offsets)`` of a header entry, each None where it is malformed."""
    if not isinstance(info, dict):
        return None, None, None
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        dtype = None
    if not (isinstance(shape, list) and all(_count(n) for n in shape)):
        shape = None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets))):
        offsets = None
    return dtype, None if shape is None else tuple(shape), offsets


def _count(value) -> bool:
    """Whether ``value`` is a non-negative JSON integer."""
    return type(value) is int and value >= 0
