"""Load-side I/O: read every byte range of a manifest into fresh tensors and verify it.

Runs on the background loop thread; neighbouring ranges of one object are read with one
request (one ``preadv`` on local disk, one ranged GET on S3) scattered straight into their
tensors' memory; runs are read concurrently (``upload.concurrency``) and each range's
crc32c is checked in a worker thread. Nothing of the caller's state is touched here: the tensors are new, so a corrupt
checkpoint is refused before any object is modified.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from ..core.aio import run_all
from ..core.cudaorder import CudaOrder
from ..core.names import attempt_of_object
from ..core.tensorio import bytes_view
from ..errors import AiosnapError, CorruptCheckpointError, TruncatedObjectError, first_error
from ..format.manifest import Manifest
from ..storage.base import Storage
from .decode import torch_dtype
from .fetch_runs import Range, Run, back_to_back, plan_runs, read_run
from .reshard import ShardTarget, overlaps, read_into_targets, whole_target
from .staged import StagingSlabs, read_staged

__all__ = ["ReadPlan", "fetch_entries", "naming_targets"]


@dataclass(frozen=True)
class ReadPlan:
    """What a load reads: the entries ``only`` (None: all of them), and the entries read
    straight into the caller's tensors ``into`` (see :mod:`aiosnap.load.inplace`)."""

    only: set[int] | None = None
    into: dict[int, torch.Tensor] = field(default_factory=dict)
    shards: dict[int, tuple[ShardTarget, ...]] = field(default_factory=dict)
    """Entries read into the caller's DTensors: the boxes of each one's local shard (see
    :mod:`aiosnap.load.reshard`)."""
    staged: dict[int, torch.Tensor] = field(default_factory=dict)
    """Entries copied into the caller's tensors through staging slabs (CUDA tensors,
    strided views; see :mod:`aiosnap.load.staged`)."""
    caller: CudaOrder | None = None
    """Where the caller's CUDA work stood at ``load()`` (staged copies wait for it)."""

    @property
    def written(self) -> list[int]:
        """The entries whose bytes land in the caller's own tensors during the read."""
        return [*self.into, *self.shards, *self.staged]


def _empty_for(manifest: Manifest, index: int) -> torch.Tensor:
    entry = manifest.entries[index]
    try:
        if entry.kind == "pickle":
            return torch.empty(entry.nbytes, dtype=torch.uint8)
        # as bytes, then viewed: torch fills new memory where deterministic algorithms are on
        # (Lightning's deterministic=True), which it cannot do for bit-packed dtypes (int1..int7)
        raw = torch.empty(entry.nbytes, dtype=torch.uint8)
        return raw.view(torch_dtype(entry.dtype)).view(entry.shape)
    except RuntimeError as exc:  # cannot allocate: refuse the checkpoint, not crash the caller
        raise CorruptCheckpointError(f"step {manifest.step}: cannot allocate {entry.path!r}: {exc}") from exc


async def check_object_sizes(
    storage: Storage, manifest: Manifest, concurrency: int, names: set[str] | None = None
) -> None:
    """Every data object (of ``names``, when given), its own and those of earlier saves it
    references, is there with the size the manifest gives, before anything is allocated for
    it (a hostile manifest cannot make a load allocate more than is stored, except through
    compressed ranges: a zstd frame whose header states its raw size, checked before anything
    is allocated, may still hold thousands of times its stored bytes)."""
    where = f"{storage.url} step {manifest.step}"
    limit = asyncio.Semaphore(concurrency)
    referenced = {o.name for o in manifest.references or ()}

    async def check(name: str, nbytes: int) -> None:
        attempt = attempt_of_object(name) if name in referenced else None
        what = f"data object {name!r}" + ("" if attempt is None else f" (referenced, of step {attempt[0]})")
        async with limit:
            try:
                size = await storage.size(name)
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(f"{where}: {what} is missing") from exc
        if size < nbytes:
            raise TruncatedObjectError(f"{where}: {what} is truncated: {size} of {nbytes} bytes")
        if size != nbytes and name in referenced:
            raise CorruptCheckpointError(f"{where}: {what} is {size} bytes, the manifest says {nbytes}")

    await run_all(check(o.name, o.nbytes) for o in manifest.stored_objects() if names is None or o.name in names)


async def fetch_entries(
    storage: Storage,
    manifest: Manifest,
    concurrency: int,
    plan: ReadPlan | None = None,
    slabs: StagingSlabs | None = None,
) -> dict[int, torch.Tensor]:
    """Every entry of ``manifest`` (those of ``plan.only``: a partial load reads nothing
    else), verified: read into the caller's tensor ``plan.into[index]`` where there is one,
    copied into ``plan.staged[index]`` through ``slabs`` (without slabs, like the rest),
    else into a new CPU tensor (pickles as uint8 bytes). Neighbouring ranges of an object
    are read with one request (:func:`plan_runs`); each range's crc32c is checked on its
    own. If a read or a check fails after in-place reads began, the error names the
    caller's tensors that may now hold partly loaded bytes."""
    plan = plan or ReadPlan()
    staged = plan.staged if slabs is not None else {}
    where = f"{storage.url} step {manifest.step}"
    wanted = [(i, e) for i, e in enumerate(manifest.entries) if plan.only is None or i in plan.only]
    names = None
    if plan.only is not None:
        names = {r.object for _, e in wanted for r in e.ranges}
        names |= {r[0] for _, e in wanted for _, _, ranges in e.shards or () for r in ranges}
    await check_object_sizes(storage, manifest, concurrency, names)
    sharded: dict[int, tuple[ShardTarget, ...]] = {}
    for index, entry in wanted:
        if index in plan.shards:
            sharded[index] = plan.shards[index]
        elif entry.kind == "sharded":
            try:
                sharded[index] = (whole_target(entry),)
            except RuntimeError as exc:
                raise CorruptCheckpointError(f"step {manifest.step}: cannot allocate {entry.path!r}: {exc}") from exc
    pieces = overlaps(manifest, sharded)
    tensors: dict[int, torch.Tensor] = {i: boxes[0].value for i, boxes in sharded.items()}
    ranges: list[Range] = []
    tensors.update(staged)
    for index, entry in wanted:
        if index in sharded or index in staged:
            continue
        tensor = plan.into.get(index)
        if tensor is None:
            tensor = _empty_for(manifest, index)
        tensors[index] = tensor
        ranges += back_to_back(entry.path, entry.ranges, bytes_view(tensor))
    limit = asyncio.Semaphore(concurrency)

    async def read(run: Run) -> None:
        async with limit:
            await read_run(storage, where, run)

    try:
        async with asyncio.TaskGroup() as group:
            for run in plan_runs(ranges):
                group.create_task(read(run))
            if pieces:
                group.create_task(read_into_targets(storage, where, pieces, limit, slabs))
            if staged:
                assert slabs is not None
                group.create_task(read_staged(storage, where, manifest, staged, slabs, limit, plan.caller))
    except BaseExceptionGroup as group_error:
        leaf = first_error(group_error)
        written = [*plan.into, *plan.shards, *staged]
        if written:
            raise naming_targets(leaf, [manifest.entries[i].path for i in written]) from leaf.__cause__
        raise leaf from leaf.__cause__
    return tensors


def naming_targets(error: BaseException, paths: list[str]) -> BaseException:
    """``error``, saying which of the caller's tensors were being loaded in place."""
    shown = ", ".join(repr(p) for p in paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")
    note = (
        f"the load wrote in place: {shown} may now hold partly loaded data (load again, or use "
        "load(..., atomic=True) to change nothing unless everything verifies)"
    )
    if isinstance(error, AiosnapError):
        return type(error)(f"{error}; {note}")
    error.add_note(note)
    return error
