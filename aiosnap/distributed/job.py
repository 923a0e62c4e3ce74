"""A checkpointer's place in a torch.distributed job (caller's thread).

Made with the checkpointer, by every rank of the group it is given (the default group when
none): with more than one rank, it makes aiosnap's own gloo group (:mod:`.group`). Each
``save()`` then agrees with the other ranks on a save id and on who writes which entry
held by several ranks (:mod:`.ownership`), and each ``load()`` of the latest step on which
step that is.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..config import DistributedConfig, SpoolConfig
from ..core.events import ProcessGroupInfo
from ..errors import RankFailedError, RanksDisagreeError, SpoolBusyError
from ..format.manifest import Manifest
from ..load.ranks import rank_view
from ..trainer.plan import Agreement, Flattened
from .group import RankGroup, SaveProposal
from .ownership import decide, holdings

__all__ = ["DistributedJob"]

log = logging.getLogger("aiosnap")

COORDINATOR = 0
LOAD_ATTEMPTS = 3
"""Reads one ``load()`` makes at most while ranks read different versions of its step
(another job re-saved it in between)."""


class DistributedJob:
    """``rank`` of ``world_size``; ``group`` is None for a single rank."""

    def __init__(self, config: DistributedConfig, info: ProcessGroupInfo, process_group: Any | None) -> None:
        self.config = config
        self.rank = info.rank
        self.world_size = info.world_size
        self.group: RankGroup | None = None
        if info.world_size > 1 and info.backend is not None:
            self.group = RankGroup(process_group, config.agree_timeout)
            if (self.group.rank, self.group.size) != (info.rank, info.world_size):
                self.group.close()
                raise ValueError(
                    f"rank {info.rank} of {info.world_size} given, but this process is rank {self.group.rank} "
                    f"of {self.group.size} in the group: leave rank and world_size out"
                )
            info = ProcessGroupInfo(info.rank, info.world_size, self.group.backend, self.group.size)
        self.info = info

    def check_spools(self, spool: SpoolConfig) -> None:
        """Making the checkpointer (caller's thread, every rank): :class:`SpoolBusyError` on
        every rank when ranks on one host were given one spool directory (a spool is locked
        by the one process using it: each rank needs its own), before any takes its lock."""
        if self.group is None:
            return
        path = None
        if spool.effective_mode != "off" and spool.dir:
            path = str(Path(spool.dir).expanduser().absolute().resolve())
        digest = 0
        if path is not None:
            mine = hashlib.blake2b(f"{socket.gethostname()}\0{path}".encode(), digest_size=8).digest()
            digest = int.from_bytes(mine, "big") >> 1 or 1
        found = self.group.agree_spools(digest)
        shared = sorted({d for d in found if d and found.count(d) > 1})
        if not shared:
            return
        ranks = [r for r, d in enumerate(found) if d == shared[0]]
        here = f" (this rank's: {path})" if digest == shared[0] else ""
        raise SpoolBusyError(
            f"ranks {ranks[:16]} on one host were given the same spool.dir{here}: each rank needs its own, since "
            "a spool directory is locked by the one process using it; give every rank a spool.dir of its own "
            "(one with the rank in its name, on local disk)"
        )

    @property
    def multi_rank(self) -> bool:
        return self.world_size > 1

    def agreement(self, step: int) -> _SaveAgreement | None:
        """How this rank agrees with the others on a save of ``step`` (None: one rank)."""
        if not self.multi_rank:
            return None
        group = self.group
        if group is None:
            raise RuntimeError(
                f"rank {self.rank} of {self.world_size}: a multi-rank save needs torch.distributed initialised "
                "before the checkpointer is made (the ranks agree on each save over it)"
            )
        return _SaveAgreement(self, group, step)

    def rank_local(self, extra: Sequence[str] | None) -> list[str]:
        patterns = [*self.config.rank_local, *(extra or ())]
        if any(not isinstance(p, str) or not p for p in patterns):
            raise ValueError(f"rank_local must be a list of non-empty path patterns, got {patterns!r:.200}")
        return patterns

    def needs_latest(self, step: int | None) -> bool:
        """Whether this rank must look up the latest step for :meth:`load_step`."""
        return self.group is not None and step is None and self.rank == COORDINATOR

    def load_step(self, step: int | None, latest: int | None, failure: BaseException | None = None) -> int | None:
        """The step every rank loads: ``step``, or the latest committed step as rank 0 saw
        it (``latest``: rank 0's lookup), so that a commit landing meanwhile cannot make
        ranks load different steps. Every rank calls ``load()`` with the same ``step``.
        ``failure``: rank 0's lookup failed; it still takes part in the agreement, as failed
        (the other ranks raise :class:`RankFailedError` at once), then raises ``failure``."""
        if self.group is None or step is not None:
            if failure is not None:
                raise failure
            return step
        if failure is not None:
            try:
                self.group.agree_step(None, failed=True)
            except Exception as exc:  # RankFailedError: expected; anything else: the lookup's error matters more
                log.debug("aiosnap: rank %d left load(): %r", self.rank, exc)
            raise failure
        return self.group.agree_step(latest)

    def view(self, skip_rank_local: bool) -> Callable[[Manifest], Manifest]:
        return lambda manifest: rank_view(manifest, self.rank, self.world_size, skip_rank_local=skip_rank_local)

    def load_attempts(self, skip_rank_local: bool) -> Iterator[LoadAttempt]:
        """The reads of one ``load()``: one for a single rank; with several, until every rank
        read the same version of the step (at most :data:`LOAD_ATTEMPTS`)."""
        tries = 1 if self.group is None else LOAD_ATTEMPTS
        for number in range(tries):
            yield LoadAttempt(self, self.view(skip_rank_local), last=number == tries - 1)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class LoadAttempt:
    """One read of a ``load()``: the manifest's view for this rank, which records the save id
    it read, and the ranks' agreement on what they read (caller's thread)."""

    def __init__(self, job: DistributedJob, view: Callable[[Manifest], Manifest], *, last: bool) -> None:
        self.job = job
        self._view = view
        self.last = last
        self.save_id: str | None = None

    def view(self, manifest: Manifest) -> Manifest:
        """The manifest as this rank loads it (loop thread)."""
        self.save_id = manifest.save_id
        return self._view(manifest)

    def again(self, step: int | None, failure: BaseException | None) -> bool:
        """Every rank has read (``failure``: this rank's read failed): True to read again,
        because ranks read different versions of the step; False when this rank's result
        stands (or its own failure is to be raised). :class:`RankFailedError` when another
        rank's read failed, :class:`RanksDisagreeError` when versions still differ."""
        group = self.job.group
        if group is None:
            return False
        found = group.agree_loaded(self.save_id, failure is not None)
        read = sorted({save_id for save_id, _ in found if save_id is not None})
        if len(read) > 1:
            if not self.last:
                log.info("aiosnap: step %s was re-saved while the ranks loaded it; reading it again", step)
                return True
            raise RanksDisagreeError(
                f"step {step} was re-saved while the ranks loaded it, {LOAD_ATTEMPTS} times: ranks read different "
                f"versions of it (save ids {read[:4]}); load again once it is no longer being replaced"
            )
        failed = [rank for rank, (_, bad) in enumerate(found) if bad]
        if failed and failure is None:
            raise RankFailedError(
                f"load of step {step} failed on rank(s) {failed[:16]} (each raises its own error); this rank's "
                "state may hold the step's values, the others' not: no rank counts it as loaded"
            )
        return False


class _SaveAgreement:
    """One save's agreement: called with the flattened state (caller's thread), or told
    that this rank cannot save, so that the others stop at once instead of waiting."""

    def __init__(self, job: DistributedJob, group: RankGroup, step: int) -> None:
        self.job = job
        self.group = group
        self.step = step
        self.done = False  # the exchange took place (whatever came of it)

    def abandon(self) -> None:
        """Take part in the agreement as a rank that cannot save (errors of the exchange
        itself are dropped: the caller raises its own). Nothing once the exchange is done."""
        if self.done:
            return
        self.done = True
        mine = SaveProposal(self.step, uuid.uuid4().hex[:16], "0" * 32, 0, 0, failed=True)
        try:
            self.group.agree_save(mine, list)
        except Exception as exc:  # RankFailedError: expected; anything else: the caller's error matters more
            log.debug("aiosnap: rank %d left save(step=%d): %r", self.job.rank, self.step, exc)

    def __call__(self, flat: Flattened) -> Agreement:
        held = holdings(flat)
        mine = SaveProposal(self.step, uuid.uuid4().hex[:16], held.class_digest, held.preload, held.local_digest,
                            held.buckets)  # fmt: skip
        self.done = True
        found = self.group.agree_save(mine, flat.local_lines)
        return decide(flat, self.job.rank, held, found, COORDINATOR, self.job.config.commit_timeout)
