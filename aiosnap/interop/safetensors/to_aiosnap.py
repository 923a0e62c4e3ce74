"""Importing any checkpoint presented as a Manifest + Storage into an aiosnap root, streamed.

The safetensors -> aiosnap direction of ``aiosnap export --to aiosnap``: every entry's bytes
(a whole tensor; a sharded one consolidated; a pickle as its bytes) are filled by a
:class:`~.consolidate.Consolidator` into data objects of at most ``chunk_bytes``, each
piece's crc32c computed as it is written (a source without checksums gets them here), and
the manifest, checked by the reader's own parser, is committed last by the commit point
saves use (:func:`~aiosnap.catalog.commit.commit_manifest`: only if the step is still
absent). Rank-local values are not imported (a translated folder has none). A failure
removes the attempt's folder, unless the manifest's write had begun: then only once the
step is read back as not this import's (an answer lost after the write landed is a
commit; an undecidable one leaves the data to ``aiosnap gc``). Runs on whichever event loop calls it, holding at most
``concurrency`` data objects in memory.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from ...catalog.commit import commit_manifest, whose_commit
from ...catalog.steps import latest_committed
from ...core.checksums import crc32c_of
from ...core.names import attempt_prefix, manifest_name
from ...errors import StateMismatchError, StepOrderError, first_error
from ...format.manifest import PLAIN_VERSION, ByteRange, DataObject, EntryRecord, Manifest
from ...storage.base import Storage
from .consolidate import Consolidator, RangeCache
from .layout import ExportTensor
from .writer import Segment

__all__ = ["ALIGN", "import_manifest"]

ALIGN = 64


def _whole_tree(node: Any) -> Any:
    """The tree with DTensor nodes as plain tensor nodes (they are imported whole)."""
    if isinstance(node, dict):
        if node.get("t") == "dtensor":
            return {"t": "tensor", "id": node["id"]}
        return {k: _whole_tree(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_whole_tree(v) for v in node]
    return node


async def import_manifest(
    source: Storage,
    manifest: Manifest,
    dest: Storage,
    *,
    step: int,
    chunk_bytes: int = 64 * 1024**2,
    concurrency: int = 4,
) -> Manifest:
    """Write ``manifest``'s entries (read from ``source``) to ``dest`` as step ``step`` and
    commit it; returns the committed manifest. FileExistsError if ``dest`` holds the step."""
    if manifest.rank_local is not None:
        raise StateMismatchError(f"{source.url}: rank-local values cannot be imported into one root")
    if await dest.exists(manifest_name(step)):
        raise FileExistsError(f"{dest.url}: step {step} is there already")
    latest = await latest_committed(dest)
    if latest is not None and step < latest:
        raise StepOrderError(
            f"{dest.url}: step {step} is older than its latest step {latest}: load() would never return it "
            "(import as a later step with dest_step=, or into another root)"
        )
    save_id = secrets.token_hex(8)
    folder = f"{attempt_prefix(step, save_id)}/rank-0"
    chunks: list[list[tuple[int, int, int, int]]] = [[]]  # per chunk: (entry, entry offset, nbytes, chunk offset)
    sizes = [0]
    for index, entry in enumerate(manifest.entries):
        done = 0
        while done < entry.nbytes:
            room = chunk_bytes - sizes[-1]
            if room < ALIGN:
                chunks.append([])
                sizes.append(0)
                continue
            take = min(entry.nbytes - done, room)
            chunks[-1].append((index, done, take, sizes[-1]))
            sizes[-1] = min(chunk_bytes, sizes[-1] + take + (-take % ALIGN))
            done += take
    cache = RangeCache(source, f"{source.url} step {manifest.step}", chunk_bytes * concurrency)
    filler = Consolidator(source, manifest, cache)
    ranges: list[list[ByteRange]] = [[] for _ in manifest.entries]
    limit = asyncio.Semaphore(concurrency)

    async def write(number: int, pieces: list[tuple[int, int, int, int]]) -> None:
        name = f"{folder}/{number}.bin"
        async with limit:
            buffer = memoryview(bytearray(sizes[number]))
            segments: list[Segment] = []
            for index, at, nbytes, offset in pieces:
                entry = manifest.entries[index]
                tensor = ExportTensor(entry.path, "U8", (entry.nbytes,), index)
                segments.append((tensor, at, at + nbytes, buffer[offset : offset + nbytes]))
            await filler.fill(segments)
            crcs = await asyncio.to_thread(lambda: [crc32c_of(buffer[o : o + n]) for _, _, n, o in pieces])
            await dest.write(name, buffer)
        for (index, _, nbytes, offset), crc in zip(pieces, crcs, strict=True):
            ranges[index].append(ByteRange(object=name, offset=offset, nbytes=nbytes, crc32c=crc))

    used = [(n, p) for n, p in enumerate(chunks) if p]
    committing = False
    try:
        async with asyncio.TaskGroup() as group:
            for number, pieces in used:
                group.create_task(write(number, pieces))
        imported = Manifest(
            format_version=PLAIN_VERSION, step=step, save_id=save_id, created_at=time.time(), world_size=1,
            objects=[DataObject(name=f"{folder}/{n}.bin", rank=0, nbytes=sizes[n]) for n, _ in used],
            entries=[
                EntryRecord(
                    path=e.path, kind="pickle" if e.kind == "pickle" else "tensor", dtype=e.dtype, shape=e.shape,
                    stride=e.stride, device=e.device, nbytes=e.nbytes, ranges=sorted(ranges[i], key=_order),
                )
                for i, e in enumerate(manifest.entries)
            ],
            tree=_whole_tree(manifest.tree), metadata=manifest.metadata,
        )  # fmt: skip
        Manifest.from_json(imported.to_json(), where=f"{dest.url}/{manifest_name(step)}")  # as a reader will
        committing = True
        await commit_manifest(dest, imported, replace=False)
    except BaseException as failure:
        verdict = "other"
        if committing:  # the manifest may have landed however its write ended
            verdict = await asyncio.shield(whose_commit(dest, step, save_id, write_interrupted=True))
        if verdict == "ours" and isinstance(failure, Exception):
            return imported  # committed after all (an answer lost on the way back)
        if verdict == "other":
            await asyncio.shield(_remove(dest, attempt_prefix(step, save_id)))
        if isinstance(failure, BaseExceptionGroup):
            raise (leaf := first_error(failure)) from leaf.__cause__
        raise
    return imported


def _order(r: ByteRange) -> tuple[int, int]:
    return int(r.object.rsplit("/", 1)[1].split(".")[0]), r.offset


async def _remove(dest: Storage, prefix: str) -> None:
    try:
        await dest.delete_prefix(prefix)
    except Exception:  # the failure that got us here is what the caller sees
        return
