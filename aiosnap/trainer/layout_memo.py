"""The layout of a checkpointer's last save, reused while the state's tensors keep theirs.

A training loop saves the same structure again and again: the same tensors, at the same
paths, with the same shapes. Laying out chunks and describing every entry costs a few
microseconds per tensor on the caller's thread; with tens of thousands of tensors that is a
good part of what ``save()`` blocks for. So the last layout is remembered, and the next
plan takes it as is when its flattened table is equal, entry by entry: the same path, and
the same view key (storage address, offset, shape, strides, dtype, device; see
:meth:`aiosnap.trainer.plan._Flattener._plain`). Equal tables have equal entry specs and
equal chunk layouts (a layout depends only on the entries' sizes), so nothing but the
objects' names (which carry the save id) is made again.

The memo holds no tensor (only the keys' integers and the specs), so it never keeps a
state's memory alive. Caller's thread: any thread that calls ``save()``; two saves racing
on one checkpointer can only miss and lay out afresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..format.spec import ChunkSpec, EntrySpec, PieceSpec

__all__ = ["Layout", "LayoutMemo"]


@dataclass(frozen=True)
class Layout:
    """A laid-out table: what a plan with an equal table can take as its own."""

    chunk_bytes: int
    keys: Sequence[Any]  # each entry's view key
    paths: Sequence[str]
    entry_specs: tuple[EntrySpec, ...]
    chunk_sizes: tuple[int, ...]
    pieces: tuple[list[Any], ...]  # each chunk's pieces (:class:`~.plan.Piece`), shared, never changed
    piece_specs: tuple[tuple[PieceSpec, ...], ...]

    def chunk_specs(self, names: Sequence[str]) -> tuple[ChunkSpec, ...]:
        return tuple(
            ChunkSpec(name, nbytes, pieces)
            for name, nbytes, pieces in zip(names, self.chunk_sizes, self.piece_specs, strict=True)
        )


class LayoutMemo:
    """The last :class:`Layout` of one checkpointer's saves."""

    def __init__(self) -> None:
        self._last: Layout | None = None

    def recall(self, chunk_bytes: int, keys: Sequence[Any], paths: Sequence[str]) -> Layout | None:
        """The remembered layout if the table (``keys``, ``paths``) is equal to its own."""
        last = self._last
        if last is None or last.chunk_bytes != chunk_bytes or len(last.keys) != len(keys):
            return None
        if last.keys != keys or last.paths != paths:  # compared in C, element by element
            return None
        return last

    def remember(self, layout: Layout) -> None:
        self._last = layout

    def forget(self) -> None:
        self._last = None
