"""``aiosnap.export``: a checkpoint to Hugging Face safetensors (or a safetensors folder into
an aiosnap root), from one process or from every rank of a job.

Sources are told apart by content (:func:`open_source`): an aiosnap root or single file
(any committed step), else a safetensors folder (:class:`~.reader.SafetensorsFolder`). The
destination is a local folder or ``s3://bucket/prefix``.

From a job of several ranks (``process_group``, or torch.distributed's default group when
it is initialised), every rank calls :func:`export` with the same arguments: rank 0 checks
the destination and starts one upload per shard, the upload tokens go to every rank, each
rank fills and uploads its own contiguous stretch of the parts (reading the stored ranges
that hold them: with the same sharding as the save, mostly its own), the part records come
back to rank 0, which completes every shard and writes the index last. A failure on any
rank aborts the export everywhere. The collectives run on the caller's thread, on the
group given (gloo, or any group that moves Python objects); the I/O between them on an
event loop of this thread. Runs on the caller's thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ...catalog.steps import committed_steps, manifest_of
from ...config import Config, load_config, parse_size
from ...errors import AiosnapError, CheckpointNotFoundError, RankFailedError
from ...format.manifest import Manifest
from ...storage.base import PartRecord, Storage
from ...storage.registry import roots_overlap, storage_from_url
from ..singlefile import storage_for
from .consolidate import Consolidator, RangeCache
from .export import (
    ExportOptions,
    ExportReport,
    budgets_for,
    check_destination,
    export_manifest,
    plan_export,
    uploads_for,
)
from .layout import INDEX_FILE, NameRule
from .reader import STEP, SafetensorsFolder
from .to_aiosnap import import_manifest

__all__ = ["export", "open_source", "open_safetensors"]

T = TypeVar("T")
ConfigLike = Config | str | Path | None


def _settings(config: ConfigLike) -> Config:
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    return load_config(config)


def open_safetensors(url: str, config: ConfigLike = None, *, prefix: str = "model/") -> SafetensorsFolder:
    """A safetensors folder (a path or ``s3://``) as a read-only root for
    ``SyncCheckpointer(storage=...)``: ``load({"model": model})`` reads it into ``model``."""
    return SafetensorsFolder(storage_from_url(url, _settings(config)), prefix=prefix)


async def open_source(
    url: str, config: Config, *, step: int | None = None, prefix: str = "model/"
) -> tuple[Storage, Manifest]:
    """The storage and manifest of ``url``: an aiosnap root or file with a committed step
    (``step``, or the latest), else a safetensors folder. Close the storage when done."""
    storage = storage_for(url, config)
    try:
        if await committed_steps(storage):
            return storage, await manifest_of(storage, step)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except BaseException:
        await storage.close()
        raise
    folder = SafetensorsFolder(storage, prefix=prefix)
    try:
        manifest = await folder.manifest()
        if step not in (None, STEP):
            raise CheckpointNotFoundError(f"{url}: a safetensors folder holds one checkpoint (step {STEP}), not {step}")
    except CheckpointNotFoundError as exc:
        await storage.close()
        raise CheckpointNotFoundError(f"{url}: neither an aiosnap checkpoint nor a safetensors folder ({exc})") from exc
    except BaseException:
        await storage.close()
        raise
    return folder, manifest


def export(
    src: str,
    dest: str,
    *,
    to: str = "safetensors",
    step: int | None = None,
    paths: Sequence[str] | None = None,
    max_shard_size: int | str = "5GB",
    dtype: str | None = None,
    names: NameRule | None = None,
    strip: str = "model/",
    prefix: str = "model/",
    metadata: dict[str, str] | None = None,
    config: ConfigLike = None,
    overwrite: bool = False,
    dest_step: int | None = None,
    process_group: Any | None = None,
    progress: Callable[[int], None] | None = None,
) -> ExportReport:
    """Export step ``step`` (latest by default) of ``src`` to ``dest``.

    ``to="safetensors"``: the Hugging Face layout (shards of at most ``max_shard_size``
    tensor bytes and ``model.safetensors.index.json``, written last) of the tensors whose
    aiosnap path matches a ``paths`` glob (all tensors by default), named by stripping
    ``strip`` and writing ``/`` as ``.`` (or by ``names``), floating-point tensors converted
    to ``dtype`` when given. DTensor shards are consolidated. ``to="aiosnap"``: ``src`` (a
    safetensors folder, its tensors under ``prefix``) imported as step ``dest_step`` (0 by
    default) of the aiosnap root ``dest``, every range checksummed. ``config`` (a
    :class:`~aiosnap.Config` or a YAML file) gives S3 settings, ``upload.concurrency`` and
    ``ram_budget``. With several ranks, call it on every rank (see the module docstring)."""
    settings = _settings(config)
    options = ExportOptions(
        paths=None if paths is None else list(paths), strip=strip, names=names,
        max_shard_size=parse_size(max_shard_size), dtype=dtype, metadata=dict(metadata or {}),
        concurrency=settings.upload.concurrency, ram_budget=settings.ram_budget_bytes(), overwrite=overwrite,
    )  # fmt: skip
    group, rank, world = _group(process_group)
    if to == "aiosnap":
        if world > 1:
            raise ValueError("export(to='aiosnap') runs in one process")
        return asyncio.run(_import(src, dest, settings, step, prefix, dest_step or 0))
    if to != "safetensors":
        raise ValueError(f"to={to!r}: choose 'safetensors' or 'aiosnap'")
    if world == 1:
        return asyncio.run(_export_one(src, dest, settings, step, prefix, options, progress))
    return _export_ranks(src, dest, settings, step, prefix, options, group, rank, world, progress)


def _group(process_group: Any | None) -> tuple[Any, int, int]:
    """(group, rank, world size) of the job, (None, 0, 1) for one process."""
    import torch.distributed as dist

    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1
    group = process_group if process_group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


async def _export_one(
    src: str, dest: str, settings: Config, step: int | None, prefix: str, options: ExportOptions,
    progress: Callable[[int], None] | None,
) -> ExportReport:  # fmt: skip
    source, manifest = await open_source(src, settings, step=step, prefix=prefix)
    target = storage_from_url(dest, settings)
    try:
        return await export_manifest(source, manifest, target, options, progress=progress)
    finally:
        await target.close()
        await source.close()


async def _import(src: str, dest: str, settings: Config, step: int | None, prefix: str, dest_step: int) -> ExportReport:
    started = time.perf_counter()
    source, manifest = await open_source(src, settings, step=step, prefix=prefix)
    target = storage_for(dest, settings)
    try:
        imported = await import_manifest(
            source, manifest, target, step=dest_step, concurrency=settings.upload.concurrency
        )  # fmt: skip
    finally:
        await target.close()
        await source.close()
    return ExportReport(
        target.url, tuple(o.name for o in imported.objects), len(imported.entries), imported.total_bytes,
        imported.total_bytes, time.perf_counter() - started,
    )  # fmt: skip


# -- several ranks ----------------------------------------------------------------------


def _agreed(group: Any, rank: int, value: Any, failure: BaseException | None) -> list[Any]:
    """Every rank's (value or failure), gathered on every rank (caller's thread)."""
    import torch.distributed as dist

    mine = {"ok": value} if failure is None else {"error": type(failure).__name__, "message": str(failure)[:2000]}
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, mine, group=group)
    return found


def _raise_failures(found: list[Any], rank: int, failure: BaseException | None, what: str) -> None:
    if failure is not None:
        raise failure
    failed = [(r, f) for r, f in enumerate(found) if "error" in f]
    if failed:
        r, f = failed[0]
        raise RankFailedError(f"export: {what} failed on rank {r}: {f['error']}: {f['message']}")


def _run(work: Callable[[], Coroutine[Any, Any, T]]) -> tuple[T | None, BaseException | None]:
    try:
        return asyncio.run(work()), None
    except Exception as exc:  # told to the other ranks, then raised here
        return None, exc


def _export_ranks(
    src: str, dest: str, settings: Config, step: int | None, prefix: str, options: ExportOptions,
    group: Any, rank: int, world: int, progress: Callable[[int], None] | None,
) -> ExportReport:  # fmt: skip
    started = time.perf_counter()

    async def read_plan() -> Any:
        source, manifest = await open_source(src, settings, step=step, prefix=prefix)
        await source.close()
        return manifest, plan_export(manifest, options)

    planned, failure = _run(read_plan)
    _raise_failures(_agreed(group, rank, None, failure), rank, failure, "reading the source")
    assert planned is not None
    plan = planned[1]
    files = [shard.file for shard in plan.shards]

    async def begin() -> tuple[list[str], list[str]]:
        target = storage_from_url(dest, settings)
        try:
            source = storage_for(src, settings)
            overlapping = roots_overlap(source, target)
            await source.close()
            if overlapping:
                raise AiosnapError(f"{dest} and {src} overlap: export to a folder outside the source")
            stale = await check_destination(target, "", files, options.overwrite)
            return await uploads_for(target, plan).start(), stale
        finally:
            await target.close()

    started_uploads, failure = _run(begin) if rank == 0 else (None, None)
    found = _agreed(group, rank, started_uploads, failure)
    _raise_failures(found, rank, failure, "starting the uploads")
    tokens, stale = found[0]["ok"]

    async def write() -> tuple[list[tuple[int, PartRecord]], int]:
        source, source_manifest = await open_source(src, settings, step=step, prefix=prefix)
        target = storage_from_url(dest, settings)
        try:
            uploads = uploads_for(target, plan)
            uploads.adopt(tokens)
            mine = _my_parts(uploads.parts(), rank, world)
            part_bytes = max((p.nbytes for p in mine), default=1)
            budget, cache_bytes = budgets_for(options.ram_budget, part_bytes)
            cache = RangeCache(source, f"{source.url} step {source_manifest.step}", cache_bytes)
            filler = Consolidator(source, source_manifest, cache, plan.out_dtypes)
            async with source.reading():
                records = await uploads.write(
                    mine, filler.fill, concurrency=options.concurrency, budget=budget, progress=progress
                )  # fmt: skip
            return records, cache.bytes_read
        finally:
            await target.close()
            await source.close()

    written, failure = _run(write)
    found = _agreed(group, rank, written, failure)
    records = [record for f in found if "ok" in f for record in f["ok"][0]]
    failed = failure is not None or any("error" in f for f in found)

    async def end() -> None:
        target = storage_from_url(dest, settings)
        uploads = uploads_for(target, plan)
        uploads.adopt(tokens)
        try:
            if failed:
                await uploads.abort()
                return
            try:
                await uploads.finish(records)
            except BaseException:
                await asyncio.shield(uploads.abort())
                raise
            for name in stale:
                await target.delete(name)
        finally:
            await target.close()

    _, end_failure = _run(end) if rank == 0 else (None, None)
    _raise_failures(found, rank, failure, "writing parts")
    found = _agreed(group, rank, None, end_failure)
    _raise_failures(found, rank, end_failure, "completing the shards")
    read = written[1] if written is not None else 0
    return ExportReport(
        dest, (*files, INDEX_FILE), len(plan.tensors), sum(t.nbytes for t in plan.tensors), read,
        time.perf_counter() - started,
    )  # fmt: skip


def _my_parts(parts: list[Any], rank: int, world: int) -> list[Any]:
    """Rank ``rank``'s contiguous stretch of ``parts`` (split by bytes, in file order: a part
    goes to the rank whose share holds its middle byte)."""
    total = sum(p.nbytes for p in parts)
    mine, position = [], 0
    for part in parts:
        if min(world - 1, (2 * position + part.nbytes) * world // max(2 * total, 1)) == rank:
            mine.append(part)
        position += part.nbytes
    return mine
