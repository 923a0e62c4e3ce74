"""Planning a save: flatten the state, lay tensors out in chunks, name the objects.

Pure code, no I/O and no event loop; runs on the caller's thread inside ``save()``
(``state_dict()`` of Stateful objects must be taken before ``save()`` returns).

The state becomes a JSON *tree* (containers with type tags, plain values inline) whose
tensor leaves point into a table of :class:`Entry` objects. Entries are laid out in
chunks of at most ``chunk_bytes``: small tensors are batched into one chunk, a tensor
that does not fit in what is left of a chunk continues in the next one, so every chunk
but the last is full (slabs are used fully). Each chunk becomes one data object.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.gcpause import gc_paused
from ..core.names import STEP_LIMIT, object_prefix
from ..errors import StepOrderError, UnsupportedStateError
from ..format.classes import Row, describe
from ..format.spec import ArchiveSpec, ChunkSpec, DistSpec, EntrySpec, PieceSpec, SaveSpec, ShardSpec
from ..format.tree import shift_entry_ids
from ..format.values import check_metadata
from .archive_plan import attribute_tensors, layout_archive, torch_pickle
from .chunks import ALIGN, Chunk, Entry, Piece, SavePlan
from .dtensor import DTensorShard
from .flatten import Flattener
from .layout_memo import Layout, LayoutMemo
from .manifest_size import check_manifest_size

__all__ = ["Agreement", "Flattened", "layout_chunks", "make_plan"]


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def layout_chunks(entries: list[Entry], chunk_bytes: int, prefix: str) -> list[Chunk]:
    """Batch small entries and split large ones into chunks of at most ``chunk_bytes``."""
    if chunk_bytes < ALIGN:
        raise ValueError(f"chunk size must be at least {ALIGN} bytes, got {chunk_bytes}")
    chunks: list[Chunk] = []

    def new_chunk() -> Chunk:
        chunk = Chunk(len(chunks), f"{prefix}/{len(chunks)}.bin")
        chunks.append(chunk)
        return chunk

    current: Chunk | None = None
    for entry in entries:
        nbytes = entry.nbytes
        if nbytes == 0:
            continue
        if current is not None:  # the common case, inline: the whole entry fits in this chunk
            start = -(-current.nbytes // ALIGN) * ALIGN
            if start + nbytes <= chunk_bytes:
                current.pieces.append(Piece(entry.index, 0, nbytes, start))
                current.nbytes = start + nbytes
                continue
        itemsize = entry.tensor.element_size()
        offset = 0
        while offset < nbytes:
            if current is None:
                current = new_chunk()
            start = _aligned(current.nbytes)
            take = min(nbytes - offset, (chunk_bytes - start) // itemsize * itemsize)
            if take <= 0:
                current = None
                continue
            current.pieces.append(Piece(entry.index, offset, take, start))
            current.nbytes = start + take
            offset += take
    return chunks


@dataclass(frozen=True)
class Flattened:
    """A state flattened on the caller's thread, before ranks agree on who writes what."""

    tree: Any
    entries: list[Entry]  # the shared table, then this rank's rank-local entries
    main_entries: int
    shards: dict[int, DTensorShard]
    local_values: list[Any]  # ids into ``entries`` (past ``main_entries``)
    local_paths: list[str]  # where each rank-local value sits in the tree
    keys: Sequence[tuple[Any, ...] | None] = ()  # each main entry's view key (None: not a plain tensor)

    def table_rows(self) -> list[Row]:
        """The main entries as this rank's part describes them
        (:func:`aiosnap.format.parts.spec_table`), for :func:`aiosnap.format.classes.describe`;
        a plain tensor's layout from its view key (reading a tensor's attributes costs more)."""
        rows: list[Row] = []
        shards, dtypes, keys = self.shards, _DTYPE_NAMES, self.keys
        for entry in self.entries[: self.main_entries]:
            key = keys[entry.index] if keys else None
            if key is None:
                shape, dtype_of = entry.tensor.shape, entry.tensor.dtype
            else:
                _, _, shape, _, dtype_of, _ = key
            dtype = dtypes.get(dtype_of)
            if dtype is None:
                dtype = dtypes[dtype_of] = str(dtype_of).removeprefix("torch.")
            shard = shards.get(entry.index)
            if shard is None:
                rows.append((entry.path, entry.kind, dtype, shape, None))
            else:
                rows.append((entry.path, "sharded", dtype, shard.global_shape, shard.mesh))
        return rows

    def local_lines(self) -> list[str]:
        """Where the rank-local values are, as the ranks compare them."""
        return [f"{path}: rank-local value {slot}" for slot, path in enumerate(self.local_paths)]


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on for one save (:mod:`aiosnap.distributed.group`)."""

    save_id: str
    written: frozenset[int]  # the shared entries this rank writes
    coordinator: int
    commit_timeout: float
    table_of: int = 0  # the lowest rank holding the same table and tree (its part carries them)
    class_digest: str = ""  # what that table and tree are (the same on every rank of the class)
    buckets: tuple[int, ...] = ()  # digests of this rank's plain entries by bucket (who else holds them)
    checksums: tuple[tuple[int, int], ...] = ()  # (entry, crc32c) of what it holds that another class writes
    announced: tuple[str, ...] = ()  # the coordinator's: every rank's class digest, as the agreement gave it


def make_plan(
    state: dict[str, Any],
    *,
    step: int,
    chunk_bytes: int,
    rank: int = 0,
    world_size: int = 1,
    metadata: dict[str, Any] | None = None,
    single_file: bool = False,
    rank_local: Sequence[str] = (),
    agree: Callable[[Flattened], Agreement] | None = None,
    memo: LayoutMemo | None = None,
    pickle_values: bool = False,
) -> SavePlan:
    """Flatten ``state`` (calling ``state_dict()`` on Stateful values) and lay out its chunks;
    with ``single_file``, as one ``torch.load``-readable file (:mod:`.archive_plan`). A
    multi-rank save (``agree``: how the ranks agree, :meth:`Flattened` in, who writes what
    out) lays out only what this rank writes. ``memo``: the layout of the caller's last
    one-rank folder save, taken as is while the table stays the same (:mod:`.layout_memo`).
    ``pickle_values``: values only pickle can store are pickled; else they are refused.

    Everything a reader would refuse is refused here, before the ranks agree, with an
    :class:`UnsupportedStateError` (or a :class:`StepOrderError` for a step out of range):
    values outside :mod:`aiosnap.format.values`, metadata JSON cannot give back exactly, a
    manifest too large to be read."""
    if not isinstance(state, dict):
        raise UnsupportedStateError(f"state must be a dict, got {type(state).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < STEP_LIMIT:
        raise StepOrderError(f"step must be an int from 0 to {STEP_LIMIT - 1}, got {step!r:.40}")
    if metadata is not None:
        try:
            check_metadata(metadata)
        except ValueError as exc:
            raise UnsupportedStateError(f"metadata must be JSON that loads back as it is: {exc}") from None
    if single_file and world_size != 1:
        raise UnsupportedStateError(
            f"a single-file checkpoint is written by one process; rank {rank} of {world_size} cannot save "
            "into one (save to a folder root, or from one rank)"
        )
    if rank_local and single_file:
        raise UnsupportedStateError("rank_local values need a folder checkpoint (a single file holds one rank's state)")
    flattener = Flattener(rank_local, dtensors=not single_file, pickles=pickle_values)
    with gc_paused():
        tree = flattener.encode(state, "")  # on failure the caller leaves the agreement (see checkpointer)
    if flattener.refused:
        raise _pickles_refused(flattener.refused)
    check_manifest_size(flattener, tree, metadata or {}, chunk_bytes)
    if agree is None and (flattener.shards or flattener.local is not None):
        if world_size != 1:
            raise ValueError(f"rank {rank} of {world_size}: a multi-rank save needs the ranks' agreement")
        agree = _one_rank  # DTensors of a one-rank mesh, or rank-local values: the multi-rank format
    if agree is not None:
        return _distributed_plan(flattener, tree, step, chunk_bytes, rank, world_size, metadata, agree)
    with gc_paused():
        return _local_plan(flattener, tree, state, step, chunk_bytes, rank, world_size, metadata, single_file, memo)


def _pickles_refused(refused: list[tuple[str, str]]) -> UnsupportedStateError:
    shown = ", ".join(f"{path!r} ({what})" for path, what in refused[:10])
    if len(refused) > 10:
        shown += f" and {len(refused) - 10} more"
    return UnsupportedStateError(
        f"{len(refused)} value(s) of the state can only be pickled, which this checkpointer does not allow: "
        f"{shown}. Store them as plain data (tensors; str, int, float, bool, None, bytes; lists, tuples and "
        "dicts of them), or let save() pickle them with pickle_values: true in the config "
        "(Config(pickle_values=True)); loading them then needs load(..., allow_pickle=True)"
    )


def _local_plan(
    flattener: Flattener,
    tree: Any,
    state: dict[str, Any],
    step: int,
    chunk_bytes: int,
    rank: int,
    world_size: int,
    metadata: dict[str, Any] | None,
    single_file: bool,
    memo: LayoutMemo | None,
) -> SavePlan:
    """Caller's thread: lay out the chunks of a one-rank save (or a single file)."""
    save_id = uuid.uuid4().hex[:16]
    prefix = object_prefix(step, save_id, rank)
    archive: ArchiveSpec | None = None
    if single_file:
        found = attribute_tensors(flattener.entries)
        while found:  # tensors in the attributes of tensors (and in theirs): entries, as torch.save stores them
            known = len(flattener.entries)
            for path, tensor in found:
                flattener.add_tensor(tensor, path)
            found = attribute_tensors(flattener.entries[known:])
        chunks, header_offsets, tail_offset = layout_archive(flattener.entries, chunk_bytes, prefix)
        blob = torch_pickle(state, flattener.entry_of, flattener.stateful_dicts)
        archive = ArchiveSpec(tuple(header_offsets), tail_offset, base64.b64encode(blob).decode("ascii"))
        entry_specs, chunk_specs = _entry_specs(flattener.entries, flattener.keys), _chunk_specs(chunks)
    else:
        chunks, entry_specs, chunk_specs = _laid_out(flattener, chunk_bytes, prefix, memo)
    spec = SaveSpec(
        step=step,
        save_id=save_id,
        rank=rank,
        world_size=world_size,
        tree=tree,
        metadata=dict(metadata or {}),
        entries=entry_specs,
        chunks=chunk_specs,
        archive=archive,
    )
    return SavePlan(spec=spec, entries=flattener.entries, chunks=chunks)


def _laid_out(
    flattener: Flattener, chunk_bytes: int, prefix: str, memo: LayoutMemo | None
) -> tuple[list[Chunk], tuple[EntrySpec, ...], tuple[ChunkSpec, ...]]:
    """The chunks and specs of a table: the memo's when the table is the one it remembers,
    else laid out (and remembered, when every entry is a plain tensor)."""
    entries, keys = flattener.entries, flattener.keys
    paths = [entry.path for entry in entries]
    known = memo.recall(chunk_bytes, keys, paths) if memo is not None else None
    if known is not None:
        names = [f"{prefix}/{index}.bin" for index in range(len(known.chunk_sizes))]
        chunks = [
            Chunk(index, name, nbytes, pieces)
            for index, (name, nbytes, pieces) in enumerate(zip(names, known.chunk_sizes, known.pieces, strict=True))
        ]
        return chunks, known.entry_specs, known.chunk_specs(names)
    chunks = layout_chunks(entries, chunk_bytes, prefix)
    entry_specs, chunk_specs = _entry_specs(entries, keys), _chunk_specs(chunks)
    if memo is not None:
        if None in keys:
            memo.forget()  # a pickled value's bytes change from save to save
        else:
            sizes = tuple(c.nbytes for c in chunks)
            pieces = tuple(c.pieces for c in chunks)
            memo.remember(
                Layout(chunk_bytes, keys, paths, entry_specs, sizes, pieces, tuple(c.pieces for c in chunk_specs))
            )
    return chunks, entry_specs, chunk_specs


def _one_rank(flat: Flattened) -> Agreement:
    """The agreement of a job of one rank with itself: it writes everything."""
    described = describe(flat.table_rows(), flat.tree)
    return Agreement(
        uuid.uuid4().hex[:16], frozenset(range(flat.main_entries)), 0, 0.0, class_digest=described.class_digest,
        buckets=described.buckets, announced=(described.class_digest,),
    )  # fmt: skip


def _chunk_specs(chunks: list[Chunk]) -> tuple[ChunkSpec, ...]:
    return tuple(
        ChunkSpec(c.object_name, c.nbytes, tuple(PieceSpec(p.entry, p.nbytes, p.dst_offset) for p in c.pieces))
        for c in chunks
    )


def _distributed_plan(
    flattener: Flattener,
    tree: Any,
    step: int,
    chunk_bytes: int,
    rank: int,
    world_size: int,
    metadata: dict[str, Any] | None,
    agree: Callable[[Flattened], Agreement],
) -> SavePlan:
    """Caller's thread: join the rank-local entries to the table, agree, lay out this rank's part."""
    main = len(flattener.entries)
    entries = list(flattener.entries)
    local_values: list[Any] = []
    if flattener.local is not None:
        entries += [Entry(main + e.index, e.path, e.kind, e.tensor, e.nbytes) for e in flattener.local.entries]
        local_values = [shift_entry_ids(value, main) for value in flattener.local_values]
    flat = Flattened(tree, entries, main, flattener.shards, local_values, flattener.local_paths, flattener.keys)
    agreed = agree(flat)  # with the garbage collector running: this waits for the other ranks
    with gc_paused():
        return _rank_plan(flattener, flat, agreed, step, chunk_bytes, rank, world_size, metadata)


def _rank_plan(
    flattener: Flattener,
    flat: Flattened,
    agreed: Agreement,
    step: int,
    chunk_bytes: int,
    rank: int,
    world_size: int,
    metadata: dict[str, Any] | None,
) -> SavePlan:
    """Caller's thread: lay out what this rank writes of what the ranks agreed on."""
    entries, main, tree, local_values = flat.entries, flat.main_entries, flat.tree, flat.local_values
    writes = [e for e in entries[:main] if e.index in agreed.written] + entries[main:]
    chunks = layout_chunks(writes, chunk_bytes, object_prefix(step, agreed.save_id, rank))
    dist = DistSpec(
        coordinator=agreed.coordinator,
        commit_timeout=agreed.commit_timeout,
        main_entries=main,
        written=tuple(sorted(agreed.written)),
        shards=tuple(
            ShardSpec(index, shard.offsets, shard.global_shape, shard.mesh)
            for index, shard in sorted(flattener.shards.items())
        ),
        local_values=tuple(local_values),
        table_of=agreed.table_of,
        class_digest=agreed.class_digest,
        buckets=agreed.buckets,
        checksums=agreed.checksums,
        announced=agreed.announced,
    )
    spec = SaveSpec(
        step=step,
        save_id=agreed.save_id,
        rank=rank,
        world_size=world_size,
        tree=tree,
        metadata=dict(metadata or {}),
        entries=_entry_specs(entries, flattener.keys + (flattener.local.keys if flattener.local else [])),
        chunks=_chunk_specs(chunks),
        distributed=dist,
    )
    return SavePlan(spec=spec, entries=entries, chunks=chunks)


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_DEVICE_NAMES: dict[torch.device, str] = {}


def _entry_specs(entries: list[Entry], keys: Sequence[tuple[Any, ...] | None]) -> tuple[EntrySpec, ...]:
    """Each entry's layout as it is now, on the caller's thread (a later resize_ of a
    tensor cannot change what this save records); a plain tensor's from its view key."""
    dtypes, devices = _DTYPE_NAMES, _DEVICE_NAMES
    specs = []
    for entry, key in zip(entries, keys, strict=True):
        if key is None:
            tensor = entry.tensor
            shape, stride, dtype_of, device_of = tensor.shape, tensor.stride(), tensor.dtype, tensor.device
        else:
            _, _, shape, stride, dtype_of, device_of = key
        dtype = dtypes.get(dtype_of)
        if dtype is None:
            dtype = dtypes[dtype_of] = str(dtype_of).removeprefix("torch.")
        device = devices.get(device_of)
        if device is None:
            device = devices[device_of] = str(device_of)
        specs.append(EntrySpec(entry.path, entry.kind, dtype, tuple(shape), stride, device, entry.nbytes))
    return tuple(specs)
