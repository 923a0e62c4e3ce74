"""An export by every rank of a job: one consolidated Hugging Face folder, each rank
uploading its own stretch of the shards' parts.

Three rounds, each one ``all_gather_object`` on the caller's thread (gloo, or any group that
moves Python objects), the I/O between them on an event loop of this thread:

1. **Rank 0 decides**: it opens the source once, resolves the step (the latest when none is
   given) and its save id, plans, claims the destination (:mod:`.destination`) and starts
   one upload per shard. Every rank learns the step, the save id and the upload tokens.
2. **Every rank writes its parts**: it opens exactly that save (the step *and* the save id:
   a step committed or re-saved meanwhile is an error, never a mix), plans the same export,
   fills its contiguous stretch of the parts from the stored ranges (with the same sharding
   as the save, mostly its own) and uploads them. The part records go to every rank.
3. **Rank 0 ends**: it completes every shard and writes the index last (its claim checked),
   or, when any rank failed, aborts every upload; the claim goes either way.

One verdict, told to every rank: a rank's own failure is raised there with its own type
(a Ctrl-C too, after the others were told); the others raise :class:`RankFailedError`
naming it. A rank that dies (its connection to the group drops) is a RankFailedError on the
survivors, and rank 0 still aborts the uploads. Runs on the caller's thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ...config import Config
from ...errors import AiosnapError, CorruptCheckpointError, RankFailedError
from ...format.manifest import Manifest
from ...storage.base import PartRecord, Storage
from ...storage.registry import roots_overlap, storage_from_url
from .consolidate import Consolidator, RangeCache
from .destination import Claim, claim_folder
from .export import ExportOptions, ExportPlan, ExportReport, budgets_for, plan_export, uploads_for
from .layout import INDEX_FILE

__all__ = ["export_ranks", "my_parts"]

T = TypeVar("T")
Opener = Callable[[int | None], Coroutine[Any, Any, tuple[Storage, Manifest]]]
"""``open(step)``: the source's storage and the manifest of ``step`` (None: the latest)."""


def _together(group: Any, value: Any, failure: BaseException | None, what: str) -> list[Any]:
    """Every rank's value, gathered on every rank; raises this rank's own ``failure``, else
    RankFailedError when another rank failed or the group broke (caller's thread)."""
    import torch.distributed as dist

    mine = {"ok": value} if failure is None else {"error": type(failure).__name__, "message": str(failure)[:2000]}
    found: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(found, mine, group=group)
    except Exception as exc:  # a rank died: the group's connections to it dropped
        if failure is not None:
            raise failure from None
        raise RankFailedError(f"export: a rank of the job stopped while {what} ({type(exc).__name__}: {exc})") from exc
    if failure is not None:
        raise failure
    for rank, item in enumerate(found):
        if "error" in item:
            raise RankFailedError(f"export: {what} failed on rank {rank}: {item['error']}: {item['message']}")
    return [item["ok"] for item in found]


def _run(work: Callable[[], Coroutine[Any, Any, T]]) -> tuple[T | None, BaseException | None]:
    """``work`` on an event loop of this thread: (result, None) or (None, what it raised,
    Ctrl-C included: told to the other ranks, then raised here)."""
    try:
        return asyncio.run(work()), None
    except BaseException as exc:
        return None, exc


async def _open_agreed(open_source: Opener, step: int, save_id: str) -> tuple[Storage, Manifest]:
    source, manifest = await open_source(step)
    if manifest.save_id != save_id:
        await source.close()
        raise CorruptCheckpointError(
            f"{source.url}: step {step} is now save {manifest.save_id}, not {save_id} as the export began: it was "
            "re-saved or changed while exporting"
        )
    return source, manifest


def export_ranks(
    open_source: Opener, src: str, dest: str, settings: Config, step: int | None, options: ExportOptions,
    group: Any, rank: int, world: int, progress: Callable[[int], None] | None,
) -> ExportReport:  # fmt: skip
    """The export of ``src`` (opened by ``open_source``) to ``dest`` by rank ``rank`` of
    ``world`` (see the module docstring)."""
    started = time.perf_counter()
    decided_plan: list[ExportPlan] = []  # rank 0's: it completes the shards with it

    async def decide() -> dict[str, Any]:
        source, manifest = await open_source(step)
        target = storage_from_url(dest, settings)
        try:
            if roots_overlap(source, target):
                raise AiosnapError(f"{dest} and {src} overlap: export to a folder outside the source")
            plan = plan_export(manifest, options)
            claim = await claim_folder(target, "", [s.file for s in plan.shards], overwrite=options.overwrite)
            try:
                tokens = await uploads_for(target, plan).start()
            except BaseException:
                await asyncio.shield(claim.release())
                raise
            decided_plan.append(plan)
            return {"step": manifest.step, "save_id": manifest.save_id, "tokens": tokens, "claim": claim.owner}
        finally:
            await target.close()
            await source.close()

    decided, failure = _run(decide) if rank == 0 else (None, None)
    try:
        decision = _together(group, decided, failure, "beginning the export")[0]
        written, failure = _run(lambda: _write(open_source, dest, settings, options, decision, rank, world, progress))
        records = [(int(shard), record) for item in _together(group, written, failure, "writing parts")
                   for shard, record in item[0]]  # fmt: skip
        failure = None
        if rank == 0:
            failure = _run(lambda: _finish(dest, settings, decided_plan[0], decision, records))[1]
        _together(group, None, failure, "completing the shards")
    except BaseException:
        if decided is not None:  # rank 0, uploads begun; a rank failed or died, or this one was interrupted
            _run(lambda: _abort(dest, settings, decided_plan[0], decided))
        raise
    assert written is not None
    _, read, plan = written
    return ExportReport(
        dest, (*[s.file for s in plan.shards], INDEX_FILE), len(plan.tensors), sum(t.nbytes for t in plan.tensors),
        read, time.perf_counter() - started,
    )  # fmt: skip


async def _write(
    open_source: Opener, dest: str, settings: Config, options: ExportOptions, decision: dict[str, Any],
    rank: int, world: int, progress: Callable[[int], None] | None,
) -> tuple[list[tuple[int, PartRecord]], int, ExportPlan]:  # fmt: skip
    """Every rank: fill and upload this rank's parts of the agreed save's export; (the part
    records, bytes read from the source, the plan)."""
    source, manifest = await _open_agreed(open_source, decision["step"], decision["save_id"])
    target = storage_from_url(dest, settings)
    try:
        plan = plan_export(manifest, options)
        uploads = uploads_for(target, plan)
        uploads.adopt(decision["tokens"])
        mine = my_parts(uploads.parts(), rank, world)
        part_bytes = max((p.nbytes for p in mine), default=1)
        budget, cache_bytes = budgets_for(options.ram_budget, part_bytes)
        cache = RangeCache(source, f"{source.url} step {manifest.step}", cache_bytes)
        filler = Consolidator(source, manifest, cache, plan.out_dtypes)
        async with source.reading():
            records = await uploads.write(
                mine, filler.fill, concurrency=options.concurrency, budget=budget, progress=progress
            )  # fmt: skip
        return records, cache.bytes_read, plan
    finally:
        await target.close()
        await source.close()


async def _finish(
    dest: str, settings: Config, plan: ExportPlan, decision: dict[str, Any], records: list[tuple[int, PartRecord]]
) -> None:
    """Rank 0: complete every shard and write the index, the claim checked first (a
    failure aborts every upload); the claim goes either way."""
    target = storage_from_url(dest, settings)
    claim = Claim(target, "", decision["claim"])
    uploads = uploads_for(target, plan)
    uploads.adopt(decision["tokens"])
    try:
        await uploads.finish(records, claim)
    except BaseException:
        await asyncio.shield(uploads.abort())
        raise
    finally:
        await asyncio.shield(claim.release())
        await target.close()


async def _abort(dest: str, settings: Config, plan: ExportPlan, decision: dict[str, Any]) -> None:
    """Rank 0, after a failure anywhere: abort every upload, release the claim."""
    target = storage_from_url(dest, settings)
    uploads = uploads_for(target, plan)
    uploads.adopt(decision["tokens"])
    try:
        await uploads.abort()
    finally:
        await Claim(target, "", decision["claim"]).release()
        await target.close()


def my_parts(parts: list[Any], rank: int, world: int) -> list[Any]:
    """Rank ``rank``'s contiguous stretch of ``parts`` (split by bytes, in file order: a part
    goes to the rank whose share holds its middle byte)."""
    total = sum(p.nbytes for p in parts)
    mine, position = [], 0
    for part in parts:
        if min(world - 1, (2 * position + part.nbytes) * world // max(2 * total, 1)) == rank:
            mine.append(part)
        position += part.nbytes
    return mine
