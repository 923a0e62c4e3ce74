"""``write_data`` of aiosnap's DCP writer: one rank's items into data files, through slabs
of the RAM budget, uploaded in parallel while the next slab fills.

The items of the rank's final plan are packed, in plan order, into data files of at most
a slab each (``__<rank>_<n>.<save id>.distcp``: names of this attempt only, so that an
overwrite never touches the files an older ``.metadata`` names). For each file, on DCP's
calling thread: a slab is taken (waiting while all are lent), every item's bytes are put
in it (a tensor's archive prefix, its values copied from the state -- from the GPU too --
and its suffix; a value's ``torch.save`` bytes), the crc32c of every item and payload
comes from one pass (:class:`~aiosnap.core.checksums.RangeChecksums`), and the file goes
to the loop thread to be written (S3: parallel multipart, retries, per-part CRC32C) while
the next slab fills. A file larger than a slab (a pickled value that large) is written from
its own buffer. If anything fails, the files this call wrote are removed (nothing names
them yet) and the first error is raised with its own type.
"""

from __future__ import annotations

import concurrent.futures
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ...core.checksums import RangeChecksums
from ...storage.base import Storage
from .blobs import BlobLayout, payload_of_value, tensor_blob
from .runtime import Runtime, SlabPool
from .tiles import Tile

__all__ = ["WrittenItem", "data_file_name", "write_items"]

log = logging.getLogger("aiosnap")


def data_file_name(rank: int, index: int, save_id: str) -> str:
    return f"__{rank}_{index}.{save_id}.distcp"


@dataclass(frozen=True)
class WrittenItem:
    """Where one item went, with its checksums (a WriteResult's ``storage_data``: it
    crosses to the coordinator, which makes DCP's ``_StorageInfo`` of it for ``.metadata``
    and the checksums file of the rest)."""

    relative_path: str
    offset: int
    length: int
    crc32c: int
    payload_offset: int
    payload_nbytes: int
    payload_crc32c: int


@dataclass
class _Item:
    item: WriteItem
    nbytes: int
    layout: BlobLayout | None = None  # a tensor's archive
    data: bytes | None = None  # a value's torch.save bytes
    payload: tuple[int, int] = (0, 0)  # (offset in the item, size)


@dataclass
class _File:
    name: str
    items: list[tuple[int, _Item]] = field(default_factory=list)  # (offset in the file, item)
    nbytes: int = 0


def _pack(items: list[_Item], slab_bytes: int, rank: int, save_id: str) -> list[_File]:
    files: list[_File] = []
    current: _File | None = None
    for entry in items:
        if current is None or current.nbytes + entry.nbytes > slab_bytes:
            current = _File(data_file_name(rank, len(files), save_id))
            files.append(current)
        current.items.append((current.nbytes, entry))
        current.nbytes += entry.nbytes
    return files


class _Sources:
    """The planner's tensors, each resolved once however many tiles it has (DCP's
    ``resolve_data`` may allocate: it is called lazily, and let go after its last tile)."""

    def __init__(self, planner: SavePlanner, tiles: dict[MetadataIndex, Tile], items: list[WriteItem]) -> None:
        self.planner = planner
        self.tiles = tiles
        self.left: dict[MetadataIndex, int] = {}
        for item in items:
            source = tiles[item.index].item.index if item.index in tiles else item.index
            self.left[source] = self.left.get(source, 0) + 1
        self.resolved: dict[MetadataIndex, torch.Tensor] = {}

    def tensor(self, item: WriteItem) -> torch.Tensor:
        tile = self.tiles.get(item.index)
        source = tile.item if tile is not None else item
        tensor = self.resolved.get(source.index)
        if tensor is None:
            resolved = self.planner.resolve_data(source)
            assert isinstance(resolved, torch.Tensor)
            tensor = resolved.detach()
        self.left[source.index] -= 1
        if self.left[source.index]:
            self.resolved[source.index] = tensor
        else:
            self.resolved.pop(source.index, None)
        if tile is not None:
            for dim, (offset, size) in enumerate(zip(tile.offsets, tile.sizes, strict=True)):
                tensor = tensor.narrow(dim, offset, size)
        return tensor


def _describe(items: list[WriteItem], planner: SavePlanner) -> list[_Item]:
    found = []
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            value = planner.resolve_data(item)
            data = value.getvalue() if isinstance(value, io.BytesIO) else bytes(value)
            found.append(_Item(item, len(data), data=data, payload=payload_of_value(data)))
        else:
            assert item.tensor_data is not None
            layout = tensor_blob(item.tensor_data.properties.dtype, tuple(item.tensor_data.chunk.sizes))
            found.append(_Item(item, layout.nbytes, layout=layout, payload=(len(layout.prefix), layout.payload_nbytes)))
    return found


def _fill(view: memoryview, file: _File, sources: _Sources) -> list[int]:
    """Put every item of ``file`` into ``view``; the item and payload boundaries."""
    cuts = []
    for at, entry in file.items:
        start, size = entry.payload
        cuts += [at, at + entry.nbytes, at + start, at + start + size]
        if entry.data is not None:
            view[at : at + entry.nbytes] = entry.data
            continue
        assert entry.layout is not None
        layout = entry.layout
        view[at : at + len(layout.prefix)] = layout.prefix
        end = at + len(layout.prefix) + layout.payload_nbytes
        view[end : end + len(layout.suffix)] = layout.suffix
        source = sources.tensor(entry.item)
        if layout.payload_nbytes:
            dest = torch.frombuffer(view[at + len(layout.prefix) : end], dtype=source.dtype).view(source.shape)
            with torch.no_grad():
                dest.copy_(source)
    return cuts


def _results(file: _File, checksums: RangeChecksums) -> list[WriteResult]:
    found = []
    for at, entry in file.items:
        start, size = entry.payload
        written = WrittenItem(
            file.name, at, entry.nbytes, checksums.of(at, at + entry.nbytes),
            at + start, size, checksums.of(at + start, at + start + size),
        )  # fmt: skip
        found.append(WriteResult(index=entry.item.index, size_in_bytes=entry.nbytes, storage_data=written))
    return found


def write_items(
    items: list[WriteItem],
    tiles: dict[MetadataIndex, Tile],
    planner: SavePlanner,
    storage: Storage,
    runtime: Runtime,
    pool: SlabPool,
    *,
    rank: int,
    save_id: str,
    concurrency: int,
    progress: Callable[[int], None] | None = None,
) -> list[WriteResult]:
    """Write one rank's ``items`` (see the module); blocks the calling thread until every
    file is written. Returns a WriteResult per item."""
    files = _pack(_describe(items, planner), pool.slab_bytes, rank, save_id)
    sources = _Sources(planner, tiles, items)
    results: list[WriteResult] = []
    pending: list[concurrent.futures.Future[None]] = []
    written: list[str] = []
    try:
        for file in files:
            while len(running := [f for f in pending if not f.done()]) >= concurrency:
                concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            _raise_first(pending)
            if file.nbytes > pool.slab_bytes:  # one value larger than a slab
                buffer = memoryview(bytearray(file.nbytes))
                checksums = RangeChecksums(buffer, _fill(buffer, file, sources))
                pending.append(runtime.loop.submit(storage.write_checksummed(file.name, buffer, checksums)))
            else:
                slab = runtime.run(pool.acquire(), abandoned=pool.release)  # interrupted: the slab goes back
                try:
                    view = pool.view(slab, file.nbytes)
                    checksums = RangeChecksums(view, _fill(view, file, sources))
                    lease = pool.lease(slab, file.nbytes)
                except BaseException:
                    pool.release(slab)
                    raise
                assert lease.view is not None
                future = runtime.loop.submit(storage.write_checksummed(file.name, lease.view, checksums))
                future.add_done_callback(lambda _, s=slab, lease=lease: pool.release(s, lease))  # type: ignore[misc]
                pending.append(future)
            written.append(file.name)
            results += _results(file, checksums)
            if progress is not None:
                progress(file.nbytes)
        concurrent.futures.wait(pending)
        _raise_first(pending)
    except BaseException:
        for future in pending:
            future.cancel()
        concurrent.futures.wait(pending)
        _remove(storage, runtime, written)
        raise
    return results


def _raise_first(pending: list[concurrent.futures.Future[None]]) -> None:
    for future in pending:
        if future.done() and not future.cancelled() and future.exception() is not None:
            error = future.exception()
            assert error is not None
            raise error


def _remove(storage: Storage, runtime: Runtime, names: list[str]) -> None:
    """Best effort: the files of a failed ``write_data`` (no ``.metadata`` names them).
    On an object store a request abandoned mid-way may still land: what is left is never
    part of a checkpoint (its names are this attempt's alone)."""

    async def remove() -> None:
        for name in names:
            try:
                await storage.delete(name)
            except Exception as exc:  # the store is down: nothing names these files
                log.warning("aiosnap: could not remove %s of a failed DCP save: %s", name, exc)
                return

    try:
        runtime.run(remove())
    except Exception as exc:
        log.warning("aiosnap: could not clean up a failed DCP save: %s", exc)
