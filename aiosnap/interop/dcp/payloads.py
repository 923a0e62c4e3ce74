"""Where the bytes of each item of a DCP checkpoint really are, without ``torch.load``.

DCP's file-system writers store each item as a ``torch.save`` blob at the offset and length
``.metadata`` gives: a tensor chunk's archive holds its raw bytes in a record
``data/<key>``, a value's archive its pickle in ``data.pkl``. :func:`item_payloads` finds,
for every item, the *payload*: the raw bytes (dtype, shape, strides checked against the
metadata) or the pickle, read and decoded when it is plain data. A checkpoint aiosnap
wrote says where its payloads are, with their crc32c, in its checksums file
(:mod:`aiosnap.interop.dcp.checksums`); any other is parsed from its blobs' zip headers and
pickles (:mod:`aiosnap.interop.torchzip`), a small read or two per item, and its payloads
have no checksum. Coroutines on the caller's loop; no torch.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

from ...core.aio import run_all
from ...errors import CorruptCheckpointError, UnsupportedCheckpointError
from ...format.dtypes import DTYPE_ITEMSIZE
from ...storage.base import Storage
from ..torchpickle import TensorRef, parse_pickle
from ..torchzip import ZipRecord, leading_records, read_range, zip_records
from .checksums import ItemChecksums, SaveChecksums, checksums_name, is_aiosnap_save_id
from .metadata import BytesItem, Chunk, DcpMetadata, ItemKey, ItemLocation, TensorItem

__all__ = ["NOT_PLAIN", "Payload", "file_sizes", "item_payloads", "read_checksums"]

HEAD_BYTES = 4096
"""Bytes read from the start of each blob first: ``data.pkl`` and the data record's header
are there for a tensor chunk (a pickle of one tensor is a few hundred bytes)."""
NOT_PLAIN = object()
"""A value whose pickle holds more than plain data (loaded only with ``allow_pickle``)."""


@dataclass(frozen=True)
class Payload:
    """The payload of one item: ``nbytes`` at ``offset`` of ``file``; for a tensor chunk its
    storage as stored (``tensor``: its offset and strides in the storage; None when it is
    the chunk's bytes, contiguous, from ``offset``); for a value its decoded ``value``
    (:data:`NOT_PLAIN` when it is more than plain data, ``why`` saying what). ``crc32c`` of
    the payload and ``item_crc32c`` of the whole item, when the writer recorded them."""

    file: str
    offset: int
    nbytes: int
    crc32c: int | None = None
    item_crc32c: int | None = None
    tensor: TensorRef | None = None
    value: Any = None
    why: str = ""

    @property
    def contiguous(self) -> bool:
        """The payload is the chunk's bytes in row-major order (what a byte range holds)."""
        return self.tensor is None or (self.tensor.contiguous and self.tensor.offset == 0)


async def read_checksums(inner: Storage, meta: DcpMetadata, where: str) -> SaveChecksums | None:
    """aiosnap's checksums of the checkpoint; None for one another writer made. A
    checkpoint aiosnap wrote without them is a CorruptCheckpointError."""
    if not is_aiosnap_save_id(meta.save_id):
        return None
    assert meta.save_id is not None
    name = checksums_name(meta.save_id)
    try:
        data = await inner.read(name, limit=256 * 1024**2)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: written by aiosnap, but its checksums ({name}) are missing") from None
    checksums = SaveChecksums.from_json(data, f"{inner.url}/{name}")
    if checksums.save_id != meta.save_id:
        raise CorruptCheckpointError(f"{where}: its checksums belong to another save ({checksums.save_id})")
    return checksums


def _chunk_nbytes(item: TensorItem, chunk: Chunk) -> int:
    return math.prod(chunk.sizes) * DTYPE_ITEMSIZE[item.dtype]


async def _records(inner: Storage, loc: ItemLocation, wanted: set[str], where: str) -> dict[str, ZipRecord]:
    head = await read_range(inner, loc.relative_path, loc.offset, min(loc.length, HEAD_BYTES), where)
    found = leading_records(head, loc.offset, loc.length)
    if wanted <= set(found):
        return found
    return await zip_records(inner, loc.relative_path, loc.offset, loc.length, where)


async def _pickle_of(inner: Storage, loc: ItemLocation, where: str) -> tuple[ZipRecord, dict[str, ZipRecord], bytes]:
    records = await _records(inner, loc, {"data.pkl"}, where)
    record = records.get("data.pkl")
    if record is None:
        raise CorruptCheckpointError(f"{where}: the item's archive has no data.pkl")
    if record.nbytes > 256 * 1024**2:
        raise CorruptCheckpointError(f"{where}: a pickle of {record.nbytes} bytes is too large")
    return record, records, await read_range(inner, loc.relative_path, record.offset, record.nbytes, where)


async def _tensor_payload(inner: Storage, item: TensorItem, chunk: Chunk, loc: ItemLocation, where: str) -> Payload:
    _, records, data = await _pickle_of(inner, loc, where)
    value, _ = parse_pickle(data, where)
    if not isinstance(value, TensorRef):
        raise CorruptCheckpointError(f"{where}: the item is not a tensor")
    if value.dtype != item.dtype or value.shape != chunk.sizes:
        raise CorruptCheckpointError(
            f"{where}: stored as {value.dtype} of shape {list(value.shape)}, the metadata says {item.dtype} "
            f"of shape {list(chunk.sizes)}"
        )
    record = records.get(f"data/{value.storage.key}")
    if record is None:
        records = await zip_records(inner, loc.relative_path, loc.offset, loc.length, where)
        record = records.get(f"data/{value.storage.key}")
    if record is None:
        raise CorruptCheckpointError(f"{where}: the item's archive lacks the bytes of storage {value.storage.key}")
    itemsize = DTYPE_ITEMSIZE[value.dtype]
    needed = value.storage.numel * (1 if value.storage.dtype is None else itemsize)
    if record.nbytes < needed:
        raise CorruptCheckpointError(f"{where}: storage {value.storage.key} holds {record.nbytes} of {needed} bytes")
    if value.contiguous and value.offset == 0:
        return Payload(loc.relative_path, record.offset, _chunk_nbytes(item, chunk))
    if value.contiguous:
        return Payload(loc.relative_path, record.offset + value.offset * itemsize, _chunk_nbytes(item, chunk))
    return Payload(loc.relative_path, record.offset, needed, tensor=value)  # the storage the view reaches into


async def _value_payload(inner: Storage, loc: ItemLocation, where: str, known: ItemChecksums | None) -> Payload:
    if known is not None:
        _, _, _, item_crc, at, nbytes, crc = known
        data = await read_range(inner, loc.relative_path, at, nbytes, where)
    else:
        record, _, data = await _pickle_of(inner, loc, where)
        at, nbytes, crc, item_crc = record.offset, record.nbytes, None, None
    why = ""
    try:
        value, storages = parse_pickle(data, where)
    except CorruptCheckpointError as exc:
        value, storages, why = NOT_PLAIN, {}, str(exc).removeprefix(f"{where}: ")
    if storages:  # tensors inside a value: read back only as a whole, with allow_pickle
        value, why = NOT_PLAIN, "it holds tensors"
    return Payload(loc.relative_path, at, nbytes, crc, item_crc, value=value, why=why)


def _checked(item: TensorItem, chunk: Chunk, loc: ItemLocation, known: ItemChecksums, where: str) -> Payload:
    _, offset, length, item_crc, at, nbytes, crc = known
    if nbytes != _chunk_nbytes(item, chunk) or not (offset <= at and at + nbytes <= offset + length):
        raise CorruptCheckpointError(
            f"{where}: its checksums give a payload of {nbytes} bytes at {at}, which does not fit"
        )
    return Payload(loc.relative_path, at, nbytes, crc, item_crc)


async def file_sizes(inner: Storage, meta: DcpMetadata, where: str, *, concurrency: int = 16) -> dict[str, int]:
    """The size of every data file ``meta`` names, each item's bytes checked to lie inside
    its file (before anything is read or allocated for them: what a ``.metadata`` or an
    archive claims is bounded by what is really there)."""
    sizes: dict[str, int] = {}
    limit = asyncio.Semaphore(concurrency)

    async def size_of(file: str) -> None:
        async with limit:
            try:
                sizes[file] = await inner.size(file)
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(f"{where}: data file {file!r} is missing") from exc

    await run_all(size_of(f) for f in meta.files)
    for (fqn, _), loc in meta.locations.items():
        if loc.offset + loc.length > sizes[loc.relative_path]:
            raise CorruptCheckpointError(
                f"{where}: {fqn[:200]!r} runs past the end of {loc.relative_path!r} "
                f"(bytes {loc.offset}+{loc.length} of {sizes[loc.relative_path]})"
            )
    return sizes


async def item_payloads(
    inner: Storage, meta: DcpMetadata, where: str, *, concurrency: int = 16, sizes: dict[str, int] | None = None
) -> dict[ItemKey, Payload]:
    """The payload of every item of ``meta`` (the metadata of the checkpoint in ``inner``),
    each item first checked to lie inside its file (:func:`file_sizes`, unless their
    ``sizes`` come from it already)."""
    if sizes is None:
        await file_sizes(inner, meta, where, concurrency=concurrency)
    checksums = await read_checksums(inner, meta, where)
    known = checksums.by_place() if checksums is not None else {}
    limit = asyncio.Semaphore(concurrency)
    found: dict[ItemKey, Payload] = {}

    async def one(key: ItemKey, loc: ItemLocation) -> None:
        fqn, offsets = key
        here = f"{where}: {fqn[:200]!r}" + ("" if offsets is None else f" at {list(offsets)}")
        if loc.transforms:
            raise UnsupportedCheckpointError(
                f"{here} is stored through DCP stream transforms {list(loc.transforms)[:4]!r}, which aiosnap does "
                "not read: load it with torch's FileSystemReader"
            )
        record = known.get((loc.relative_path, loc.offset, loc.length))
        if checksums is not None and record is None:
            raise CorruptCheckpointError(f"{here}: written by aiosnap, but its checksums do not list it")
        item = meta.items[fqn]
        async with limit:
            if isinstance(item, BytesItem):
                found[key] = await _value_payload(inner, loc, here, record)
                return
            chunk = next(c for c in item.chunks if c.offsets == offsets)
            if record is not None:
                found[key] = _checked(item, chunk, loc, record, here)
            else:
                found[key] = await _tensor_payload(inner, item, chunk, loc, here)

    await run_all(one(key, loc) for key, loc in meta.locations.items())
    return found
