"""What aiosnap's DCP writer puts in a ``.distcp`` file for each item: the bytes torch's
``FileSystemReader`` reads back.

A tensor item is a ``torch.save`` archive of one contiguous tensor (what DCP's own writer
makes with ``torch.save(tensor, stream)``), laid out by aiosnap so that the tensor's raw
bytes are one stretch of it: a *prefix* (the pickle and the small records), the raw bytes
(the *payload*), a *suffix* (the last small record, the zip directory). The prefix and
suffix depend only on dtype and shape, so they are made once per shape and written into
the staging slab around the tensor's bytes, which are copied there straight from the
state. A pickled value's item is the ``torch.save`` bytes DCP's planner produced; its
payload is the ``data.pkl`` record inside. Pure code on the writer's thread.
"""

from __future__ import annotations

import functools
import io
import math
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CorruptCheckpointError
from ...format.archive import Record, local_header, zip_directory
from ..torchpickle import contiguous_strides
from ..torchzip import records_in

__all__ = ["BlobLayout", "payload_of_value", "tensor_blob"]

_ARCHIVE = "archive"
_LEGACY = torch.storage._dtype_to_storage_type_map()


@dataclass(frozen=True)
class BlobLayout:
    """A tensor item's archive: ``prefix``, then ``payload_nbytes`` raw bytes, then ``suffix``."""

    prefix: bytes
    payload_nbytes: int
    suffix: bytes

    @property
    def nbytes(self) -> int:
        return len(self.prefix) + self.payload_nbytes + len(self.suffix)


class _StorageStub:
    __slots__ = ("dtype", "numel")

    def __init__(self, dtype: torch.dtype, numel: int) -> None:
        self.dtype = dtype
        self.numel = numel


class _TensorStub:
    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.dtype = dtype
        self.shape = shape


class _Pickler(pickle.Pickler):
    """Pickles a :class:`_TensorStub` as ``torch.save`` pickles a contiguous tensor."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _TensorStub):
            numel = math.prod(obj.shape)
            legacy = _LEGACY.get(obj.dtype)
            stride = contiguous_strides(obj.shape)
            if legacy is None:  # dtypes without a legacy storage class: torch.save's v3 form
                storage = _StorageStub(obj.dtype, numel * obj.dtype.itemsize)
                args: tuple[Any, ...] = (storage, 0, obj.shape, stride, False, OrderedDict(), obj.dtype)
                return torch._utils._rebuild_tensor_v3, args
            storage = _StorageStub(obj.dtype, numel)
            return torch._utils._rebuild_tensor_v2, (storage, 0, obj.shape, stride, False, OrderedDict())
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageStub):
            legacy = _LEGACY.get(obj.dtype)
            kind = torch.UntypedStorage if legacy is None else getattr(torch, legacy)
            return ("storage", kind, "0", "cpu", obj.numel)
        return None


@functools.lru_cache(maxsize=4096)
def tensor_blob(dtype: torch.dtype, shape: tuple[int, ...]) -> BlobLayout:
    """The archive around a contiguous tensor of ``dtype`` and ``shape`` (cached by both)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(_TensorStub(dtype, tuple(shape)))
    nbytes = math.prod(shape) * dtype.itemsize
    head = [
        ("data.pkl", buffer.getvalue()),
        (".format_version", b"1"),
        (".storage_alignment", b"64"),
        ("byteorder", b"little"),
    ]
    out = bytearray()
    records: list[Record] = []
    for name, data in head:
        full = f"{_ARCHIVE}/{name}"
        records.append(Record(full, len(out), len(data)))
        out += local_header(full, len(data), len(out)) + data
    records.append(Record(f"{_ARCHIVE}/data/0", len(out), nbytes))
    out += local_header(f"{_ARCHIVE}/data/0", nbytes, len(out))
    prefix = bytes(out)
    at = len(prefix) + nbytes
    version = f"{_ARCHIVE}/version"
    tail = local_header(version, 2, at) + b"3\n"
    records.append(Record(version, at, 2))
    suffix = tail + zip_directory(records, at + len(tail))
    return BlobLayout(prefix, nbytes, suffix)


def payload_of_value(blob: bytes) -> tuple[int, int]:
    """(offset, size) of the pickle inside the ``torch.save`` bytes of a value (its
    ``data.pkl``, the first record); the whole blob when it cannot be told."""
    try:
        found = records_in(blob, "a value's torch.save bytes").get("data.pkl")
    except CorruptCheckpointError:
        found = None
    return (found.offset, found.nbytes) if found is not None else (0, len(blob))
