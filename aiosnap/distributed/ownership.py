"""Who writes each entry of a multi-rank save, decided without any rank's plan leaving it.

Ranks may hold different entries (pipeline stages hold their own layers, expert-parallel
ranks their own experts, one rank an extra key); the checkpoint is the union of what they
hold. How each kind of entry finds its writer, on the caller's thread, from what the
rank holds and what the agreement's one all-gather of fixed size told it:

- A DTensor's boxes: by the DTensor itself (:mod:`aiosnap.trainer.dtensor`): its mesh says
  which ranks hold each box; one of them writes it. Exact, whatever else ranks hold.
- Rank-local values: by their rank.
- Plain tensors and pickled values (held by one rank, or by several: replicated norms,
  DDP replicas, tied embeddings on the first and last pipeline stage): each entry falls in
  one of :data:`BUCKETS` buckets by its path with the numbers taken out
  (:mod:`aiosnap.format.buckets`) (so
  ``layers.3.experts.5.w1`` and ``layers.7.experts.2.w1`` share one, and what differs
  between ranks gathers in few buckets), and each rank sends one 64-bit digest per bucket
  of what it holds there (paths, dtypes, shapes). The ranks with the same digest for a
  bucket hold the same entries in it: a *writer group*. Each group splits its bucket's
  entries among its members, tensors balanced by bytes (largest first, to the member that
  writes the fewest so far, counting what each writes anyway), pickled values by its
  lowest member. Groups with the same members pool their buckets, so a job whose ranks
  hold the same entries (data, tensor and FSDP parallelism) is one group: each entry is
  written once, balanced over all ranks, as before.

An entry held by ranks of different groups (the tied embedding of two pipeline stages, a
norm in a bucket where the ranks' other entries differ) is written once by each group; the
coordinator's merge keeps the copy of the lowest rank and leaves the others' bytes
unreferenced (:mod:`aiosnap.format.merge`). That costs bytes, never correctness: the
alternative, telling each rank who else holds each key, is a gather of every rank's plan
(what DCP does at every save, O(ranks x entries)). The exchange stays
``8 * (7 + BUCKETS)`` bytes per rank whatever the state holds.

A value held by several ranks is written once only if they hold the same bytes. The merge
compares the copies several groups wrote (their crc32c, combined from their byte ranges);
within a group, the holders of an entry whose writer is of another *class* (pipeline stages
whose optimizer states both number their parameters 0..n-1 fall in one group, but are not
replicas of each other) each compute its crc32c on the caller's thread and ship it in their
parts (:attr:`Agreement.checksums`), for the merge to compare with the writer's. Ranks of
one class (replicas: the same table and tree) hash nothing.

The *class* of a rank is its whole table and the shape of its tree (what it holds, not the
values of plain leaves: :func:`aiosnap.format.classes.describe`): ranks of one class share
a table, which only the lowest of them, the class's leader, ships in its part for the
coordinator, which recomputes the class from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..core.tensorio import value_crc32c
from ..format.buckets import BUCKETS, bucket_of
from ..format.classes import describe, word
from ..trainer.plan import Agreement, Flattened
from .assign import assign_writers

__all__ = ["BUCKETS", "Holdings", "Proposed", "decide", "holdings", "plain_writers"]


@dataclass(frozen=True)
class Holdings:
    """What one rank holds, as the agreement carries it."""

    class_digest: str  # 32 hex digits: the table and the tree's shape
    local_digest: int  # the rank-local paths (every rank must declare the same)
    buckets: tuple[int, ...]  # per bucket: a digest of the plain entries held there, 0 for none
    preload: int  # bytes this rank writes whatever the others hold (its boxes, its rank-local values)


def holdings(flat: Flattened) -> Holdings:
    """Caller's thread: ``flat``'s holdings."""
    described = describe(flat.table_rows(), flat.tree)
    local = word("\n".join(flat.local_paths).encode()) if flat.local_paths else 0
    main = flat.main_entries
    preload = sum(flat.entries[i].nbytes for i, shard in flat.shards.items() if shard.writes)
    preload += sum(e.nbytes for e in flat.entries[main:])
    return Holdings(described.class_digest, local, described.buckets, preload)


class Proposed(Protocol):
    """What the agreement gathered from one rank (:class:`~aiosnap.distributed.group.SaveProposal`)."""

    @property
    def save_id(self) -> str: ...
    @property
    def digest(self) -> str: ...
    @property
    def preload(self) -> int: ...
    @property
    def buckets(self) -> tuple[int, ...]: ...


def decide(
    flat: Flattened, rank: int, held: Holdings, found: Sequence[Proposed], coordinator: int, commit_timeout: float
) -> Agreement:
    """This rank's share of the save, from every rank's proposal ``found`` (caller's
    thread, after the exchange): what it writes, whose table its part refers to, and the
    crc32c of each plain tensor it holds that a rank of another class writes."""
    writers = plain_writers(flat, rank, [p.buckets for p in found], [p.preload for p in found])
    written = {i for i, writer in writers.items() if writer == rank}
    written |= {i for i, shard in flat.shards.items() if shard.writes}
    entries = flat.entries
    checksums = tuple(
        (i, value_crc32c(entries[i].tensor))
        for i, writer in sorted(writers.items())
        if writer != rank and found[writer].digest != held.class_digest and entries[i].kind == "tensor"
    )
    table_of = next(r for r, p in enumerate(found) if p.digest == held.class_digest)
    announced = tuple(p.digest for p in found) if rank == coordinator else ()
    return Agreement(
        found[coordinator].save_id, frozenset(written), coordinator, commit_timeout, table_of=table_of,
        class_digest=held.class_digest, buckets=held.buckets, checksums=checksums, announced=announced,
    )  # fmt: skip


def plain_writers(
    flat: Flattened, rank: int, buckets: Sequence[Sequence[int]], preloads: Sequence[int]
) -> dict[int, int]:
    """Who writes each plain main entry of ``flat`` (this ``rank`` or another member of its
    writer group), given every rank's bucket digests and preloads (from the agreement).
    Every member of a writer group computes the same split of the group's entries: the
    same entries (equal digests), the same members."""
    mine = buckets[rank]
    pools: dict[tuple[int, ...], list[int]] = {}
    for bucket, digest in enumerate(mine):
        if digest:
            members = tuple(r for r, theirs in enumerate(buckets) if theirs[bucket] == digest)
            pools.setdefault(members, []).append(bucket)
    by_bucket: dict[int, list[int]] = {}
    for entry in flat.entries[: flat.main_entries]:
        if entry.index not in flat.shards:
            by_bucket.setdefault(bucket_of(entry.path), []).append(entry.index)
    writers: dict[int, int] = {}
    for members, pooled in pools.items():
        held = [index for bucket in pooled for index in by_bucket.get(bucket, ())]
        if len(members) == 1:
            writers.update((i, rank) for i in held)
            continue
        tensors = [i for i in held if flat.entries[i].kind != "pickle"]
        # pickled values (their bytes may differ): the lowest member's
        writers.update((i, members[0]) for i in held if flat.entries[i].kind == "pickle")
        sizes: list[int | None] = [flat.entries[i].nbytes for i in tensors]
        chosen = assign_writers(sizes, [preloads[r] for r in members])
        writers.update((i, members[w]) for i, w in zip(tensors, chosen, strict=True) if w is not None)
    return writers
