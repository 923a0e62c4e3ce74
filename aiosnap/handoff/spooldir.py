"""The local-disk spool directory: locked for one process, with its disk budget.

Layout of ``spool.dir``::

    LOCK                         flock()ed by the one checkpointer using this spool
    <save id>/<chunk>.bin        captured chunk bytes, fsynced
    <save id>/journal.jsonl      append-only record of the save (see aiosnap.format.journal)

The trainer side writes it (:mod:`aiosnap.trainer.spool`); the transfer side uploads from
its files and resumes what a crash left (:mod:`aiosnap.transfer.resume`).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
from pathlib import Path

from ..config import SpoolConfig
from ..core import durable
from ..core.aio import complete_before_cancel
from ..core.budget import ByteBudget
from ..core.checksums import RangeChecksums, content_digest
from ..errors import SpoolBusyError

__all__ = ["LOCK", "Spool", "spool_budget_bytes"]

log = logging.getLogger("aiosnap")
LOCK = "LOCK"


def spool_budget_bytes(config: SpoolConfig, root: Path) -> int:
    """``spool.budget`` in bytes for the spool directory ``root`` (which exists): a share of
    its free space, or the size given, at most the free space."""
    free = shutil.disk_usage(root).free
    if isinstance(config.budget, str):
        return int(free * float(config.budget[:-1]) / 100)
    if config.budget > free:
        log.warning("aiosnap: spool.budget %d exceeds the free space of %s; using %d", config.budget, root, free)
    return min(config.budget, free)


class Spool:
    """One spool directory, locked for this process, with its disk budget."""

    def __init__(self, root: Path, budget: ByteBudget, mode: str, lock_fd: int, *, digests: bool = False) -> None:
        self.root = root
        self.budget = budget
        self.mode = mode
        self.digests = digests
        """Take each range's xxh3-128 digest as it is spilled (``upload.dedup``: what
        incremental saves compare); without it, a spill costs its crc32c pass only."""
        self.active: set[str] = set()
        """Save ids with a session in this process: never leftovers (loop thread)."""
        self._lock_fd: int | None = lock_fd

    @classmethod
    def open(cls, config: SpoolConfig, min_bytes: int, *, digests: bool = False) -> Spool | None:
        """Lock and size the spool (caller's thread, at checkpointer start). None when the
        spool is off, or unusable (unwritable, too little space): saves then wait for RAM.
        ``digests``: see :attr:`digests`."""
        mode = config.effective_mode
        if mode == "off" or not config.dir:
            return None
        root = Path(config.dir).expanduser().absolute()
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock_fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            log.warning("aiosnap: spool.dir %s is not usable (%s): spooling is off, saves wait for RAM", root, exc)
            return None
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise SpoolBusyError(f"spool.dir {root} is in use by another checkpointer (its lock is held)") from None
        budget = spool_budget_bytes(config, root)
        if budget < min_bytes:
            log.warning(
                "aiosnap: spool budget %d bytes cannot hold one chunk of %d: spooling is off", budget, min_bytes
            )
            fcntl.flock(lock_fd, fcntl.LOCK_UN)
            os.close(lock_fd)
            return None
        return cls(root, ByteBudget(budget, "spool.budget"), mode, lock_fd, digests=digests)

    def save_dir(self, save_id: str) -> Path:
        return self.root / save_id

    async def spill(
        self, save_id: str, index: int, data: memoryview, ranges: list[tuple[int, int]], *, sync: bool = True
    ) -> tuple[str, int, list[int], list[str] | None]:
        """Write one chunk durably (``sync=False``: written, its writeback started, the
        fsync left to the caller); returns its path, its crc32c and those of its ranges,
        and (with :attr:`digests`) their xxh3-128 digests, else None. OSError (ENOSPC,
        EACCES) is raised as is, the partial file removed."""
        directory = self.save_dir(save_id)
        path = directory / f"{index}.bin"

        def write() -> tuple[int, list[int], list[str] | None]:
            directory.mkdir(exist_ok=True)
            durable.write_file(path, data, sync=sync)
            checksums = RangeChecksums(data, [b for offset, nbytes in ranges for b in (offset, offset + nbytes)])
            digests = [content_digest(data[o : o + n]) for o, n in ranges] if self.digests else None
            crcs = [checksums.of(offset, offset + nbytes) for offset, nbytes in ranges]
            return checksums.of(0, data.nbytes), crcs, digests

        try:
            # run to the end even if cancelled: the thread reads a slab that is reused
            # afterwards, and a file it finished later would outlive the cleanup
            crc, pieces, digests = await complete_before_cancel(asyncio.to_thread(write))
        except BaseException:
            await asyncio.to_thread(path.unlink, True)
            raise
        return str(path), crc, pieces, digests

    async def discard(self, save_id: str) -> None:
        await complete_before_cancel(asyncio.to_thread(shutil.rmtree, self.save_dir(save_id), True))

    def leftovers(self, live: set[str]) -> list[str]:
        """Save folders left by an earlier process (not those of ``live`` save ids, nor of
        a session of this process). Any thread: reads the directory only."""
        busy = self.active | live
        return sorted(e.name for e in self.root.iterdir() if e.is_dir() and e.name not in busy)

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None
