"""Reading a ``torch.save`` archive without ``torch.load``: where each record's bytes are
(what its pickle says: :mod:`aiosnap.interop.torchpickle`).

``torch.save`` writes a zip of *stored* records: ``<archive>/data.pkl`` (the object, its
tensors named by persistent ids ``('storage', <storage class>, key, location, numel)``),
``<archive>/data/<key>`` (each storage's raw bytes) and a few small ones. A DCP ``.distcp``
file holds one such archive per tensor item (and per pickled value). Both are untrusted:

- :func:`zip_records` finds the records of an archive at a byte range of a stored object
  (the end record, zip64 where needed, the central directory, each local header), every
  offset and size checked against the range; compressed or encrypted records are refused.

Async helpers run on the caller's loop and read through a
:class:`~aiosnap.storage.base.Storage`; the parsers are pure code. No torch.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

from ..core.aio import run_all
from ..errors import CorruptCheckpointError, TruncatedObjectError
from ..storage.base import Storage

__all__ = ["ZipRecord", "leading_records", "read_range", "records_in", "zip_records"]

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
