"""Finishing the saves a crashed process left in the spool (loop thread).

A save is resumed when its journal says capture was complete and every chunk has either
landed in storage or is on the spool disk with the crc32c it was written with; its spooled
chunks are uploaded, its manifest committed, retention applied. Anything else (no journal:
capture never finished; a chunk that was only in RAM; a corrupt spool file) is discarded
and reported. A save to another storage root (``Checkpointer.at``, Lightning paths) is
resumed there, with the retention it was saved with, when a ``storage_for`` factory is
given; otherwise it is left in the spool and reported as skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..manifest import Manifest
from ..storage.base import Storage
from .commit import apply_retention, commit_manifest
from .spool import Spool, file_crc32c

__all__ = ["Progress", "ResumeReport", "resume_spooled"]

log = logging.getLogger("aiosnap")


@dataclass
class ResumeReport:
    """What a resume found: steps committed, saves discarded (with why), saves that failed."""

    resumed: list[int] = field(default_factory=list)
    discarded: list[tuple[str, str]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _why_not(spool: Spool, save_id: str, doc: dict[str, Any] | None) -> str | None:
    if doc is None:
        return "no journal: the process stopped before capture finished"
    if doc.get("format") != 1 or not doc.get("captured"):
        return "journal does not say capture finished"
    for index, chunk in enumerate(doc["chunks"]):
        if chunk["state"] == "ram":
            return f"chunk {index} was only in RAM when the process stopped"
        if chunk["state"] == "spooled":
            path = spool.save_dir(save_id) / f"{index}.bin"
            if not path.is_file() or path.stat().st_size != chunk["nbytes"]:
                return f"spool file {path} is missing or truncated"
            if file_crc32c(path) != chunk["crc"]:
                return f"spool file {path} is corrupt (crc32c mismatch)"
    return None


Progress = Callable[[int, int], None]
"""Called with (bytes just uploaded, bytes to upload in all) as spooled chunks land."""


def _to_upload(leftovers: list[tuple[str, dict[str, Any] | None]]) -> int:
    return sum(
        chunk["nbytes"]
        for _, doc in leftovers
        if doc is not None
        for chunk in doc.get("chunks", [])
        if chunk.get("state") == "spooled"
    )


async def _finish(spool: Spool, storage: Storage, save_id: str, doc: dict[str, Any], concurrency: int,
                  keep_last: int | None, progress: Callable[[int], None]) -> int:  # fmt: skip
    limit = asyncio.Semaphore(concurrency)

    async def upload(index: int, chunk: dict[str, Any]) -> None:
        async with limit:
            await storage.write_file(chunk["object"], str(spool.save_dir(save_id) / f"{index}.bin"))
        progress(chunk["nbytes"])

    await asyncio.gather(*(upload(i, c) for i, c in enumerate(doc["chunks"]) if c["state"] == "spooled"))
    crcs = {(obj, offset): crc for obj, offset, crc in doc["crcs"]}
    manifest = Manifest.model_validate(doc["manifest"]).with_checksums(crcs)
    await commit_manifest(storage, manifest, set())
    await apply_retention(storage, keep_last, manifest.step, set())
    return manifest.step


async def resume_spooled(
    spool: Spool,
    storage: Storage,
    *,
    concurrency: int,
    keep_last: int | None,
    storage_for: Callable[[str], Storage] | None = None,
    progress: Progress | None = None,
) -> ResumeReport:
    """Commit every resumable save in ``spool`` to ``storage`` (or, through
    ``storage_for``, to the other root it was meant for); discard the others."""
    report = ResumeReport()
    leftovers = await asyncio.to_thread(spool.leftovers)
    total = _to_upload(leftovers)

    def landed(nbytes: int) -> None:
        if progress is not None:
            progress(nbytes, total)

    for save_id, doc in leftovers:
        target, retention, opened = storage, keep_last, False
        if doc is not None and doc.get("storage_url") != storage.url:
            if storage_for is None:
                report.skipped.append((save_id, f"belongs to {doc.get('storage_url')}"))
                continue
            target, retention, opened = storage_for(str(doc.get("storage_url"))), doc.get("keep_last"), True
        try:
            await _resume_one(spool, target, save_id, doc, concurrency, retention, report, landed)
        finally:
            if opened:
                await target.close()
    return report


async def _resume_one(
    spool: Spool,
    storage: Storage,
    save_id: str,
    doc: dict[str, Any] | None,
    concurrency: int,
    keep_last: int | None,
    report: ResumeReport,
    landed: Callable[[int], None],
) -> None:
    """Resume or discard one leftover save (see the module docstring)."""
    reason = await asyncio.to_thread(_why_not, spool, save_id, doc)
    if reason is not None:
        log.warning("aiosnap: discarding spooled save %s: %s", save_id, reason)
        report.discarded.append((save_id, reason))
        await spool.discard(save_id)
        return
    assert doc is not None
    try:
        step = await _finish(spool, storage, save_id, doc, concurrency, keep_last, landed)
    except Exception as exc:  # kept for the next attempt; the caller reports it
        log.error("aiosnap: resuming spooled save %s failed (kept for later): %r", save_id, exc)
        report.failed.append((save_id, f"{type(exc).__name__}: {exc}"))
        return
    log.info("aiosnap: resumed and committed step %d of %s from spool %s", step, storage.url, Path(spool.root))
    report.resumed.append(step)
    await spool.discard(save_id)
