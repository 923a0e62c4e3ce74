"""Whether the ranks holding one value hold the same bytes: the coordinator's merge writes a
value several ranks hold once, so they must (:mod:`aiosnap.format.merge`). Pure code.

What is compared, all by crc32c of the values' row-major bytes:

- the copies that several writer groups wrote of one entry (a tied embedding on the first
  and the last pipeline stage), each copy's crc32c combined from its byte ranges';
- the crc32c that holders of an entry ship when a rank of another class wrote it
  (:class:`~aiosnap.format.parts.ChecksumRecord`);
- the entries a tie leaves out (one rank's entry named at another's key), against the kept one;
- a DTensor's boxes written on several device meshes (each mesh's boxes tile it; one mesh's
  are kept), box by box where the meshes cut it alike.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ..core.checksums import crc32c_combine
from ..errors import CorruptCheckpointError, RanksDisagreeError
from .manifest import ByteRange
from .parts import WrittenRecord
from .union import COLLIDING_OPTIMIZERS

__all__ = ["Claim", "differing_boxes", "disagreement", "value_crc32c"]

Claim = tuple[int, int]
"""(rank, crc32c): what one rank holds of a value."""

_BY_INDEX = re.compile(r"(^|/)state/[0-9]+(/|$)")
"""The path of a torch optimizer's state saved as its own state dict (by parameter index)."""


def value_crc32c(ranges: Iterable[ByteRange]) -> int:
    """The crc32c of the bytes of ``ranges`` one after the other (an entry, a box)."""
    crc = 0
    for r in ranges:
        if r.crc32c is None:  # only a manifest translated from a foreign format lacks them
            raise CorruptCheckpointError(f"the byte range {r.offset} of {r.object!r} has no crc32c")
        crc = crc32c_combine(crc, r.crc32c, r.nbytes)
    return crc


def disagreement(step: int, path: str, kept: Claim, other: Claim) -> RanksDisagreeError:
    """The error for two ranks holding different bytes at ``path``."""
    hint = (
        COLLIDING_OPTIMIZERS
        if _BY_INDEX.search(path)
        else "values that differ between ranks belong in rank_local=[...]"
    )
    return RanksDisagreeError(
        f"step {step}: different values at one path: {path!r}: rank {other[0]} holds other bytes than rank "
        f"{kept[0]} (crc32c {other[1]:08x}, not {kept[1]:08x}); a value several ranks hold is written once, so "
        f"every rank holding it must hold the same; {hint}"
    )


def _by_box(boxes: Sequence[tuple[int, WrittenRecord]]) -> dict[tuple[tuple[int, ...], tuple[int, ...]], Claim]:
    return {(tuple(r.offsets or ()), tuple(r.shape)): (rank, value_crc32c(r.ranges)) for rank, r in boxes}


def differing_boxes(
    kept: Sequence[tuple[int, WrittenRecord]], other: Sequence[tuple[int, WrittenRecord]]
) -> tuple[Claim, Claim] | None:
    """A box two meshes' boxes of one DTensor hold with different bytes; None when they
    agree, or cut the tensor differently (then they cannot be compared box by box)."""
    mine, theirs = _by_box(kept), _by_box(other)
    if len(mine) != len(kept) or mine.keys() != theirs.keys():
        return None
    for box, claim in mine.items():
        if theirs[box][1] != claim[1]:
            return claim, theirs[box]
    return None
