"""Steps that reference earlier steps' objects, made from real saves (issue 24's catalog side).

Until incremental saves write them, a referencing step is made here the way such a save would
commit it: save whole steps with :class:`~aiosnap.SyncCheckpointer`, then rewrite a later
step's manifest so that each entry whose bytes equal the base step's names the base's ranges
(flattened: a base range that itself names an earlier save's object is named directly, never
a chain), list the objects named that way as ``references``, check they exist with their size
(what the write side does before committing), commit the new manifest through the readers'
own validator, and delete the step's own objects no range names any more (they would never
have been written). Works on any root (local, S3) through the real storage backends.

Also :func:`frozen_chain`: a fine-tune-like run (a frozen base of several objects, a small
trained adapter) whose later steps reference the first step's base.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import torch
from aiosnap import Config, SyncCheckpointer
from aiosnap.catalog.steps import read_manifest
from aiosnap.core.names import manifest_name
from aiosnap.format.manifest import INCREMENTAL_VERSION, ByteRange, DataObject, EntryRecord, Manifest, checked_json
from aiosnap.storage.base import Storage
from aiosnap.storage.registry import storage_from_url

T = TypeVar("T")

BASE_ELEMENTS = 96 * 1024
"""The frozen base: 384 KiB of float32, several objects at the tests' 64 KiB chunks."""


def _layout(entry: EntryRecord) -> list[tuple[int, int | None]]:
    return [(r.nbytes, r.crc32c) for r in entry.ranges]


async def reference_base(storage: Storage, step: int, base: int | Manifest) -> Manifest:
    """Rewrite committed ``step`` so that its entries equal to ``base``'s (same path, same
    range sizes and crc32c) name ``base``'s bytes; returns the committed manifest. ``base``:
    a committed step, or a manifest read before (its step may be gone: its objects pinned)."""
    manifest = await read_manifest(storage, step)
    earlier = base if isinstance(base, Manifest) else await read_manifest(storage, base)
    known = {o.name: o for o in earlier.stored_objects()}
    by_path = {e.path: e for e in earlier.entries}
    entries: list[EntryRecord] = []
    for entry in manifest.entries:
        match = by_path.get(entry.path)
        if match is not None and entry.kind != "sharded" and _layout(match) == _layout(entry):
            entry = entry.model_copy(update={"ranges": [ByteRange(**r.model_dump()) for r in match.ranges]})
        entries.append(entry)
    named = {r.object for e in entries for r in e.ranges}
    references = sorted({known[n].name for n in named if n in known}, key=str)
    referenced = [DataObject(**known[n].model_dump()) for n in references]
    for obj in referenced:  # what the write side checks before it commits
        assert await storage.size(obj.name) == obj.nbytes, obj.name
    own = [o for o in manifest.objects if o.name in named]
    updated = manifest.model_copy(
        update={
            "entries": entries,
            "objects": own,
            "references": referenced or None,
            "format_version": INCREMENTAL_VERSION if referenced else manifest.format_version,
        }
    )
    document, checked = checked_json(updated, f"{storage.url} step {step}")
    await storage.write(manifest_name(step), document)
    await storage.delete_many([o.name for o in manifest.objects if o.name not in named])
    return checked


def on_root(config: Config, work: Callable[[Storage], Awaitable[T]]) -> T:
    """``work(storage)`` on the root of ``config``, on a loop of its own."""

    async def run() -> T:
        storage = storage_from_url(config.storage.url, config)
        try:
            return await work(storage)
        finally:
            await storage.close()

    return asyncio.run(run())


def reference(config: Config, step: int, base: int | Manifest) -> Manifest:
    """:func:`reference_base` on the root of ``config``."""
    return on_root(config, lambda storage: reference_base(storage, step, base))


def fine_tune_state(step: int) -> dict[str, Any]:
    """The state at ``step``: a frozen base (the same every step) and an adapter that changes."""
    base = torch.Generator().manual_seed(7)
    return {
        "base": torch.randn(BASE_ELEMENTS, generator=base),
        "adapter": torch.full((64,), float(step)),
        "step": step,
    }


def frozen_chain(config: Config, steps: list[int]) -> dict[int, dict[str, Any]]:
    """Save ``steps`` whole (no retention), then make each after the first reference the one
    before it: every later step names the first step's base objects. Returns each step's state."""
    states = {step: fine_tune_state(step) for step in steps}
    whole = config.model_copy(
        update={
            "retention": config.retention.model_copy(update={"keep_last": None}),
            "upload": config.upload.model_copy(update={"dedup": False}),  # made whole, referenced here
        }
    )
    with SyncCheckpointer(whole) as ckpt:
        for step in steps:
            ckpt.save(states[step], step=step).wait()
    for before, step in itertools.pairwise(steps):
        made = reference(config, step, before)
        assert made.references and made.own_bytes < made.total_bytes
    return states
