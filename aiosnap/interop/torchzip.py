"""Reading a ``torch.save`` archive without ``torch.load``: where each record's bytes are,
and what its pickle says, with no code run.

``torch.save`` writes a zip of *stored* records: ``<archive>/data.pkl`` (the object, its
tensors named by persistent ids ``('storage', <storage class>, key, location, numel)``),
``<archive>/data/<key>`` (each storage's raw bytes) and a few small ones. A DCP ``.distcp``
file holds one such archive per tensor item (and per pickled value). Both are untrusted:

- :func:`zip_records` finds the records of an archive at a byte range of a stored object
  (the end record, zip64 where needed, the central directory, each local header), every
  offset and size checked against the range; compressed or encrypted records are refused.
- :func:`parse_pickle` reads ``data.pkl`` through the allow-list unpickler of
  :mod:`aiosnap.interop.pickles`: tensors come back as :class:`TensorRef` (dtype, shape,
  strides, storage key and offset), everything else as plain data; any other global
  (``os.system``, a class of the user's) is a CorruptCheckpointError.

Async helpers run on the caller's loop and read through a
:class:`~aiosnap.storage.base.Storage`; the parsers are pure code. No torch.
"""

from __future__ import annotations

import asyncio
import math
import struct
from dataclasses import dataclass
from typing import Any

from ..core.aio import run_all
from ..errors import CorruptCheckpointError, TruncatedObjectError
from ..format.dtypes import DTYPE_ITEMSIZE
from ..storage.base import Storage
from .pickles import Record, plain_value, unpickle_restricted

__all__ = [
    "ALLOWED",
    "DeviceValue",
    "DtypeValue",
    "MAX_PICKLE_BYTES",
    "PickleValue",
    "SizeValue",
    "StorageRef",
    "TensorRef",
    "ZipRecord",
    "contiguous_strides",
    "leading_records",
    "parse_pickle",
    "read_range",
    "records_in",
    "zip_records",
]

MAX_PICKLE_BYTES = 256 * 1024**2
"""A ``data.pkl`` larger than this is refused unread."""
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR = struct.Struct("<IIQI")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_EOCD_SIG, _EOCD64_SIG, _LOCATOR_SIG = 0x06054B50, 0x06064B50, 0x07064B50
_CENTRAL_SIG, _LOCAL_SIG = 0x02014B50, 0x04034B50
_U32, _U16 = 0xFFFFFFFF, 0xFFFF
_MAX_TAIL = _EOCD.size + _U16  # the end record and the longest comment
_MAX_RECORDS = 10_000_000
_MAX_DIRECTORY = 2 * 1024**3


@dataclass(frozen=True)
class ZipRecord:
    """A stored record: its name and where its bytes are in the *object* (not the archive)."""

    name: str
    offset: int
    nbytes: int


async def read_range(storage: Storage, name: str, offset: int, nbytes: int, where: str) -> bytes:
    """``nbytes`` at ``offset`` of object ``name``, all of them or TruncatedObjectError."""
    buffer = bytearray(nbytes)
    try:
        got = await storage.read_into(name, offset, memoryview(buffer))
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{where}: {name!r} is missing") from exc
    if got < nbytes:
        raise TruncatedObjectError(f"{where}: {name!r} ends at {offset + got}, before byte {offset + nbytes}")
    return bytes(buffer)


def _end_record(tail: bytes, length: int, where: str) -> tuple[int, int, int]:
    """(record count, central directory size, its offset in the archive) from the archive's
    last ``len(tail)`` bytes."""
    found = len(tail) - _EOCD.size
    while found >= 0:
        found = tail.rfind(struct.pack("<I", _EOCD_SIG), 0, found + 4)
        if found < 0:
            break
        if found + _EOCD.size + _EOCD.unpack_from(tail, found)[7] == len(tail):  # its comment ends the archive
            break
        found -= 1
    if found < 0:
        raise CorruptCheckpointError(f"{where}: not a zip archive (no end record)")
    _, disk, _, _, count, size, offset, _ = _EOCD.unpack_from(tail, found)
    if disk != 0:
        raise CorruptCheckpointError(f"{where}: a multi-disk zip archive")
    if _U32 in (size, offset) or count == _U16:
        at = found - _LOCATOR.size
        if at < 0 or _LOCATOR.unpack_from(tail, at)[0] != _LOCATOR_SIG:
            raise CorruptCheckpointError(f"{where}: a zip64 archive without its locator")
        end64 = _LOCATOR.unpack_from(tail, at)[2]
        start = len(tail) - length  # where the archive starts, relative to the tail
        position = end64 + start
        if not 0 <= position <= len(tail) - _EOCD64.size:
            raise CorruptCheckpointError(f"{where}: the zip64 end record lies outside the archive's end")
        sig, _, _, _, _, _, _, count, size, offset = _EOCD64.unpack_from(tail, position)
        if sig != _EOCD64_SIG:
            raise CorruptCheckpointError(f"{where}: a damaged zip64 end record")
    if not 0 <= count <= _MAX_RECORDS or size > _MAX_DIRECTORY or offset + size > length:
        raise CorruptCheckpointError(
            f"{where}: a zip directory of {count} records at {offset}+{size} in {length} bytes"
        )
    return count, size, offset


def _directory(data: bytes, count: int, where: str) -> list[tuple[str, int, int]]:
    """(name, local header offset, size) of each record of a central directory."""
    found = []
    position = 0
    for _ in range(count):
        if position + _CENTRAL.size > len(data):
            raise CorruptCheckpointError(f"{where}: the zip directory ends early")
        fields = _CENTRAL.unpack_from(data, position)
        sig, flags, method, csize, usize = fields[0], fields[3], fields[4], fields[8], fields[9]
        name_len, extra_len, comment_len, local = fields[10], fields[11], fields[12], fields[16]
        if sig != _CENTRAL_SIG:
            raise CorruptCheckpointError(f"{where}: a damaged zip directory entry")
        start = position + _CENTRAL.size
        name_bytes = data[start : start + name_len]
        extra = data[start + name_len : start + name_len + extra_len]
        position = start + name_len + extra_len + comment_len
        if position > len(data):
            raise CorruptCheckpointError(f"{where}: the zip directory ends early")
        if method != 0 or flags & 0x41:  # compressed or encrypted
            raise CorruptCheckpointError(f"{where}: record {name_bytes[:100]!r} is compressed or encrypted")
        wanted = [v for v, is_max in ((usize, usize == _U32), (csize, csize == _U32), (local, local == _U32)) if is_max]
        if wanted:
            values = _zip64_values(extra, len(wanted), where)
            usize = values.pop(0) if usize == _U32 else usize
            csize = values.pop(0) if csize == _U32 else csize
            local = values.pop(0) if local == _U32 else local
        if csize != usize:
            raise CorruptCheckpointError(f"{where}: record {name_bytes[:100]!r} is not stored")
        try:
            name = name_bytes.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptCheckpointError(f"{where}: a record name that is not UTF-8") from None
        found.append((name, local, usize))
    return found


def _zip64_values(extra: bytes, count: int, where: str) -> list[int]:
    position = 0
    while position + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, position)
        if tag == 0x0001:
            if size < 8 * count or position + 4 + size > len(extra):
                break
            return list(struct.unpack_from(f"<{count}Q", extra, position + 4))
        position += 4 + size
    raise CorruptCheckpointError(f"{where}: a zip64 record without its sizes")


async def zip_records(
    storage: Storage, name: str, start: int, length: int, where: str, *, wanted: set[str] | None = None
) -> dict[str, ZipRecord]:
    """The records (those named in ``wanted``, by their name after the archive's folder,
    such as ``data.pkl``; all when None) of the zip archive at bytes ``[start, start +
    length)`` of object ``name``, each checked to lie inside that range."""
    if length < _EOCD.size:
        raise CorruptCheckpointError(f"{where}: {length} bytes is too short for a zip archive")
    tail_size = min(length, _MAX_TAIL)
    tail = await read_range(storage, name, start + length - tail_size, tail_size, where)
    count, size, offset = _end_record(tail, length, where)
    if offset >= length - tail_size:  # the directory is in the tail already (the usual case)
        directory = tail[offset - (length - tail_size) : offset - (length - tail_size) + size]
    else:
        directory = await read_range(storage, name, start + offset, size, where)
    entries = _directory(directory, count, where)
    picked: list[tuple[str, int, int]] = []
    for full, local, nbytes in entries:
        short = full.split("/", 1)[1] if "/" in full else full
        if wanted is None or short in wanted:
            picked.append((short, local, nbytes))
    found: dict[str, ZipRecord] = {}
    limit = asyncio.Semaphore(16)

    async def locate(short: str, local: int, nbytes: int) -> None:
        if local + _LOCAL.size > length:
            raise CorruptCheckpointError(f"{where}: record {short[:100]!r} lies outside the archive")
        async with limit:
            head = await read_range(storage, name, start + local, _LOCAL.size, where)
        _add(found, short, local, nbytes, head, start, length, where)

    await run_all(locate(*item) for item in picked)
    return found


def _add(
    found: dict[str, ZipRecord], short: str, local: int, nbytes: int, head: bytes, start: int, length: int, where: str
) -> None:
    """Record ``short`` from its local header ``head`` (at ``local`` of the archive)."""
    sig, _, flags, method, *_, name_len, extra_len = _LOCAL.unpack_from(head)
    if sig != _LOCAL_SIG or method != 0 or flags & 0x41:
        raise CorruptCheckpointError(f"{where}: a damaged local header for record {short[:100]!r}")
    data_at = local + _LOCAL.size + name_len + extra_len
    if data_at + nbytes > length:
        raise CorruptCheckpointError(f"{where}: record {short[:100]!r} runs past the archive's end")
    if short in found:
        raise CorruptCheckpointError(f"{where}: record {short[:100]!r} is there twice")
    found[short] = ZipRecord(short, start + data_at, nbytes)


def records_in(archive: bytes, where: str) -> dict[str, ZipRecord]:
    """The records of a ``torch.save`` archive held in memory (offsets in ``archive``)."""
    length = len(archive)
    if length < _EOCD.size:
        raise CorruptCheckpointError(f"{where}: {length} bytes is too short for a zip archive")
    count, size, offset = _end_record(archive[-_MAX_TAIL:], length, where)
    found: dict[str, ZipRecord] = {}
    for full, local, nbytes in _directory(archive[offset : offset + size], count, where):
        if local + _LOCAL.size > length:
            raise CorruptCheckpointError(f"{where}: a record lies outside the archive")
        short = full.split("/", 1)[1] if "/" in full else full
        _add(found, short, local, nbytes, archive[local : local + _LOCAL.size], 0, length, where)
    return found


def leading_records(window: bytes, start: int, length: int) -> dict[str, ZipRecord]:
    """The records whose local headers lie one after the other from the start of an
    archive, as far as ``window`` (its first bytes; the archive is ``length`` bytes at
    ``start`` of its object) shows them whole: a cheap look at a small ``torch.save`` blob
    (``data.pkl`` comes first) before the central directory. Anything odd stops the walk
    (the caller falls back to :func:`zip_records`)."""
    found: dict[str, ZipRecord] = {}
    position = 0
    while position + _LOCAL.size <= len(window):
        sig, _, flags, method, _, _, _, csize, usize, name_len, extra_len = _LOCAL.unpack_from(window, position)
        if sig != _LOCAL_SIG or method != 0 or flags & 0x49 or csize != usize or usize == _U32:
            break  # not a plain stored record with its size in the header (zip64 ones: the directory)
        data_at = position + _LOCAL.size + name_len + extra_len
        if data_at > len(window) or data_at + usize > length:
            break
        try:
            full = window[position + _LOCAL.size : position + _LOCAL.size + name_len].decode("utf-8")
        except UnicodeDecodeError:
            break
        short = full.split("/", 1)[1] if "/" in full else full
        if short in found:
            break
        found[short] = ZipRecord(short, start + data_at, usize)
        position = data_at + usize
    return found


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
    value = plain_value(graph, where, parser.leaf)
    return value, parser.storages
