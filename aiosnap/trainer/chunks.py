"""What a save plan is made of: entries (the tensors to store), pieces (where each entry's
bytes go) and chunks (the data objects), and the plan itself. Plain data, no I/O; made on
the caller's thread by :mod:`.plan` (a folder save) and :mod:`.archive_plan` (a single file),
read by the capture (:mod:`.capture`) and the spool (:mod:`.spool`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..format.spec import SaveSpec

__all__ = ["ALIGN", "Chunk", "Entry", "Piece", "SavePlan"]

ALIGN = 64
"""Byte alignment of each piece inside a chunk (vectorised copies, dtype views)."""


@dataclass(slots=True)
class Entry:
    """One tensor (or one pickled object, as bytes) to be stored. Not frozen (a frozen
    dataclass costs four times as much to make, and a state may hold tens of thousands of
    tensors); never changed once made."""

    index: int
    path: str
    kind: str  # "tensor" | "pickle" | "sharded" (a DTensor's local shard)
    tensor: torch.Tensor  # the source; for "pickle", a uint8 tensor of the pickled bytes
    nbytes: int


@dataclass(slots=True)
class Piece:
    """Bytes ``[src_offset, src_offset + nbytes)`` of an entry, at ``dst_offset`` of a chunk.
    Never changed once made (not frozen, as :class:`Entry`)."""

    entry: int
    src_offset: int
    nbytes: int
    dst_offset: int


@dataclass
class Chunk:
    """One data object: several small entries, or a slice of a large one."""

    index: int
    object_name: str
    nbytes: int = 0
    pieces: list[Piece] = field(default_factory=list)
    constants: list[tuple[int, bytes]] = field(default_factory=list)
    """Bytes the copier writes at these offsets besides the pieces (a single-file save's
    zip headers and padding)."""

    @property
    def payload(self) -> int:
        """The state's bytes in this chunk (its pieces; not the padding between them, nor
        the constants): what a save's progress counts."""
        return sum(piece.nbytes for piece in self.pieces)


@dataclass
class SavePlan:
    """Everything the capture needs (the source tensors, where each piece goes) and the
    save's :class:`SaveSpec` (plain data, for the transfer side); copies nothing."""

    spec: SaveSpec
    entries: list[Entry]
    chunks: list[Chunk]
    handed_over: bool = False
    """Set on the loop thread once the transfer side owns the save: from then on only it
    settles the save's outcome (a multi-rank save's markers included)."""

    @property
    def step(self) -> int:
        return self.spec.step

    @property
    def save_id(self) -> str:
        return self.spec.save_id

    @property
    def total_bytes(self) -> int:
        return self.spec.total_bytes
