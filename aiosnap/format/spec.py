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
from dataclasses import asdict, dataclass
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
        no number); ValueError (a pydantic ValidationError) if it is not a spec."""
        return _ADAPTER.validate_json(json.dumps(doc))


_ADAPTER: TypeAdapter[SaveSpec] = TypeAdapter(SaveSpec)


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
