"""The coordinator's merge of every rank's part into the step's manifest. Pure code, no I/O.

Ranks may hold different entries; the checkpoint is their union:

- **Classes**: the coordinator's own table (from its plan) and the table each other class's
  lowest rank ships in its part (:mod:`aiosnap.format.parts`). Each is checked against what
  the ranks announced in the agreement (the coordinator keeps every rank's class digest):
  a part must claim its rank's announced class and refer to the table of that class's
  lowest rank, and a shipped table and tree must make that class digest and the bucket
  digests its class's parts claim (:func:`aiosnap.format.classes.describe` recomputes
  them), with every entry of the table named by the tree.
- **Entries** are one by key, their place in the tree (:mod:`aiosnap.format.classes`): a key
  held by several classes must have one layout everywhere (a tensor of one dtype and shape,
  a pickled value, or a DTensor of one global shape and dtype), else
  :class:`~aiosnap.errors.RanksDisagreeError` names the path and the ranks.
- **Copies**: a plain entry is written by one rank of each writer group holding it
  (:mod:`aiosnap.distributed.ownership`), exactly once: the copy of the lowest rank is kept;
  the ranks of other classes in a group ship the crc32c of what they hold. A DTensor's boxes
  are grouped by device mesh: the boxes of the mesh of the lowest writing rank must tile the
  tensor (no gap, no overlap), boxes of other meshes (a copy tied across pipeline stages)
  are dropped.
- **Values**: every copy, shipped crc32c and tie of one value must be the same bytes
  (:mod:`aiosnap.format.claims`), else :class:`~aiosnap.errors.RanksDisagreeError` names the
  path and the ranks: a value several ranks hold is written once.
- **Tree**: the union of the classes' trees (:mod:`aiosnap.format.union`), lowest rank
  first; an entry no node of it names must be one the union left out by its rules (a tie,
  a pickled object under a plain value a lower rank holds).

Anything a part says is checked; a problem is a ValueError naming the rank (the caller
makes it a :class:`~aiosnap.errors.CorruptCheckpointError`), a disagreement between honest
ranks a :class:`~aiosnap.errors.RanksDisagreeError`. The result is validated like any
manifest read back before it is written.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from ..core.gcpause import gc_paused
from ..errors import RanksDisagreeError
from .buckets import bucket_of
from .claims import Claim, differing_boxes, disagreement, value_crc32c
from .classes import Described, describe
from .dtypes import dtype_itemsize
from .manifest import (
    INCREMENTAL_VERSION,
    MULTI_RANK_VERSION,
    DataObject,
    EntryRecord,
    Manifest,
    RankLocalRecord,
    ShardRecord,
    StoredDigest,
    StoredShard,
)
from .parts import RankPart, TableEntry, WrittenRecord, spec_table
from .spec import SaveSpec
from .union import TreeUnion, map_entry_ids, referenced_entries

__all__ = ["merge_parts"]


@dataclass
class _Slot:
    """One entry of the merged table: its layout (the first class's), the ranks' copies."""

    row: TableEntry
    holder: int  # the lowest rank whose table has it
    copies: list[tuple[int, WrittenRecord]] = field(default_factory=list)  # whole entries, in rank order
    boxes: dict[int, list[tuple[int, WrittenRecord]]] = field(default_factory=dict)  # mesh -> DTensor boxes
    groups: dict[int, int] = field(default_factory=dict)  # writer group digest -> the rank that wrote it
    claims: list[Claim] = field(default_factory=list)  # what other holders hold (crc32c), to compare


@dataclass
class _Class:
    """The ranks holding one table and tree; ``leader`` (the lowest of them) describes it."""

    leader: int
    rows: list[TableEntry]
    tree: Any
    described: Described
    members: list[int] = field(default_factory=list)


def _describe(row: TableEntry) -> str:
    if row.kind == "pickle":
        return "a pickled value"
    kind = "a DTensor of " if row.kind == "sharded" else ""
    return f"{kind}{row.dtype} {tuple(row.shape)}"


def _same_layout(a: TableEntry, b: TableEntry) -> bool:
    if a.kind == "pickle" or b.kind == "pickle":
        return a.kind == b.kind
    return (a.kind, a.dtype, a.shape) == (b.kind, b.dtype, b.shape)


def merge_parts(spec: SaveSpec, parts: dict[int, RankPart]) -> Manifest:
    """The step's manifest from the coordinator's plan ``spec`` and every rank's part.
    ValueError (naming the rank) when the parts do not make one checkpoint,
    :class:`RanksDisagreeError` when ranks hold one path in two layouts or with different
    values. Built with the collector paused, as a one-rank save's
    (:func:`~aiosnap.format.manifest.build_manifest`)."""
    with gc_paused():
        return _Merge(spec, parts).manifest()


def _class_of(rows: list[TableEntry], tree: Any, leader: int) -> _Class:
    try:
        described = describe([(r.path, r.kind, r.dtype, r.shape, r.mesh) for r in rows], tree)
    except ValueError as exc:
        raise ValueError(f"rank {leader}'s table and tree: {exc}") from None
    return _Class(leader, rows, tree, described)


class _Merge:
    def __init__(self, spec: SaveSpec, parts: dict[int, RankPart]) -> None:
        dist = spec.distributed
        if dist is None:
            raise ValueError("not a multi-rank save")
        if sorted(parts) != list(range(spec.world_size)):
            raise ValueError(f"parts of ranks {sorted(parts)[:8]} for a world of {spec.world_size}")
        if len(dist.announced) != spec.world_size:
            raise ValueError("the coordinator's plan lacks the class every rank announced")
        self.spec, self.parts = spec, parts
        for rank, part in sorted(parts.items()):
            if (part.step, part.save_id, part.rank, part.world_size) != (
                spec.step,
                spec.save_id,
                rank,
                spec.world_size,
            ):
                raise ValueError(f"rank {rank}'s part is of another save, rank or world")
        self.classes = self._classes(spec, parts, dist.announced)
        self.slots: list[_Slot] = []
        self.ids: dict[int, list[int]] = {}  # class leader -> its entries' slots

    @staticmethod
    def _classes(spec: SaveSpec, parts: dict[int, RankPart], announced: tuple[str, ...]) -> dict[int, _Class]:
        """Each class by its leader, its table and tree checked against what its ranks
        announced; every part checked to be of its rank's announced class."""
        leaders: dict[str, int] = {}
        for rank, digest in enumerate(announced):
            leaders.setdefault(digest, rank)
        classes = {spec.rank: _class_of(spec_table(spec, trusted=True), spec.tree, spec.rank)}
        for rank, part in sorted(parts.items()):
            if part.table is not None:
                classes[rank] = _class_of(part.table, part.tree, rank)
        for leader, described in classes.items():
            if described.described.class_digest != announced[leader]:
                raise ValueError(
                    f"rank {leader}'s table and tree are not of the class it announced when the ranks agreed"
                )
        for rank, part in sorted(parts.items()):
            if part.class_digest != announced[rank]:
                raise ValueError(f"rank {rank}'s part claims a class other than the one it announced")
            leader = leaders[announced[rank]]
            held = classes.get(leader)
            if part.table_of != leader or held is None:
                raise ValueError(
                    f"rank {rank}'s part names the table of rank {part.table_of}, not that of its class (rank {leader})"
                )
            if len(held.rows) != part.main_entries or tuple(part.buckets) != held.described.buckets:
                raise ValueError(f"rank {rank}'s part does not hold the table of rank {leader}")
            held.members.append(rank)
        return classes

    def _slot_ids(self) -> None:
        by_key: dict[str, int] = {}
        for leader, found in sorted(self.classes.items()):
            ids = self.ids[leader] = []
            for row, key in zip(found.rows, found.described.keys, strict=True):
                slot = by_key.get(key)
                if slot is None:
                    slot = by_key[key] = len(self.slots)
                    self.slots.append(_Slot(row, leader))
                else:
                    held = self.slots[slot]
                    if not _same_layout(held.row, row):
                        raise RanksDisagreeError(
                            f"step {self.spec.step}: rank {leader} holds {row.path!r} as {_describe(row)} where rank "
                            f"{held.holder} holds {_describe(held.row)}"
                        )
                ids.append(slot)

    def _copies(self) -> None:
        for rank, part in sorted(self.parts.items()):
            ids, rows = self.ids[part.table_of], self.classes[part.table_of].rows
            for record in part.written:
                slot, row = self.slots[ids[record.entry]], rows[record.entry]
                if row.kind == "sharded":
                    if record.offsets is None:
                        raise ValueError(f"rank {rank}: entry {record.entry} is sharded but written whole")
                    slot.boxes.setdefault(row.mesh or 0, []).append((rank, record))
                    continue
                if record.offsets is not None:
                    raise ValueError(f"rank {rank}: entry {record.entry} ({row.path!r}) is written as a shard")
                if row.kind == "tensor" and record.shape != row.shape:
                    raise ValueError(f"rank {rank}: {row.path!r} has shape {record.shape}, not {row.shape}")
                group = part.buckets[bucket_of(row.path)]
                if not group:
                    raise ValueError(f"rank {rank}: {row.path!r} written, but its part holds nothing in its bucket")
                other = slot.groups.get(group)
                if other is not None:
                    raise ValueError(
                        f"rank {rank}: entry {record.entry} ({row.path!r}) written twice (also by rank {other})"
                    )
                slot.groups[group] = rank
                slot.copies.append((rank, record))
            for checksum in part.checksums:
                if rows[checksum.entry].kind != "tensor":
                    raise ValueError(f"rank {rank}: a checksum of entry {checksum.entry}, which is no plain tensor")
                self.slots[ids[checksum.entry]].claims.append((rank, checksum.crc32c))

    def _require_checksums(self) -> None:
        """Every writer group holding a plain entry wrote it once; every rank holding a plain
        tensor that a rank of another class wrote shipped its crc32c."""
        announced = self.spec.distributed.announced  # type: ignore[union-attr]
        for leader, found in self.classes.items():
            ids, buckets = self.ids[leader], found.described.buckets
            needed: list[int] = []
            for index, row in enumerate(found.rows):
                if row.kind == "sharded":
                    continue
                slot = self.slots[ids[index]]
                writer = slot.groups.get(buckets[bucket_of(row.path)])
                if writer is None:
                    raise ValueError(f"entry {row.path!r} (of rank {leader}) was written by no rank of its group")
                if row.kind == "tensor" and announced[writer] != announced[leader]:
                    needed.append(index)
            for rank in found.members if needed else ():
                shipped = {c.entry for c in self.parts[rank].checksums}
                missing = [i for i in needed if i not in shipped]
                if missing:
                    raise ValueError(
                        f"rank {rank} ships no checksum of {found.rows[missing[0]].path!r}, which a rank of another "
                        "class wrote"
                    )

    def _tree(self) -> TreeUnion:
        union = TreeUnion(self._conflict)
        for leader, found in sorted(self.classes.items()):
            try:
                union.add(leader, map_entry_ids(found.tree, self.ids[leader]))
            except RanksDisagreeError as exc:
                raise RanksDisagreeError(f"step {self.spec.step}: {exc}") from None
        return union

    def _conflict(self, a: int, b: int) -> tuple[str, str] | None:
        first, second = self.slots[a].row, self.slots[b].row
        if _same_layout(first, second):
            return None
        return f"{first.path!r}, {_describe(first)}", f"{second.path!r}, {_describe(second)}"

    def _check_values(self, union: TreeUnion) -> None:
        """Every copy, shipped checksum and tie of a value holds the same bytes."""
        step = self.spec.step
        for kept, _, left, rank_left, _ in union.ties:
            tied = self.slots[left]
            if self.slots[kept].row.kind == "tensor" and tied.row.kind == "tensor" and tied.copies:
                self.slots[kept].claims.append((rank_left, value_crc32c(tied.copies[0][1].ranges)))
        for slot in self.slots:
            if slot.row.kind == "sharded" and len(slot.boxes) > 1:
                meshes = sorted(slot.boxes.values(), key=lambda boxes: min(rank for rank, _ in boxes))
                for other in meshes[1:]:
                    found = differing_boxes(meshes[0], other)
                    if found is not None:
                        raise disagreement(step, slot.row.path, *found)
            if slot.row.kind != "tensor" or not slot.copies or (len(slot.copies) == 1 and not slot.claims):
                continue
            rank, first = slot.copies[0]
            value = (rank, value_crc32c(first.ranges))
            for claim in [(r, value_crc32c(c.ranges)) for r, c in slot.copies[1:]] + slot.claims:
                if claim[1] != value[1]:
                    raise disagreement(step, slot.row.path, value, claim)

    def _record(self, slot: _Slot) -> EntryRecord:
        row = slot.row
        if row.kind == "sharded":
            shape = list(row.shape)
            chosen: list[StoredShard] = []
            if slot.boxes:
                _, boxes = min(slot.boxes.items(), key=lambda item: min(rank for rank, _ in item[1]))
                chosen = [ShardRecord(r.offsets or [], r.shape, r.ranges).stored() for _, r in boxes]
            return EntryRecord(
                path=row.path, kind="sharded", dtype=row.dtype, shape=shape, stride=_contiguous(shape),
                device=row.device, nbytes=dtype_itemsize(row.dtype) * math.prod(shape), ranges=[], shards=chosen,
            )  # fmt: skip
        if not slot.copies:
            raise ValueError(f"entry {row.path!r} (of rank {slot.holder}) was written by no rank")
        _, found = slot.copies[0]
        nbytes = sum(r.nbytes for r in found.ranges)
        shape = list(row.shape) if row.kind == "tensor" else [nbytes]
        stride = list(row.stride) if row.kind == "tensor" else [1]
        return EntryRecord(
            path=row.path, kind=row.kind, dtype=row.dtype, shape=shape, stride=stride,
            device=row.device, nbytes=nbytes, ranges=list(found.ranges),
        )  # fmt: skip

    def manifest(self) -> Manifest:
        spec = self.spec
        self._slot_ids()
        self._copies()
        self._require_checksums()
        union = self._tree()
        self._check_values(union)
        tree = union.tree
        kept = sorted(referenced_entries(tree))
        if len(kept) != len(self.slots):
            left_out = set(range(len(self.slots))) - set(kept) - union.dropped
            if left_out:
                slot = self.slots[min(left_out)]
                raise ValueError(f"entry {slot.row.path!r} of rank {slot.holder} is named by no tree")
            renumber = [0] * len(self.slots)
            for new, old in enumerate(kept):
                renumber[old] = new
            tree = map_entry_ids(tree, renumber)
        entries: list[EntryRecord] = [self._record(self.slots[i]) for i in kept]
        assert spec.distributed is not None
        local = [self.parts[r].local for r in range(spec.world_size)] if spec.distributed.local_values else None
        references, digests = self._incremental(entries, local)
        return Manifest(
            format_version=MULTI_RANK_VERSION if references is None and digests is None else INCREMENTAL_VERSION,
            step=spec.step,
            save_id=spec.save_id,
            created_at=time.time(),
            world_size=spec.world_size,
            objects=[o for r in range(spec.world_size) for o in self.parts[r].objects],
            entries=entries,
            tree=tree,
            metadata=spec.metadata,
            rank_local=local,
            references=references,
            digests=digests,
        )

    def _incremental(
        self, entries: list[EntryRecord], local: list[RankLocalRecord] | None
    ) -> tuple[list[DataObject] | None, list[StoredDigest] | None]:
        """The parts' references and digests, of the ranges the merged manifest keeps (a
        copy of a value held by several ranks is kept once)."""
        kept: set[tuple[str, int]] = set()
        for entry in [*entries, *(e for part in local or () for e in part.entries)]:
            kept.update((r.object, r.offset) for r in entry.ranges)
            kept.update((r[0], r[1]) for shard in entry.shards or () for r in shard[2])
        parts = [self.parts[r] for r in range(self.spec.world_size)]
        named = {name for name, _ in kept}
        references = [o for part in parts for o in part.references or () if o.name in named]
        digests = [d for part in parts for d in part.digests or () if (d[0], d[1]) in kept]
        return references or None, digests or None


def _contiguous(shape: list[int]) -> list[int]:
    stride, step = [], 1
    for d in reversed(shape):
        stride.append(step)
        step *= max(d, 1)
    return stride[::-1]
