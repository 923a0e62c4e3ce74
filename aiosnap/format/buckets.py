"""Buckets of plain entries by path: the same on every rank and in the coordinator's merge.

An entry's bucket comes from its path with every run of digits replaced by ``#``, so the
entries that differ between ranks in a pipeline or expert-parallel job
(``layers.3.experts.5.w1``, ``layers.7.experts.2.w1``) gather in the buckets of their
patterns, and the buckets of entries every rank holds keep one digest on every rank
(:mod:`aiosnap.distributed.ownership`). Pure code.
"""

from __future__ import annotations

import re
from functools import lru_cache

from ..core.checksums import crc32c_of

__all__ = ["BUCKETS", "bucket_of"]

BUCKETS = 24
"""Buckets of plain entries; one 64-bit digest each in a save's agreement."""
_DIGITS = re.compile(r"[0-9]+")


@lru_cache(maxsize=1 << 17)
def bucket_of(path: str) -> int:
    """The bucket of the entry at ``path``."""
    return crc32c_of(_DIGITS.sub("#", path).encode()) % BUCKETS
