"""The converter: ``aiosnap.export(src, dest, to=...)`` and ``aiosnap export SRC DEST --to``.

A *source* is a :class:`~aiosnap.storage.base.Storage` and the
:class:`~aiosnap.format.manifest.Manifest` of one of its steps: an aiosnap root or single
file, or a foreign checkpoint seen as one (a DCP folder, a ``torch.save`` file:
:mod:`aiosnap.interop.detect` tells which by content). A *sink* takes what the source holds
-- a :class:`~.selection.Selection` (tree and entries, multi-rank sources consolidated into
full tensors, ``paths`` applied) -- and lays out its objects; the copier fills them a slab
at a time from ranged reads of the entries and hands each piece over (:mod:`.copier`); the
sink commits last. Sinks: ``aiosnap`` (:mod:`.sink_aiosnap`), ``dcp`` (:mod:`.sink_dcp`),
``torch`` (:mod:`.sink_torch`); :func:`register_sink` adds one (safetensors, say): a
factory ``(dest url, config, allow_pickle) -> sink`` with ``layout(selection,
object_bytes)``, ``put(piece)``, ``commit()`` and ``abort()``.

Every byte goes through slabs of the RAM budget: an export of a checkpoint many times the
budget holds about the budget (plus a slab when it assembles sharded tensors). Every range
with a crc32c is checked as it is read; a checkpoint is written only whole (the sink's
commit is last). Runs on aiosnap's shared background loop; :func:`export` blocks the
calling thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ...catalog.steps import manifest_of
from ...config import Config
from ...errors import ConfigError
from ...storage.base import Storage
from ...storage.registry import storage_from_url
from ..dcp.runtime import SlabPool, runtime, slab_bytes_for
from ..detect import describe, open_checkpoint
from .copier import stream
from .cursors import PlainCursor
from .selection import Selection, select
from .sink_aiosnap import AiosnapSink
from .sink_dcp import DcpSink
from .sink_torch import TorchSink

__all__ = ["ExportResult", "export", "register_sink"]

Format = Literal["aiosnap", "dcp", "torch"]
SinkFactory = Callable[[str, Config, bool], Any]


_SINKS: dict[str, SinkFactory] = {
    "dcp": lambda dest, config, allow_pickle: DcpSink(storage_from_url(dest, config), allow_pickle),
    "torch": lambda dest, config, allow_pickle: TorchSink(dest, config, allow_pickle),
}


def register_sink(name: str, factory: SinkFactory) -> None:
    """Export ``to=name`` through ``factory(dest, config, allow_pickle)`` (see the module)."""
    _SINKS[name] = factory


@dataclass(frozen=True)
class ExportResult:
    """What an export did."""

    source: str
    source_kind: str
    step: int
    dest: str
    to: str
    entries: int
    nbytes: int


async def _read_pickles(storage: Storage, selection: Selection, where: str) -> None:
    """The bytes of the selection's pickle entries (small), for sinks that decode values."""
    limit = asyncio.Semaphore(4)
    for index, entry in enumerate(selection.entries):
        if entry.kind == "pickle":
            buffer = bytearray(entry.nbytes)
            cursor = PlainCursor(storage, entry, where, limit)
            await cursor.serve(0, entry.nbytes, memoryview(buffer))
            cursor.finish()
            selection.pickles[index] = bytes(buffer)


async def _export(
    src: str,
    dest: str,
    to: str,
    step: int | None,
    paths: Sequence[str] | None,
    config: Config,
    allow_pickle: bool,
    progress: Callable[[int, int], None] | None,
) -> ExportResult:
    source = await open_checkpoint(src, config)
    sink: Any = None
    try:
        async with source.reading():
            manifest = await manifest_of(source, step)
            where = f"{source.url} step {manifest.step}"
            selection = select(manifest, paths, where=where)
            budget = config.ram_budget_bytes()
            slab = slab_bytes_for(config, budget)
            pool = SlabPool(slab, max(4, budget // slab), runtime().loop.loop)
            try:
                if to == "aiosnap":
                    sink = AiosnapSink(storage_from_url(dest, config), manifest.step, dict(manifest.metadata))
                elif to in _SINKS:
                    sink = _SINKS[to](dest, config, allow_pickle)
                else:
                    known = ", ".join(["aiosnap", *_SINKS])
                    raise ConfigError(f"to: {to!r} is not a format aiosnap exports to ({known})")
                if to != "aiosnap":
                    await _read_pickles(source, selection, where)
                objects = await sink.layout(selection, slab)
                total = sum(o.nbytes for o in objects)
                done = 0

                def advanced(nbytes: int) -> None:
                    nonlocal done
                    done += nbytes
                    if progress is not None:
                        progress(done, total)

                await stream(source, selection.entries, objects, sink, pool,
                             concurrency=config.upload.concurrency, where=where, progress=advanced)  # fmt: skip
                await sink.commit()
            except BaseException:
                if sink is not None:
                    await sink.abort()
                raise
            finally:
                pool.arena.close()
    finally:
        await source.close()
        if sink is not None and isinstance(getattr(sink, "storage", None), Storage):
            await sink.storage.close()
    return ExportResult(src, describe(source), manifest.step, dest, to, len(selection.entries), selection.nbytes)


def export(
    src: str,
    dest: str,
    *,
    to: Format | str,
    step: int | None = None,
    paths: Sequence[str] | None = None,
    config: Config | dict[str, Any] | None = None,
    allow_pickle: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ExportResult:
    """Write the checkpoint at ``src`` (an aiosnap root or single file, a DCP folder, a
    ``torch.save`` file; local or ``s3://``) to ``dest`` in the format ``to``: ``"aiosnap"``
    (a root: the step is written there), ``"dcp"`` (a folder) or ``"torch"`` (a file).
    ``step``: which step of an aiosnap source (the latest by default). ``paths``: glob
    patterns of the key paths to take (``["model/*"]``), as ``load(paths=...)``.
    ``config``: RAM budget, chunk size, concurrency, S3 settings. ``allow_pickle``: a
    source's pickled objects may be unpickled to be written in another format.
    ``progress(done, total)`` hears bytes as they are written. Blocks until the export is
    committed; a failed export leaves nothing at ``dest`` that looks like a checkpoint."""
    settings = config if isinstance(config, Config) else Config(**(config or {}))
    return runtime().run(_export(src, dest, str(to), step, paths, settings, allow_pickle, progress))
