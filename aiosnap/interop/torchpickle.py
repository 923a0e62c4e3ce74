"""What a ``torch.save`` pickle (``data.pkl``) says, read with no code run.

:func:`parse_pickle` reads ``data.pkl`` through the allow-list unpickler of
:mod:`aiosnap.interop.pickles`: tensors come back as :class:`TensorRef` (dtype, shape,
strides, storage key and offset), dtypes, sizes and devices as stand-ins, everything else
as plain data; any other global (``os.system``, a class of the user's) is a
:class:`~aiosnap.errors.CorruptCheckpointError`. Pure code, no torch; the records the
storages are in come from :mod:`aiosnap.interop.torchzip`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptCheckpointError
from ..format.dtypes import DTYPE_ITEMSIZE
from .pickles import Record, node_budget, plain_value, unpickle_restricted

__all__ = [
    "ALLOWED",
    "MAX_PICKLE_BYTES",
    "DeviceValue",
    "DtypeValue",
    "PickleValue",
    "SizeValue",
    "StorageRef",
    "TensorRef",
    "contiguous_strides",
    "parse_pickle",
]

MAX_PICKLE_BYTES = 256 * 1024**2
"""A ``data.pkl`` larger than this is refused unread."""


@dataclass(frozen=True)
class StorageRef:
    """A storage named by a persistent id: record ``data/<key>``, of ``dtype`` (None: an
    untyped storage, whose dtype the tensor gives), ``numel`` elements (bytes when untyped)."""

    key: str
    dtype: str | None
    location: str
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a pickle: ``shape`` and ``stride`` (in elements) from ``offset`` (in
    elements) of the storage ``storage``."""

    storage: StorageRef
    dtype: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    @property
    def contiguous(self) -> bool:
        """Its elements are the storage's, row-major, from ``offset`` (what a byte range holds)."""
        return all(
            s == c for s, c, n in zip(self.stride, contiguous_strides(self.shape), self.shape, strict=True) if n > 1
        )


def contiguous_strides(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


_LEGACY = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}  # fmt: skip
_REBUILDS = {"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3"}
_PARAMETER = "torch._utils._rebuild_parameter"
ALLOWED = {
    *_REBUILDS, _PARAMETER, "collections.OrderedDict", "torch.Size", "torch.device", "_codecs.encode",
    "builtins.complex", "torch.storage.UntypedStorage", "torch.UntypedStorage",
    *(f"torch.{name}" for name in _LEGACY), *(f"torch.{name}" for name in DTYPE_ITEMSIZE),
}  # fmt: skip


def _ints(value: Any, where: str, what: str) -> tuple[int, ...]:
    if isinstance(value, Record) and value.qualname == "torch.Size" and len(value.args) == 1:
        value = value.args[0]
    if type(value) not in (tuple, list) or len(value) > 64 or not all(type(v) is int for v in value):
        raise CorruptCheckpointError(f"{where}: a tensor's {what} is not a list of integers")
    if any(not 0 <= v < 2**62 for v in value):
        raise CorruptCheckpointError(f"{where}: a tensor's {what} is out of range")
    return tuple(value)


def _dtype_of(token: Any, where: str) -> str:
    name = getattr(token, "qualname", "")
    if not (isinstance(token, type) and name.startswith("torch.") and name[6:] in DTYPE_ITEMSIZE):
        raise CorruptCheckpointError(f"{where}: {name[:80] or type(token).__name__!r} is not a dtype")
    return name[6:]


class _Parser:
    """Turns the graph of a ``data.pkl`` into plain data with :class:`TensorRef` leaves."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.storages: dict[str, StorageRef] = {}

    def persistent(self, pid: Any) -> StorageRef:
        where = self.where
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
            raise CorruptCheckpointError(f"{where}: a persistent id that is not a storage")
        _, kind, key, location, numel = pid
        name = getattr(kind, "qualname", "")
        if name in ("torch.storage.UntypedStorage", "torch.UntypedStorage"):
            dtype = None
        elif name.startswith("torch.") and name[6:] in _LEGACY:
            dtype = _LEGACY[name[6:]]
        else:
            raise CorruptCheckpointError(f"{where}: storage of unknown kind {name[:80]!r}")
        if type(key) is not str or not 0 < len(key) <= 64 or not key.isalnum() or type(location) is not str:
            raise CorruptCheckpointError(f"{where}: a storage with an invalid key or location")
        if type(numel) is not int or not 0 <= numel < 2**62:
            raise CorruptCheckpointError(f"{where}: a storage of invalid size")
        ref = StorageRef(key, dtype, location[:64], numel)
        known = self.storages.setdefault(key, ref)
        if known != ref:
            raise CorruptCheckpointError(f"{where}: storage {key!r} is described twice, differently")
        return ref

    def leaf(self, value: Any) -> Any:
        where = self.where
        if isinstance(value, type):  # a dtype
            return DtypeValue(_dtype_of(value, where))
        if value.qualname in _REBUILDS:
            return self._tensor(value)
        if value.qualname == _PARAMETER and value.args and isinstance(value.args[0], Record):
            return self._tensor(value.args[0])
        if value.qualname == "torch.Size":
            return SizeValue(_ints(value, where, "size"))
        if value.qualname == "torch.device" and value.args and type(value.args[0]) is str:
            return DeviceValue(value.args[0][:64])
        if value.qualname == "_codecs.encode" and len(value.args) == 2 and type(value.args[0]) is str:
            try:
                return value.args[0].encode(str(value.args[1]))
            except (LookupError, UnicodeError):
                raise CorruptCheckpointError(f"{where}: bytes in an unknown encoding") from None
        if value.qualname == "builtins.complex" and all(type(v) in (int, float) for v in value.args):
            return complex(*value.args[:2])
        raise CorruptCheckpointError(f"{where}: holds {value.qualname[:100]!r} where plain data was expected")

    def _tensor(self, call: Record) -> TensorRef:
        where = self.where
        args = call.args
        if call.qualname not in _REBUILDS or len(args) < 6 or not isinstance(args[0], StorageRef):
            raise CorruptCheckpointError(f"{where}: a tensor that is not rebuilt from a storage")
        storage, offset = args[0], args[1]
        shape, stride = _ints(args[2], where, "shape"), _ints(args[3], where, "stride")
        if call.qualname.endswith("v3"):
            dtype = _dtype_of(args[6] if len(args) > 6 else None, where)
            if storage.dtype is not None:
                raise CorruptCheckpointError(f"{where}: a typed storage rebuilt as untyped")
            elements = storage.numel // DTYPE_ITEMSIZE[dtype]
        else:
            if storage.dtype is None:
                raise CorruptCheckpointError(f"{where}: an untyped storage without a dtype")
            dtype, elements = storage.dtype, storage.numel
        if type(offset) is not int or len(shape) != len(stride) or not 0 <= offset < 2**62:
            raise CorruptCheckpointError(f"{where}: a tensor with an invalid offset or strides")
        if len(args) > 6 + call.qualname.endswith("v3") and args[-1]:  # conj / neg bits
            raise CorruptCheckpointError(f"{where}: a conjugate or negative view (not read here)")
        last = offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else offset - 1
        if last >= elements:
            raise CorruptCheckpointError(f"{where}: a tensor reaches past the end of its storage")
        return TensorRef(storage, dtype, offset, shape, stride)


@dataclass(frozen=True)
class DtypeValue:
    name: str


@dataclass(frozen=True)
class SizeValue:
    items: tuple[int, ...]


@dataclass(frozen=True)
class DeviceValue:
    name: str


PickleValue = DtypeValue | SizeValue | DeviceValue
"""The non-plain leaves a ``data.pkl`` may hold besides tensors: a dtype, a ``torch.Size``,
a device (``.name``/``.items`` give their values)."""


def parse_pickle(data: bytes, where: str) -> tuple[Any, dict[str, StorageRef]]:
    """The object of a ``data.pkl``: plain data whose tensors are :class:`TensorRef` (and
    dtypes, sizes, devices stand-ins with a ``name`` or ``items``), and the storages it
    names by key. CorruptCheckpointError for anything else."""
    parser = _Parser(where)
    graph = unpickle_restricted(data, ALLOWED, where, persistent=parser.persistent, limit=MAX_PICKLE_BYTES)
    value = plain_value(graph, where, parser.leaf, budget=node_budget(len(data)))
    return value, parser.storages
