"""A checkpointer's place in a torch.distributed job (caller's thread).

Made with the checkpointer, by every rank of the group it is given (the default group when
none): with more than one rank, it makes aiosnap's own gloo group (:mod:`.group`). Each
``save()`` then agrees with the other ranks on a save id and on who writes which entry
held by several ranks (:mod:`.ownership`), and each ``load()`` of the latest step on which
step that is.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..config import DistributedConfig
from ..core.events import ProcessGroupInfo
from ..format.manifest import Manifest
from ..load.ranks import rank_view
from ..trainer.plan import Agreement, Flattened
from .group import RankGroup, SaveProposal
from .ownership import decide, holdings

__all__ = ["DistributedJob"]

log = logging.getLogger("aiosnap")

COORDINATOR = 0


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

    def load_step(self, step: int | None, latest: int | None) -> int | None:
        """The step every rank loads: ``step``, or the latest committed step as rank 0 saw
        it (``latest``: rank 0's lookup), so that a commit landing meanwhile cannot make
        ranks load different steps. Every rank calls ``load()`` with the same ``step``."""
        if self.group is None or step is not None:
            return step
        return self.group.agree_step(latest)

    def view(self, skip_rank_local: bool) -> Callable[[Manifest], Manifest]:
        return lambda manifest: rank_view(manifest, self.rank, self.world_size, skip_rank_local=skip_rank_local)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


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
