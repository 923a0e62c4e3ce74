"""What the trainer side hands the transfer side: small descriptors, never bytes.

A captured chunk is either in a slab of the staging arena (:class:`SlabChunk`: the slab's
id) or in a spool file on local disk (:class:`FileChunk`: its path and the checksums it was
written with). In ``upload.executor: process`` mode these are the messages that cross to the
upload process; the bytes stay where they are. The transfer side tells the trainer side when
it is done with each one (:class:`TransferListener`), landed or not, so the slab or the
spool file can go.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..format.placement import Landing
    from ..format.spec import SaveSpec
    from ..storage.base import Storage

__all__ = ["FileChunk", "SlabChunk", "Staged", "Transfer", "TransferListener", "TransferOutcome"]


@dataclass(frozen=True, slots=True)
class SlabChunk:
    """Chunk ``index`` of save ``save_id``: its first ``nbytes`` in arena slab ``slab``."""

    save_id: str
    index: int
    slab: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class FileChunk:
    """Chunk ``index`` of save ``save_id`` in the spool file ``path``, written with crc32c
    ``crc`` (whole file) and ``pieces`` (each byte range), ``digests`` the xxh3-128 of each
    byte range (empty: not computed)."""

    save_id: str
    index: int
    path: str
    nbytes: int
    crc: int
    pieces: tuple[int, ...]
    digests: tuple[str, ...] = ()


Staged = SlabChunk | FileChunk


@dataclass(frozen=True)
class TransferOutcome:
    """How one save ended on the transfer side."""

    committed: bool
    error: BaseException | None = None
    """The failure (None when committed; a committed save never carries one)."""
    deleted_steps: tuple[int, ...] = ()
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """upload, commit."""


class TransferListener(Protocol):
    """What the transfer side tells the trainer side, on the trainer's loop thread."""

    def preflight(self, save_id: str, latest: int | None, error: BaseException | None) -> None:
        """The latest committed step of the save's root (or why it could not be read)."""

    def done_with(self, save_id: str, index: int, pieces: Landing | None) -> None:
        """Chunk ``index`` landed (``pieces``: where each of its byte ranges is, with its
        crc32c) or will not be uploaded (None); either way its slab or spool file is the
        trainer's again."""

    def sent(self, save_id: str, index: int, nbytes: int) -> None:
        """``nbytes`` more of chunk ``index`` reached storage (a request of its upload
        completed); :meth:`done_with` says when the whole chunk has landed."""

    def stage_ended(self, save_id: str, stage: str, nbytes: int, seconds: float) -> None:
        """A stage of the save (``upload``, ``commit``) is over."""

    def finished(self, save_id: str, outcome: TransferOutcome) -> None:
        """The save is over: every chunk staged so far was reported through :meth:`done_with`
        before; a chunk staged later (capture had not heard yet) is handed back at once."""


class Transfer(Protocol):
    """What the trainer side tells the transfer side (on the trainer's loop thread); the
    transfer side answers through the :class:`TransferListener` it was made with."""

    def open_root(self, url: str, storage: Storage | None = None) -> None:
        """Saves to ``url`` go through ``storage`` (made from the URL when None)."""

    def begin(self, save_id: str, url: str, keep_last: int | None, spec: SaveSpec) -> None:
        """A save starts (the transfer side looks at the root: preflight)."""

    def staged(self, chunk: Staged) -> None:
        """A captured chunk, to upload."""

    def may_upload(self, save_id: str) -> None:
        """Capture would wait for RAM or spool disk: uploads may start before it is done."""

    def captured(self, save_id: str) -> None:
        """Every chunk of the save is staged."""

    def abort(self, save_id: str, *, even_committing: bool = False) -> None:
        """Give the save up, unless its commit has begun (or even then: ``close(timeout)``
        running out interrupts a commit, whose outcome is then read back)."""

    async def close(self) -> None:
        """Stop (after the trainer side drained its saves) and free everything."""
