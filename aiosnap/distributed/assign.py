"""Which rank writes each replicated entry: pure, deterministic, the same on every rank.

Every rank holds the same replicated entries (checked when ranks agree in ``save()``); each
is written by exactly one rank, chosen so that the bytes each rank writes are balanced:
largest entries first, each to the rank with the fewest bytes so far (ties: the lowest
rank), counting the bytes a rank writes anyway (its DTensor shards, its rank-local values).
O(entries log entries + entries log ranks).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["assign_writers"]


def assign_writers(sizes: Sequence[int | None], preload: Sequence[int]) -> list[int | None]:
    """For each entry of size ``sizes[i]`` (None: not a replicated entry, written by whoever
    holds it), the rank that writes it; ``preload[r]`` is what rank ``r`` writes besides."""
    if not preload:
        raise ValueError("no ranks to assign writers to")
    load = [(int(bytes_), rank) for rank, bytes_ in enumerate(preload)]
    heapq.heapify(load)
    writers: list[int | None] = [None] * len(sizes)
    order = sorted((i for i, s in enumerate(sizes) if s is not None), key=lambda i: (-(sizes[i] or 0), i))
    for index in order:
        held, rank = heapq.heappop(load)
        writers[index] = rank
        heapq.heappush(load, (held + (sizes[index] or 0), rank))
    return writers
