"""The coordinator's merge of every rank's part into the step's manifest. Pure code, no I/O.

Ranks may hold different entries; the checkpoint is their union:

- **Tables**: the coordinator's own (from its plan) and the table each other class's
  lowest rank ships in its part (:mod:`aiosnap.format.parts`). Entries are one by path: a
  path held by several classes must have one layout everywhere (a tensor of one dtype and
  shape, a pickled value, or a DTensor of one global shape and dtype), else
  :class:`~aiosnap.errors.RanksDisagreeError` names the path and the ranks.
- **Copies**: a plain entry is written by one rank of each writer group holding it
  (:mod:`aiosnap.distributed.ownership`): the copy of the lowest rank is kept; two copies
  from one group (the same bucket digest) are a forgery. A DTensor's boxes are grouped by
  device mesh: the boxes of the mesh of the lowest writing rank must tile the tensor (no gap,
  no overlap), boxes of other meshes (a copy tied across pipeline stages) are dropped.
- **Tree**: the union of the classes' trees (:mod:`aiosnap.format.union`), lowest rank
  first; entries no node of it names (a weight another rank's tree ties to an entry of
  its own) are left out.

Anything a part says is checked (its entries exist in its class's table, kinds match, no
entry is missing); a problem is a ValueError naming the rank (the caller makes it a
:class:`~aiosnap.errors.CorruptCheckpointError`), a disagreement between honest ranks a
:class:`~aiosnap.errors.RanksDisagreeError`. The result is validated like any manifest
read back before it is written.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from ..core.gcpause import gc_paused
from ..errors import RanksDisagreeError
from .buckets import bucket_of
from .dtypes import dtype_itemsize
from .manifest import FORMAT_VERSION, EntryRecord, Manifest, ShardRecord, StoredShard
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
    :class:`RanksDisagreeError` when ranks hold one path in two layouts. Built with the
    collector paused, as a one-rank save's (:func:`~aiosnap.format.manifest.build_manifest`)."""
    with gc_paused():
        return _Merge(spec, parts).manifest()


class _Merge:
    def __init__(self, spec: SaveSpec, parts: dict[int, RankPart]) -> None:
        dist = spec.distributed
        if dist is None:
            raise ValueError("not a multi-rank save")
        if sorted(parts) != list(range(spec.world_size)):
            raise ValueError(f"parts of ranks {sorted(parts)[:8]} for a world of {spec.world_size}")
        self.spec, self.parts = spec, parts
        self.tables: dict[int, tuple[list[TableEntry], Any, str]] = {
            spec.rank: (spec_table(spec, trusted=True), spec.tree, dist.class_digest or "0" * 32)
        }
        for rank, part in sorted(parts.items()):
            if (part.step, part.save_id, part.rank, part.world_size) != (
                spec.step,
                spec.save_id,
                rank,
                spec.world_size,
            ):
                raise ValueError(f"rank {rank}'s part is of another save, rank or world")
            if part.table is not None:
                self.tables[rank] = (part.table, part.tree, part.class_digest)
        lowest: dict[str, int] = {}
        for rank, (_, _, digest) in sorted(self.tables.items()):
            lowest.setdefault(digest, rank)
        for rank, part in parts.items():
            found = self.tables.get(part.table_of)
            if found is None or lowest[found[2]] != part.table_of:
                raise ValueError(f"rank {rank}'s part names the table of rank {part.table_of}, which ships none")
            if found[2] != part.class_digest or len(found[0]) != part.main_entries:
                raise ValueError(f"rank {rank}'s part does not hold the table of rank {part.table_of}")
        self.slots: list[_Slot] = []
        self.ids: dict[int, list[int]] = {}  # table's rank -> its entries' slots

    def _slot_ids(self) -> None:
        by_path: dict[str, int] = {}
        for rank, (rows, _, _) in sorted(self.tables.items()):
            ids = self.ids[rank] = []
            for row in rows:
                slot = by_path.get(row.path)
                if slot is None:
                    slot = by_path[row.path] = len(self.slots)
                    self.slots.append(_Slot(row, rank))
                else:
                    held = self.slots[slot]
                    if not _same_layout(held.row, row):
                        raise RanksDisagreeError(
                            f"step {self.spec.step}: rank {rank} holds {row.path!r} as {_describe(row)} where rank "
                            f"{held.holder} holds {_describe(held.row)}"
                        )
                ids.append(slot)

    def _copies(self) -> None:
        for rank, part in sorted(self.parts.items()):
            ids, rows = self.ids[part.table_of], self.tables[part.table_of][0]
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

    def _tree(self) -> Any:
        union = TreeUnion(self._conflict)
        for rank, (_, tree, _) in sorted(self.tables.items()):
            union.add(rank, map_entry_ids(tree, self.ids[rank]))
        return union.tree

    def _conflict(self, a: int, b: int) -> tuple[str, str] | None:
        first, second = self.slots[a].row, self.slots[b].row
        if _same_layout(first, second):
            return None
        return f"{first.path!r}, {_describe(first)}", f"{second.path!r}, {_describe(second)}"

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
        tree = self._tree()
        kept = sorted(referenced_entries(tree))
        if len(kept) != len(self.slots):
            renumber = [0] * len(self.slots)
            for new, old in enumerate(kept):
                renumber[old] = new
            tree = map_entry_ids(tree, renumber)
        entries: list[EntryRecord] = [self._record(self.slots[i]) for i in kept]
        assert spec.distributed is not None
        local = [self.parts[r].local for r in range(spec.world_size)] if spec.distributed.local_values else None
        return Manifest(
            format_version=FORMAT_VERSION,
            step=spec.step,
            save_id=spec.save_id,
            created_at=time.time(),
            world_size=spec.world_size,
            objects=[o for r in range(spec.world_size) for o in self.parts[r].objects],
            entries=entries,
            tree=tree,
            metadata=spec.metadata,
            rank_local=local,
        )


def _contiguous(shape: list[int]) -> list[int]:
    stride, step = [], 1
    for d in reversed(shape):
        stride.append(step)
        step *= max(d, 1)
    return stride[::-1]
