"""A save described as plain data: what the transfer side needs to write and commit it.

:class:`SaveSpec` is taken on the caller's thread when the save is planned (dtypes, shapes
and strides as they were at ``save()``), holds no tensor, crosses to the upload process as
a small message, goes into the spool journal as JSON, and becomes the manifest at commit
(:func:`aiosnap.format.manifest.build_manifest`): the manifest is built once per save, by
whoever commits it. Read back from a journal it is untrusted input, checked strictly here
and again, completely, by the manifest it becomes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from pydantic import ConfigDict, TypeAdapter

from ..core.gcpause import gc_paused

__all__ = ["AlsoSpec", "ArchiveSpec", "ChunkSpec", "DistSpec", "EntrySpec", "PieceSpec", "SaveSpec", "ShardSpec"]

_STRICT = ConfigDict(strict=True)  # read back from a journal: JSON's types, no coercion


@dataclass(slots=True)
class EntrySpec:
    """One stored tensor (or pickled blob): where it sits in the state and its layout.

    Never changed once made; not frozen because a frozen dataclass costs four times as
    much to make, on the caller's thread, once per tensor (as :class:`PieceSpec`)."""

    __pydantic_config__ = _STRICT

    path: str
    kind: str  # "tensor" | "pickle"
    dtype: str  # "float32", ...
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device: str
    nbytes: int


@dataclass(slots=True)
class PieceSpec:
    """``nbytes`` of entry ``entry`` (continuing its bytes in order) at ``dst_offset``
    (never changed once made; see :class:`EntrySpec`)."""

    __pydantic_config__ = _STRICT

    entry: int
    nbytes: int
    dst_offset: int


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """One data object."""

    __pydantic_config__ = _STRICT

    object_name: str
    nbytes: int
    pieces: tuple[PieceSpec, ...]


@dataclass(frozen=True, slots=True)
class ArchiveSpec:
    """A save written as one ``torch.load``-readable file (:mod:`aiosnap.format.archive`):
    the chunks are consecutive byte ranges of the file; this is what its tail needs."""

    __pydantic_config__ = _STRICT

    header_offsets: tuple[int, ...]  # each entry's local header in the file
    tail_offset: int  # where the chunks end
    pickle: str  # data.pkl, base64


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Entry ``entry`` (kind ``sharded``) is this rank's shard of a DTensor: its box."""

    __pydantic_config__ = _STRICT

    entry: int
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    mesh: int = 0  # the DTensor's device mesh (its shards on one mesh tile it)


@dataclass(frozen=True, slots=True)
class DistSpec:
    """A rank's part of a multi-rank save (see :mod:`aiosnap.distributed`).

    Entries ``[0, main_entries)`` are the state's shared table (what this rank holds;
    ranks may hold different tables: pipeline stages); the rest are this rank's rank-local
    values, whose trees ``local_values`` (one per ``rank_local`` slot of the tree) name
    them. This rank writes the main entries ``written`` and all of its rank-local ones.
    ``table_of``: the lowest rank whose table and tree are this rank's (its part carries
    them, ``class_digest`` says which they are); ``buckets``: digests of this rank's plain
    entries by bucket (:mod:`aiosnap.distributed.ownership`), which tell the coordinator's
    merge which copies of an entry held by several ranks are expected; ``checksums``: the
    crc32c of each plain tensor this rank holds but a rank of another class writes, for the
    merge to compare (a value several ranks hold is written once only if they hold the same
    bytes); ``announced``: the coordinator's only, every rank's class digest as the
    agreement gave it (what each part must hold)."""

    __pydantic_config__ = _STRICT

    coordinator: int
    commit_timeout: float
    main_entries: int
    written: tuple[int, ...]
    shards: tuple[ShardSpec, ...]
    local_values: tuple[Any, ...]
    table_of: int = 0
    class_digest: str = ""
    buckets: tuple[int, ...] = ()
    checksums: tuple[tuple[int, int], ...] = ()
    announced: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AlsoSpec:
    """The save also writes the tensors at ``paths`` (glob patterns; None: all) in another
    format, from the same capture, committed with the step: ``safetensors`` (Hugging Face
    shards of at most ``max_shard_size`` tensor bytes, named by stripping ``strip``; see
    :mod:`aiosnap.interop.safetensors.live`)."""

    __pydantic_config__ = _STRICT

    format: str
    paths: tuple[str, ...] | None
    strip: str
    max_shard_size: int
    metadata: dict[str, str]


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Everything about one save attempt except its bytes."""

    __pydantic_config__ = _STRICT

    step: int
    save_id: str
    rank: int
    world_size: int
    tree: Any
    metadata: dict[str, Any]
    entries: tuple[EntrySpec, ...]
    chunks: tuple[ChunkSpec, ...]
    archive: ArchiveSpec | None = None
    distributed: DistSpec | None = None
    also: AlsoSpec | None = None

    @property
    def total_bytes(self) -> int:
        """The bytes this save writes (of a multi-rank save: this rank's part)."""
        if self.distributed is None:
            return sum(e.nbytes for e in self.entries)
        dist = self.distributed
        return sum(self.entries[i].nbytes for i in dist.written) + sum(
            e.nbytes for e in self.entries[dist.main_entries :]
        )

    def to_document(self) -> dict[str, Any]:
        """A JSON-able document (the spool journal's)."""
        return asdict(self)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (to the upload process) with its entries and pieces as columns of plain
        values, which pickle at C speed: field by field, the tens of thousands of small
        objects of a many-tensor save cost ~0.4 s each way, on the loop thread while
        ``save()`` waits."""
        entries = self.entries
        columns = (
            [e.path for e in entries], [e.kind for e in entries], [e.dtype for e in entries],
            [e.shape for e in entries], [e.stride for e in entries], [e.device for e in entries],
            [e.nbytes for e in entries],
        )  # fmt: skip
        chunks = [
            (c.object_name, c.nbytes, [p.entry for p in c.pieces], [p.nbytes for p in c.pieces],
             [p.dst_offset for p in c.pieces])
            for c in self.chunks
        ]  # fmt: skip
        head = (self.step, self.save_id, self.rank, self.world_size, self.tree, self.metadata)
        return _unpickle_save_spec, (head, columns, chunks, self.archive, self.distributed, self.also)

    @classmethod
    def from_document(cls, doc: Any) -> SaveSpec:
        """Validate a document read back from disk, with JSON's strict types (``true`` is
        no number), and that its indices hold together (every piece names an entry and lies
        inside its chunk, each entry this rank writes is its pieces, a multi-rank part's
        entries are in range); ValueError (a pydantic ValidationError) if it is not a spec.

        The tree, the metadata and the rank-local values (any JSON, checked completely by
        the manifest the spec makes) are set aside while the rest is validated: pydantic's
        JSON parser stops at 200 levels, short of :data:`~aiosnap.format.values.MAX_TREE_DEPTH`
        inside a journal record."""
        if not isinstance(doc, dict):
            raise ValueError("a save spec is a JSON object")
        shallow = dict(doc)
        deep = {name: shallow.pop(name) for name in ("tree", "metadata") if name in shallow}
        for name in deep:
            shallow[name] = {} if name == "metadata" else None
        local_values: Any = ()
        dist = shallow.get("distributed")
        if isinstance(dist, dict) and "local_values" in dist:
            local_values = dist["local_values"]
            shallow["distributed"] = {**dist, "local_values": []}
            if not isinstance(local_values, list):
                raise ValueError("distributed.local_values must be a list")
        if not isinstance(deep.get("metadata", {}), dict):
            raise ValueError("metadata must be an object")
        spec = _ADAPTER.validate_json(json.dumps(shallow))
        if spec.distributed is not None:
            spec = replace(spec, distributed=replace(spec.distributed, local_values=tuple(local_values)))
        spec = replace(spec, tree=deep.get("tree"), metadata=deep.get("metadata", {}))
        _check_indices(spec)
        return spec


_ADAPTER: TypeAdapter[SaveSpec] = TypeAdapter(SaveSpec)


def _check_indices(spec: SaveSpec) -> None:
    """ValueError unless the indices of ``spec`` (read back from a journal) hold together."""
    if not (spec.step >= 0 and 0 <= spec.rank < spec.world_size):
        raise ValueError(f"step {spec.step}, rank {spec.rank} of {spec.world_size} ranks")
    count = len(spec.entries)
    if any(not 0 <= e.nbytes < _MAX_BYTES for e in spec.entries):
        raise ValueError("an entry's size is out of range")
    stored = [0] * count
    for chunk in spec.chunks:
        if not 0 <= chunk.nbytes < _MAX_BYTES:
            raise ValueError(f"object {chunk.object_name!r:.80}: size {chunk.nbytes} is out of range")
        for piece in chunk.pieces:
            if not 0 <= piece.entry < count:
                where = f"object {chunk.object_name!r:.80}"
                raise ValueError(f"{where}: a piece of entry {piece.entry}, but the save has {count} entries")
            if not (piece.nbytes > 0 and piece.dst_offset >= 0 and piece.dst_offset + piece.nbytes <= chunk.nbytes):
                raise ValueError(f"object {chunk.object_name!r:.80}: a piece runs outside the object")
            stored[piece.entry] += piece.nbytes
    writes: list[int] | range = range(count)
    dist = spec.distributed
    if dist is not None:
        if not 0 <= dist.main_entries <= count:
            raise ValueError(f"{dist.main_entries} shared entries of {count}")
        if list(dist.written) != sorted(set(dist.written)) or not all(0 <= i < dist.main_entries for i in dist.written):
            raise ValueError("the entries this rank writes are out of range, out of order or listed twice")
        boxes = [s.entry for s in dist.shards]
        if len(set(boxes)) != len(boxes) or not all(0 <= i < dist.main_entries for i in boxes):
            raise ValueError("a DTensor shard names an entry out of range, or one twice")
        for shard in dist.shards:
            if not len(shard.offsets) == len(shard.global_shape) == len(spec.entries[shard.entry].shape):
                raise ValueError(f"entry {shard.entry}: the shard's box does not match its dimensions")
        writes = [*dist.written, *range(dist.main_entries, count)]
    written = set(writes)
    for index in range(count):
        if stored[index] != (spec.entries[index].nbytes if index in written else 0):
            raise ValueError(f"entry {index} ({spec.entries[index].path!r:.80}): its pieces are not its bytes")


_MAX_BYTES = 2**63


def _unpickle_save_spec(
    head: tuple[Any, ...],
    columns: tuple[list[Any], ...],
    chunks: list[tuple[str, int, list[int], list[int], list[int]]],
    archive: ArchiveSpec | None,
    distributed: DistSpec | None,
    also: AlsoSpec | None = None,
) -> SaveSpec:
    """The inverse of :meth:`SaveSpec.__reduce__` (in the upload process)."""
    step, save_id, rank, world_size, tree, metadata = head
    with gc_paused():
        entries = tuple(map(EntrySpec, *columns))
        laid_out = tuple(
            ChunkSpec(name, nbytes, tuple(map(PieceSpec, entry_ids, sizes, offsets)))
            for name, nbytes, entry_ids, sizes, offsets in chunks
        )
    return SaveSpec(step, save_id, rank, world_size, tree, metadata, entries, laid_out, archive, distributed, also)
