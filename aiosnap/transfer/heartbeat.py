"""Heartbeats of a multi-rank save through storage: how ranks (and ``aiosnap gc``) tell a
live rank from one that stopped, in seconds rather than at ``commit_timeout``.

While a rank's part of a save is in flight, :class:`Heartbeat` rewrites the small object
``<step>/<save id>/rank-<r>.alive`` every ``heartbeat_interval`` seconds (a counter, the
rank's phase: ``uploading``, then ``gathering`` on the coordinator, and its progress: chunks
captured and uploaded), and removes it when the rank is done. It runs on the loop of whoever
carries the save: the trainer's loop thread (``upload.executor: thread``) or the upload
process's, so a dead upload process stops it too (and, from ``save()`` until its transfer
side beats, the trainer's: a save may wait for a pending-save slot, or for a new upload
process, first). An upload process beats only while its trainer shows it is alive (``alive``:
the trainer's loop pings it), so a trainer that is stopped or wedged stops its heartbeat
too. Heartbeats go through :meth:`~aiosnap.storage.base.Storage.write_marker`, never queued
behind the rank's data writes.
Followers stop theirs once their part is delivered (the coordinator has what it needs of
them); the coordinator keeps its own until the verdict.

:class:`PeerWatch` is the reader: a rank counts as stopped once its heartbeat has not
changed for ``heartbeat_timeout`` seconds of the *reader's* clock (so clocks of different
hosts never matter), nor appeared within that time. A reader that was itself held up (its
loop busy) starts counting afresh, and a heartbeat it cannot read (the store failing) is no
sign of death. It also tells how long a rank's progress has not moved (:meth:`PeerWatch.idle`).
No collective anywhere: storage only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable

from ..config import DistributedConfig
from ..core.aio import run_all
from ..format.markers import (
    MAX_HEARTBEAT_BYTES,
    Phase,
    heartbeat_document,
    heartbeat_name,
    heartbeat_phase,
    heartbeat_progress,
)
from ..format.spec import SaveSpec
from ..storage.base import Storage

__all__ = ["Heartbeat", "PeerWatch"]

log = logging.getLogger("aiosnap")

_READS_AT_ONCE = 16


class Heartbeat:
    """This rank's heartbeat for the save ``spec`` (loop thread of its transfer side). With
    ``alive``, a beat is written only while ``alive()`` is true (an upload process: while
    its trainer pings it); :meth:`advance` counts progress."""

    def __init__(
        self, storage: Storage, spec: SaveSpec, config: DistributedConfig, alive: Callable[[], bool] | None = None
    ) -> None:
        self.storage = storage
        self.alive = alive
        self.progress = 0
        self.name = heartbeat_name(spec.step, spec.save_id, spec.rank)
        self.rank = spec.rank
        self.interval = config.heartbeat_interval
        self.timeout = config.heartbeat_timeout
        self.phase: Phase = "uploading"
        self._beats = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def advance(self) -> None:
        """The rank made progress (a chunk captured or uploaded)."""
        self.progress += 1

    async def _run(self) -> None:
        while True:
            if self.alive is None or self.alive():
                await self._beat()
            else:
                log.debug("aiosnap: heartbeat %s paused: the trainer does not answer", self.name)
            await asyncio.sleep(self.interval)

    async def _beat(self) -> None:
        self._beats += 1
        document = heartbeat_document(
            self.rank, self._beats, self.phase, os.getpid(), self.interval, self.timeout, self.progress
        )
        try:
            await self.storage.write_marker(self.name, document)
        except Exception as exc:  # a store that fails now and then: the next beat may land
            log.debug("aiosnap: heartbeat %s failed: %r", self.name, exc)

    def hand_over(self) -> None:
        """No more beats from here; the object stays (another heartbeat of the same rank
        and save, its transfer side's, keeps it fresh). Idempotent; any callback."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        """No more beats; the object is removed (best effort: ``aiosnap gc`` judges a stale
        one by its age). Idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait([task])
        try:
            await self.storage.delete(self.name)
        except Exception as exc:
            log.debug("aiosnap: removing heartbeat %s failed: %r", self.name, exc)


class PeerWatch:
    """Which of the other ranks of the save ``spec`` have stopped (loop thread of the reader).
    Reads their heartbeats at most once per ``heartbeat_interval``."""

    def __init__(self, storage: Storage, spec: SaveSpec, config: DistributedConfig) -> None:
        self.storage = storage
        self.spec = spec
        self.interval = config.heartbeat_interval
        self.timeout = config.heartbeat_timeout
        self._seen: dict[int, bytes | None] = {}
        self._alive_at: dict[int, float] = {}
        self._phases: dict[int, Phase | None] = {}
        self._progress: dict[int, int | None] = {}
        self._moved_at: dict[int, float] = {}
        self._looked_at = time.monotonic()
        self._next_look = 0.0

    def phase(self, rank: int) -> Phase | None:
        """The phase rank ``rank``'s last heartbeat said (None before one was read)."""
        return self._phases.get(rank)

    async def stopped(self, ranks: Iterable[int]) -> list[int] | None:
        """Those of ``ranks`` whose heartbeat has not changed for ``heartbeat_timeout``
        seconds; None between looks (at most one per ``heartbeat_interval``)."""
        now = time.monotonic()
        if now < self._next_look:
            return None
        watched = sorted(set(ranks))
        if now - self._looked_at > max(self.timeout / 2, 2 * self.interval):
            self._alive_at = {r: now for r in watched}  # this reader was held up: count afresh
            self._moved_at = {r: now for r in watched}
        self._looked_at = now
        self._next_look = now + self.interval
        limit = asyncio.Semaphore(_READS_AT_ONCE)

        async def look(rank: int) -> None:
            self._alive_at.setdefault(rank, now)
            self._moved_at.setdefault(rank, now)
            name = heartbeat_name(self.spec.step, self.spec.save_id, rank)
            try:
                async with limit:
                    found: bytes | None = await self.storage.read(name, limit=MAX_HEARTBEAT_BYTES)
            except FileNotFoundError:
                found = None
            except Exception as exc:  # the store, not the rank: no sign either way
                log.debug("aiosnap: reading heartbeat %s failed: %r", name, exc)
                self._alive_at[rank] = time.monotonic()
                return
            if rank in self._seen and found == self._seen[rank]:
                return
            self._seen[rank] = found
            if found is not None:
                self._alive_at[rank] = time.monotonic()
                self._phases[rank] = heartbeat_phase(found)
                progress = heartbeat_progress(found)
                if progress != self._progress.get(rank):
                    self._progress[rank] = progress
                    self._moved_at[rank] = time.monotonic()

        await run_all(look(rank) for rank in watched)
        now = time.monotonic()
        return [r for r in watched if now - self._alive_at[r] > self.timeout]

    def silence(self, rank: int) -> float:
        """Seconds since rank ``rank`` last showed a sign of life (to this watch)."""
        return time.monotonic() - self._alive_at.get(rank, self._looked_at)

    def idle(self, rank: int) -> float:
        """Seconds since rank ``rank``'s progress last moved (to this watch), alive or not."""
        return time.monotonic() - self._moved_at.get(rank, self._looked_at)
