"""``aiosnap.export``: a checkpoint to Hugging Face safetensors (or a safetensors folder into
an aiosnap root), from one process or from every rank of a job.

Sources are told apart by content (:func:`open_source`): an aiosnap root or single file
(any committed step), else a safetensors folder (:class:`~.reader.SafetensorsFolder`). The
destination is a local folder or ``s3://bucket/prefix``.

From a job of several ranks (``process_group``, or torch.distributed's default group when
it is initialised), every rank calls :func:`export` with the same arguments; rank 0 picks
the step and save, claims the destination and starts the uploads, every rank uploads its
own stretch of the parts, rank 0 completes them (see :mod:`.ranks`). Runs on the caller's
thread.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...catalog.steps import committed_steps, manifest_of
from ...config import Config, load_config, parse_size
from ...errors import CheckpointNotFoundError
from ...format.manifest import Manifest
from ...storage.base import Storage
from ...storage.registry import storage_from_url
from ..detect import open_checkpoint
from ..singlefile import storage_for
from .export import ExportOptions, ExportReport, export_manifest
from .layout import NameRule
from .ranks import export_ranks
from .reader import STEP, SafetensorsFolder
from .to_aiosnap import import_manifest

__all__ = ["export", "open_source", "open_safetensors"]

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
    """The storage and manifest of ``url``: a DCP folder or a ``torch.save`` file (read
    through their translated manifests), an aiosnap root or file with a committed step
    (``step``, or the latest), else a safetensors folder. Close the storage when done."""
    found = await open_checkpoint(url, config)
    if getattr(found, "translator", None) is not None:  # a foreign checkpoint, read-only
        try:
            return found, await manifest_of(found, step)
        except BaseException:
            await found.close()
            raise
    await found.close()
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
        try:
            other = await _other_format(storage, url)
        finally:
            await storage.close()
        raise CheckpointNotFoundError(
            f"{url}: neither an aiosnap checkpoint nor a safetensors folder ({other or exc})"
        ) from exc
    except BaseException:
        await storage.close()
        raise
    return folder, manifest


async def _other_format(storage: Storage, url: str) -> str | None:
    """What ``url`` is when it is a format the export does not read yet, in words."""
    later = "converting it is not done yet: load it into the model and save it with aiosnap, then export that"
    if await asyncio.to_thread(os.path.isfile, url):
        return f"a file that is not an aiosnap checkpoint (a torch.save file?): {later}"
    try:
        if ".metadata" in await storage.list_children(""):
            return f"a torch.distributed.checkpoint (DCP) folder: {later}"
    except Exception:
        return None
    return None


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

    async def open_at(at: int | None) -> tuple[Storage, Manifest]:
        return await open_source(src, settings, step=at, prefix=prefix)

    return export_ranks(open_at, src, dest, settings, step, options, group, rank, world, progress)


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
