"""aiosnap's own process group, and what ranks agree on inside ``save()`` and ``load()``.

Everything here runs on the caller's thread, inside ``save()``/``load()``, which every rank
calls: never on aiosnap's loop thread (a collective there would hang the moment ranks'
background work diverges) and never on the trainer's group (NCCL watchdogs kill jobs whose
collectives wait on slow copies). The group is a gloo (CPU) group made once per
process, when the first checkpointer is made, over the ranks of the group the checkpointer
was given (the default group when none), by those ranks only; later checkpointers share it.

Agreement is one monitored barrier (on timeout it names the ranks that did not arrive) and
one all-gather of :data:`EXCHANGE_BYTES` (256) per rank, whatever the state holds: rank 0's
save id, each rank's step, a digest of its table and tree (its class), the bytes it writes
anyway, a digest of its rank-local paths, and one digest per bucket of its plain entries
(:mod:`.ownership`: who else holds them). Ranks saving different steps or declaring
different rank-local paths all raise :class:`RanksDisagreeError`; ranks may hold different
entries (their tables are merged by the coordinator, which finds conflicts there).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import RankFailedError, RanksDisagreeError, RankTimeoutError
from ..format.buckets import BUCKETS

__all__ = ["RankGroup", "SaveProposal"]


@dataclass(frozen=True)
class SaveProposal:
    """What one rank brings to a save's agreement."""

    step: int
    save_id: str
    digest: str  # 32 hex digits: its class (table and tree shape)
    preload: int  # bytes this rank writes whatever the assignment (shards, rank-local values)
    local: int  # a digest of its rank-local paths (0: none)
    buckets: tuple[int, ...] = (0,) * BUCKETS  # per bucket, a digest of its plain entries there
    failed: bool = False  # this rank cannot save (its state or an earlier save failed): nobody does


class RankGroup:
    """aiosnap's gloo group over ``ranks`` (global ranks), this process at ``rank`` in it."""

    def __init__(self, process_group: Any | None, timeout_s: float) -> None:
        import torch.distributed as dist

        parent = process_group if process_group is not None else dist.group.WORLD
        self.ranks: list[int] = dist.get_process_group_ranks(parent)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.group = _shared_group(self.ranks, self.timeout)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.backend = str(dist.get_backend(self.group))

    def _arrive(self, what: str) -> None:
        """All ranks reach this point, or :class:`RankTimeoutError` naming those that did not."""
        import torch.distributed as dist

        try:
            dist.monitored_barrier(self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as exc:
            raise RankTimeoutError(
                f"rank {self.rank}: not every rank of aiosnap's group reached {what} within "
                f"{self.timeout.total_seconds():g} s ({exc})"
            ) from exc

    def _gather(self, mine: Any) -> list[Any]:
        import torch.distributed as dist

        found: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(found, mine, group=self.group)
        except RuntimeError as exc:
            raise RankTimeoutError(f"rank {self.rank}: exchanging with the other ranks failed ({exc})") from exc
        return found

    def _exchange(self, operation: int, words: list[int]) -> list[list[int]]:
        """Every rank's ``words`` (:data:`_WORDS` int64s) after a monitored barrier: one
        all-gather of a fixed size whatever the operation, so that ranks calling different
        operations (one ``save()``, another ``load()``) meet in collectives of one shape and
        learn it (:class:`RanksDisagreeError`) instead of tearing gloo down."""
        import torch
        import torch.distributed as dist

        mine = torch.tensor([operation, *words], dtype=torch.int64)
        found = [torch.empty_like(mine) for _ in range(self.size)]
        try:
            dist.all_gather(found, mine, group=self.group)
        except RuntimeError as exc:
            raise RankTimeoutError(f"rank {self.rank}: exchanging with the other ranks failed ({exc})") from exc
        rows = [t.tolist() for t in found]
        if any(row[0] != operation for row in rows):
            by_call = {name: [r for r, row in enumerate(rows) if row[0] == op] for op, name in _OPERATIONS.items()}
            calls = "; ".join(f"{name} by rank(s) {ranks[:16]}" for name, ranks in by_call.items() if ranks)
            raise RanksDisagreeError(f"ranks called different aiosnap operations together: {calls}")
        return [row[1:] for row in rows]

    def _gather_proposals(self, mine: SaveProposal) -> list[SaveProposal]:
        return [_decode(words) for words in self._exchange(_SAVE, _encode(mine))]

    def agree_save(self, mine: SaveProposal, local_paths: Callable[[], list[str]]) -> list[SaveProposal]:
        """Every rank's proposal, once all agree on the step and the rank-local paths.
        ``local_paths()`` lists this rank's ("path: rank-local value N"): the ranks exchange
        them only when their digests differ, to name the first difference."""
        self._arrive(f"save(step={mine.step})")
        found = self._gather_proposals(mine)
        failed = [r for r, p in enumerate(found) if p.failed]
        if failed:
            raise RankFailedError(
                f"step {mine.step}: rank(s) {failed[:16]} could not start the save (each raises its own error); "
                "no rank saves this step"
            )
        steps = {p.step for p in found}
        if len(steps) > 1:
            by_step = {s: [r for r, p in enumerate(found) if p.step == s] for s in sorted(steps)}
            raise RanksDisagreeError(
                "ranks called save() for different steps: "
                + "; ".join(f"step {s} by rank(s) {ranks}" for s, ranks in by_step.items())
            )
        if any(p.local != found[0].local for p in found):
            listed: list[list[str]] = self._gather(local_paths())
            raise RanksDisagreeError(
                f"step {mine.step}: {_first_difference(listed)}; every rank must declare the same rank-local paths"
            )
        return found

    def agree_step(self, step: int | None, *, failed: bool = False) -> int | None:
        """Rank 0's choice of step for a load, for every rank; ``failed``: rank 0 could not
        look the latest step up, and every other rank raises :class:`RankFailedError` (rank
        0 raises its own error)."""
        self._arrive("load()")
        words = [-1, 0] if step is None else [step // _HALF, step % _HALF]
        first = self._exchange(_LOAD, words + [int(failed)] + [0] * (_WORDS - 3))[0]
        if first[2]:
            raise RankFailedError(
                "load(): rank 0 could not look up the latest committed step (it raises its own error); no rank loads"
            )
        return None if first[0] < 0 else first[0] * _HALF + first[1]

    def agree_spools(self, digest: int) -> list[int]:
        """Every rank's spool directory, as a digest of its host and path (0: none), when
        the checkpointer is made."""
        self._arrive("making the checkpointer")
        return [row[0] for row in self._exchange(_OPEN, [digest] + [0] * (_WORDS - 1))]

    def agree_loaded(self, save_id: str | None, failed: bool) -> list[tuple[str | None, bool]]:
        """After a load read its step: the save id each rank's manifest named (None: it read
        none) and whether its read failed, for every rank."""
        self._arrive("the end of load()")
        ours = [0, 0] if save_id is None else [1, int(save_id, 16) - _SIGNED]
        rows = self._exchange(_LOADED, [int(failed), *ours] + [0] * (_WORDS - 3))
        return [(f"{row[2] + _SIGNED:016x}" if row[1] else None, bool(row[0])) for row in rows]

    def close(self) -> None:
        """Nothing to release: the group is shared by this process's checkpointers (see
        :func:`_shared_group`) and goes with torch.distributed's own teardown."""


_SHARED: dict[tuple[int, ...], tuple[Any, Any]] = {}
"""ranks -> (the default group it was made under, aiosnap's group over those ranks)."""


def _shared_group(ranks: list[int], timeout: datetime.timedelta) -> Any:
    """aiosnap's gloo group over ``ranks``, made once per process (and again after
    torch.distributed is initialised anew). Only the ranks in it take part in making it
    (``use_local_synchronization``): a group over part of the job needs nothing from the
    rest. It is never destroyed and made again under the same default group: torch names
    such a group by its ranks alone, and a second one would find the first one's addresses
    in the store (refused connections)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    found = _SHARED.get(tuple(ranks))
    if found is not None and found[0] is world:
        return found[1]
    try:
        group = dist.new_group(ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
    except RuntimeError as exc:  # the store's wait for the other ranks ran out
        raise RankTimeoutError(
            f"making aiosnap's group over ranks {ranks[:16]} failed ({exc}): with more than one rank, every rank "
            "makes the checkpointer; for a checkpointer of this process alone, pass world_size=1"
        ) from exc
    _SHARED[tuple(ranks)] = (world, group)
    return group


def _first_difference(listed: list[list[str]]) -> str:
    """Where the ranks' lists (of rank-local paths) first differ from rank 0's."""
    base = listed[0]
    for rank, theirs in enumerate(listed[1:], start=1):
        for position in range(max(len(base), len(theirs))):
            ours = base[position] if position < len(base) else "nothing"
            other = theirs[position] if position < len(theirs) else "nothing"
            if ours != other:
                return f"rank {rank} saves {other!r} where rank 0 saves {ours!r} (rank-local value {position})"
    return "the ranks' rank-local values differ"


_HALF = 2**62
_SIGNED = 2**63
_FIXED = 7
_WORDS = _FIXED + BUCKETS
EXCHANGE_BYTES = 8 * (1 + _WORDS)
"""Bytes each rank sends per agreement: an operation tag and :data:`_WORDS` words."""
_SAVE, _LOAD, _LOADED, _OPEN = 1, 2, 3, 4
_OPERATIONS = {_SAVE: "save()", _LOAD: "load()", _LOADED: "the end of load()", _OPEN: "making a checkpointer"}


def _encode(p: SaveProposal) -> list[int]:
    digest = int(p.digest, 16)
    return [
        p.step // _HALF, p.step % _HALF, int(p.save_id, 16) - _SIGNED,
        (digest >> 64) - _SIGNED, (digest & (2**64 - 1)) - _SIGNED, -1 if p.failed else p.preload, p.local,
        *p.buckets,
    ]  # fmt: skip


def _decode(values: list[int]) -> SaveProposal:
    step_high, step_low, save_id, digest_high, digest_low, preload, local = values[:_FIXED]
    digest = ((digest_high + _SIGNED) << 64) | (digest_low + _SIGNED)
    return SaveProposal(
        step_high * _HALF + step_low, f"{save_id + _SIGNED:016x}", f"{digest:032x}", max(preload, 0), local,
        tuple(values[_FIXED:]), failed=preload < 0,
    )  # fmt: skip
