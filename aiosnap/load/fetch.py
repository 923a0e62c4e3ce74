"""Load-side I/O: read every byte range of a manifest into fresh tensors and verify it.

Runs on the background loop thread; reads are concurrent (``upload.concurrency``), each
range goes straight into its tensor's memory, and its crc32c is checked in the default
executor. Nothing of the caller's state is touched here: the tensors are new, so a corrupt
checkpoint is refused before any object is modified.
"""

from __future__ import annotations

import asyncio

import torch

from ..checksums import crc32c_of
from ..errors import ChecksumMismatchError, CorruptCheckpointError, TruncatedObjectError, first_error
from ..format.manifest import ByteRange, Manifest
from ..storage.base import Storage
from ..tensorio import bytes_view
from .decode import torch_dtype

__all__ = ["fetch_entries"]


def _empty_for(manifest: Manifest, index: int) -> torch.Tensor:
    entry = manifest.entries[index]
    try:
        if entry.kind == "pickle":
            return torch.empty(entry.nbytes, dtype=torch.uint8)
        return torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
    except RuntimeError as exc:  # cannot allocate: refuse the checkpoint, not crash the caller
        raise CorruptCheckpointError(f"step {manifest.step}: cannot allocate {entry.path!r}: {exc}") from exc


async def _read_range(
    storage: Storage, where: str, path: str, r: ByteRange, dest: memoryview, limit: asyncio.Semaphore
) -> None:
    async with limit:
        try:
            got = await storage.read_into(r.object, r.offset, dest)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{where}: data object {r.object!r} of {path!r} is missing") from exc
        if got < len(dest):
            raise TruncatedObjectError(
                f"{where}: data object {r.object!r} is truncated: {path!r} needs {r.nbytes} bytes "
                f"at offset {r.offset}, only {got} there"
            )
        crc = await asyncio.to_thread(crc32c_of, dest)
    if crc != r.crc32c:
        raise ChecksumMismatchError(
            f"{where}: checksum mismatch in {path!r} (object {r.object!r}, offset {r.offset}): "
            f"crc32c {crc:#010x}, manifest says {r.crc32c:#010x}"
        )


async def check_object_sizes(storage: Storage, manifest: Manifest, concurrency: int) -> None:
    """Every data object is there with the size the manifest gives, before anything is
    allocated for it (a hostile manifest cannot make a load allocate more than is stored)."""
    where = f"{storage.url} step {manifest.step}"
    limit = asyncio.Semaphore(concurrency)

    async def check(name: str, nbytes: int) -> None:
        async with limit:
            try:
                size = await storage.size(name)
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(f"{where}: data object {name!r} is missing") from exc
        if size < nbytes:
            raise TruncatedObjectError(f"{where}: data object {name!r} is truncated: {size} of {nbytes} bytes")

    try:
        async with asyncio.TaskGroup() as group:
            for obj in manifest.objects:
                group.create_task(check(obj.name, obj.nbytes))
    except BaseExceptionGroup as group_error:
        raise (leaf := first_error(group_error)) from leaf.__cause__


async def fetch_entries(storage: Storage, manifest: Manifest, concurrency: int) -> dict[int, torch.Tensor]:
    """Every entry of ``manifest`` as a new CPU tensor (pickles as uint8 bytes), verified."""
    where = f"{storage.url} step {manifest.step}"
    await check_object_sizes(storage, manifest, concurrency)
    limit = asyncio.Semaphore(concurrency)
    tensors: dict[int, torch.Tensor] = {}
    try:
        async with asyncio.TaskGroup() as group:
            for index, entry in enumerate(manifest.entries):
                tensor = _empty_for(manifest, index)
                tensors[index] = tensor
                view = bytes_view(tensor)
                position = 0
                for r in entry.ranges:
                    group.create_task(
                        _read_range(storage, where, entry.path, r, view[position : position + r.nbytes], limit)
                    )
                    position += r.nbytes
    except BaseExceptionGroup as group_error:
        raise (leaf := first_error(group_error)) from leaf.__cause__
    return tensors
