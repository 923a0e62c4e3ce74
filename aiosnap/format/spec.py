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

__all__ = ["ArchiveSpec", "ChunkSpec", "EntrySpec", "PieceSpec", "SaveSpec"]

_STRICT = ConfigDict(strict=True)  # read back from a journal: JSON's types, no coercion


@dataclass(frozen=True, slots=True)
class EntrySpec:
    """One stored tensor (or pickled blob): where it sits in the state and its layout."""

    __pydantic_config__ = _STRICT

    path: str
    kind: str  # "tensor" | "pickle"
    dtype: str  # "float32", ...
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class PieceSpec:
    """``nbytes`` of entry ``entry`` (continuing its bytes in order) at ``dst_offset``."""

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

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def to_document(self) -> dict[str, Any]:
        """A JSON-able document (the spool journal's)."""
        return asdict(self)

    @classmethod
    def from_document(cls, doc: Any) -> SaveSpec:
        """Validate a document read back from disk, with JSON's strict types (``true`` is
        no number); ValueError (a pydantic ValidationError) if it is not a spec."""
        return _ADAPTER.validate_json(json.dumps(doc))


_ADAPTER: TypeAdapter[SaveSpec] = TypeAdapter(SaveSpec)
