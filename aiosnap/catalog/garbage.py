"""Garbage collection of a checkpoint root (``aiosnap gc``): plan, then act on the plan.

:func:`plan_gc` lists what a run would remove; :func:`collect_garbage` removes exactly that
(``dry_run`` stops after the plan, so a dry run prints what a real run deletes), checking
each item again right before removing it, because training may be writing the root:

- committed steps beyond the newest ``keep_last`` (manifest first, then the attempt it
  names and the earlier saves' objects it referenced, except what a kept step names: see
  :mod:`.keep`) -- re-checked against a fresh listing;
- attempt folders ``<step>/<save id>/`` that no manifest names and whose newest object is
  older than the grace period (younger ones may be saves in progress), and that are not a
  multi-rank save in progress (:mod:`.liveness`): one with a heartbeat within the lease it
  states (``distributed.heartbeat_timeout``; one that only looks stopped by this host's clock
  is watched for its lease first), or a verdict younger than :data:`VERDICT_READ_S` (its
  ranks may be reading it), is left alone whatever the grace; so is, always, one whose
  commit was claimed and whose manifest never appeared (undecided) -- re-checked: still
  old, still not live, still not committed. Objects in them that a kept manifest names (a
  deleted step's frozen weights that later steps reference) stay, read again after the
  folder is listed; an attempt folder holding only such objects is no garbage
  (``kept_referenced``); once nothing names them, they go;
- temporary files a crashed manifest write left in a step folder, older than the grace;
- multipart uploads under the root started before the grace period (S3).

Nothing else is ever removed: only names aiosnap writes (see :mod:`aiosnap.core.names`) are
considered; a user's ``2024/photos``, a ``notes.txt`` in a step folder, a key with ``//``
or ``..`` stay. A step whose manifest cannot be read is left whole (never guessed about).
Runs on whichever event loop calls it.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field

from ..core.names import MANIFEST_FILE, attempt_prefix, manifest_name, parse_step_dir, step_dir
from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format.markers import VERDICT_FILE, VERDICT_READ_S
from ..storage.base import ObjectInfo, Storage
from .liveness import Look, judge
from .maintenance import split_name
from .steps import committed_save_id, objects_to_keep, read_manifest, remove_steps, retention_victims
from .tombstones import retire_attempt

__all__ = ["VERDICT_READ_S", "GcPlan", "GcReport", "collect_garbage", "plan_gc"]

_TEMP_MANIFEST = re.compile(r"\.manifest\.json\.([0-9a-f]{8}\.tmp|lock)")


@dataclass
class GcPlan:
    """What a gc run removes (each group in the order it is removed)."""

    steps: list[int] = field(default_factory=list)
    """Committed steps beyond ``keep_last``."""
    attempts: list[str] = field(default_factory=list)
    """Attempt folders (``<step>/<save id>``) no manifest names, older than the grace."""
    temp_files: list[str] = field(default_factory=list)
    uploads: list[tuple[str, str]] = field(default_factory=list)
    """Multipart uploads (name, upload id) started before the grace period."""
    kept_recent: list[str] = field(default_factory=list)
    """Attempt folders younger than the grace period (possibly saves in progress)."""
    kept_live: list[str] = field(default_factory=list)
    """Attempt folders of multi-rank saves in progress (a live heartbeat, a young verdict)."""
    kept_undecided: list[str] = field(default_factory=list)
    """Attempt folders of multi-rank saves whose commit was claimed and whose manifest never
    appeared: their coordinator may still write it, so gc never removes them."""
    kept_unreadable: list[int] = field(default_factory=list)
    """Committed steps whose manifest cannot be read: left whole."""
    kept_referenced: list[str] = field(default_factory=list)
    """Attempt folders no manifest names that hold objects a kept step references (a
    deleted step's frozen weights): those objects stay (anything else in them may go)."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Bytes each planned item holds (steps by their folder name)."""
    heartbeats: dict[str, bytes] = field(default_factory=dict)
    """The heartbeats of planned attempts as read: one that changed by removal time is live."""

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())


@dataclass
class GcReport:
    """What :func:`collect_garbage` removed (or would remove, with ``dry_run``)."""

    deleted_steps: list[int] = field(default_factory=list)
    removed_incomplete: list[str] = field(default_factory=list)
    """Attempt folders and temporary files removed."""
    kept_recent: list[str] = field(default_factory=list)
    kept_live: list[str] = field(default_factory=list)
    kept_undecided: list[str] = field(default_factory=list)
    kept_unreadable: list[int] = field(default_factory=list)
    kept_referenced: list[str] = field(default_factory=list)
    """Attempt folders left holding objects that kept steps reference."""
    skipped: list[str] = field(default_factory=list)
    """Planned, but no longer garbage when re-checked (a save wrote to it meanwhile)."""
    aborted_uploads: int = 0
    freed_bytes: int = 0
    dry_run: bool = False


def _check_arguments(keep_last: int, grace_s: float) -> None:
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last!r}")
    if not math.isfinite(grace_s) or grace_s < 0:
        raise ValueError(f"the grace period must be a finite number of seconds >= 0, got {grace_s!r}")


async def plan_gc(storage: Storage, *, keep_last: int, grace_s: float, now: float | None = None) -> GcPlan:
    """What a gc run would remove now (reads the root; removes nothing)."""
    _check_arguments(keep_last, grace_s)
    now = time.time() if now is None else now
    cutoff = now - grace_s
    await storage.check_root()
    objects = await storage.walk()
    attempts: dict[tuple[int, str], list[ObjectInfo]] = {}
    temps: list[ObjectInfo] = []
    committed: dict[int, float] = {}  # step -> when its manifest was written
    for obj in objects:
        where = split_name(obj.name)
        if where is None:
            continue
        step, save_id = where
        if save_id is not None:
            attempts.setdefault((step, save_id), []).append(obj)
        elif obj.name == f"{step_dir(step)}/{MANIFEST_FILE}":
            committed[step] = obj.mtime
        elif _TEMP_MANIFEST.fullmatch(obj.name.split("/", 1)[1]) and obj.mtime < cutoff:
            temps.append(obj)
    plan = GcPlan()
    owners: dict[int, str] = {}
    for step in sorted(committed):
        try:
            owners[step] = (await read_manifest(storage, step)).save_id
        except CheckpointNotFoundError:
            continue  # removed meanwhile (retention of the training job)
        except CorruptCheckpointError:
            plan.kept_unreadable.append(step)  # never guessed about, never counted as kept
    readable = sorted(owners)
    doomed = set(readable[:-keep_last])
    plan.steps = sorted(doomed)
    named = await objects_to_keep(storage, leaving=doomed)  # after the listing: see .keep
    watched: dict[str, Look] = {}
    for (step, save_id), members in sorted(attempts.items()):
        free = [o for o in members if o.name not in named]
        if step in plan.kept_unreadable or (step in owners and owners[step] == save_id):
            if step in doomed:
                plan.sizes[step_dir(step)] = plan.sizes.get(step_dir(step), 0) + sum(o.size for o in free)
            continue
        prefix = attempt_prefix(step, save_id)
        if len(free) < len(members):
            plan.kept_referenced.append(prefix)
            if not free:
                continue
        if max(o.mtime for o in members) >= cutoff:
            plan.kept_recent.append(prefix)
            continue
        look = await judge(
            storage, members, now, save_id=save_id, owner=owners.get(step), manifest_mtime=committed.get(step),
            named=named,
        )  # fmt: skip
        if look.state == "watch":
            watched[prefix] = look
        _place(plan, prefix, look, free)
    if watched:  # heartbeats that only this host's clock says ran out: look again after their lease
        slept = time.monotonic()
        await asyncio.sleep(max(look.watch_s for look in watched.values()))
        later = now + time.monotonic() - slept
        for prefix, look in watched.items():
            plan.attempts.remove(prefix)
            del plan.sizes[prefix]
            again = await _look_again(storage, prefix, later, look.heartbeats, named)
            _place(plan, prefix, again, [o for o in await storage.walk(prefix) if o.name not in named])
    plan.temp_files = [o.name for o in temps]
    plan.sizes.update({o.name: o.size for o in temps})
    plan.uploads = [(name, upload) for name, upload in await storage.stale_uploads(cutoff) if split_name(name)]
    return plan


def _place(plan: GcPlan, prefix: str, look: Look, members: list[ObjectInfo]) -> None:
    if look.state == "live":
        plan.kept_live.append(prefix)
    elif look.state == "undecided":
        plan.kept_undecided.append(prefix)
    else:  # removable (or watched: placed again after the second look)
        plan.attempts.append(prefix)
        plan.sizes[prefix] = sum(o.size for o in members)
        plan.heartbeats.update(look.heartbeats)


async def _look_again(
    storage: Storage, prefix: str, now: float, seen: dict[str, bytes], named: set[str] | None = None
) -> Look:
    """The attempt ``prefix`` as it stands now, its heartbeats compared with ``seen``."""
    folder, save_id = prefix.split("/")
    step = parse_step_dir(folder)
    assert step is not None
    found = await storage.walk(folder)
    manifest = next((o for o in found if o.name == manifest_name(step)), None)
    members = [o for o in found if o.name.startswith(prefix + "/")]
    return await judge(
        storage, members, now, save_id=save_id, owner=await committed_save_id(storage, step) if manifest else None,
        manifest_mtime=None if manifest is None else manifest.mtime, seen=seen,
        named=await objects_to_keep(storage) if named is None else named,
    )  # fmt: skip


async def _still_garbage(storage: Storage, prefix: str, cutoff: float, now: float, seen: dict[str, bytes]) -> bool:
    """Right before removing an attempt folder: still old, not live, and no manifest names it."""
    folder, save_id = prefix.split("/")
    step = parse_step_dir(folder)
    assert step is not None
    found = await storage.walk(prefix)
    if found and max(o.mtime for o in found) >= cutoff:
        return False
    if found and (await _look_again(storage, prefix, now, seen)).state != "removable":
        return False
    return await committed_save_id(storage, step) != save_id


async def collect_garbage(
    storage: Storage, *, keep_last: int, grace_s: float, dry_run: bool = False, now: float | None = None
) -> GcReport:
    """Plan (see the module docstring), then, unless ``dry_run``, remove what was planned,
    re-checking each item right before it goes."""
    now = time.time() if now is None else now
    plan = await plan_gc(storage, keep_last=keep_last, grace_s=grace_s, now=now)
    report = GcReport(
        kept_recent=plan.kept_recent, kept_live=plan.kept_live, kept_undecided=plan.kept_undecided,
        kept_unreadable=plan.kept_unreadable, kept_referenced=list(plan.kept_referenced), dry_run=dry_run,
    )  # fmt: skip
    if dry_run:
        report.freed_bytes = plan.nbytes
        report.deleted_steps = list(plan.steps)
        report.removed_incomplete = [p for p in plan.attempts if p not in plan.kept_referenced] + plan.temp_files
        report.aborted_uploads = len(plan.uploads)
        return report
    still_victims = set(await retention_victims(storage, keep_last, set())) if plan.steps else set()
    for step in plan.steps:
        if step not in still_victims:  # a rollback or removal since the plan: no longer beyond keep_last
            report.skipped.append(step_dir(step))
            continue
        report.deleted_steps.append(step)
    for prefix in await remove_steps(storage, report.deleted_steps):
        if prefix not in report.kept_referenced:
            report.kept_referenced.append(prefix)
    cutoff = now - grace_s
    for prefix in plan.attempts:
        if not await _still_garbage(storage, prefix, cutoff, now, plan.heartbeats):
            report.skipped.append(prefix)
            continue
        await storage.delete(f"{prefix}/{VERDICT_FILE}")  # first: no rank reads a verdict beside removed data
        folder, save_id = prefix.split("/")
        owner = parse_step_dir(folder)
        assert owner is not None
        sizes = {o.name: o.size for o in await storage.walk(prefix)}
        held = await retire_attempt(storage, owner, save_id, keep=lambda: objects_to_keep(storage))
        await storage.remove_empty_folder(folder)
        report.freed_bytes += sum(size for name, size in sizes.items() if name not in held)
        if not held:
            report.removed_incomplete.append(prefix)
            if prefix in report.kept_referenced:  # what named its objects went meanwhile
                report.kept_referenced.remove(prefix)
        elif prefix not in report.kept_referenced:  # what else it held went; the folder stays
            report.kept_referenced.append(prefix)
    for name in plan.temp_files:
        await storage.delete(name)
        report.removed_incomplete.append(name)
        report.freed_bytes += plan.sizes.get(name, 0)
    for name, upload_id in plan.uploads:
        await storage.abort_upload(name, upload_id)
        report.aborted_uploads += 1
    report.freed_bytes += sum(plan.sizes.get(step_dir(step), 0) for step in report.deleted_steps)
    return report
