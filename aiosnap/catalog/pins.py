"""Objects that saves in flight reference: retention and gc in this process keep them.

An incremental save names ranges of objects an earlier step wrote (its references). From
before its first upload until its commit or failure, those objects are *pinned* here, one
registry per storage root (:func:`pins_for`), so that retention and ``aiosnap gc`` running
in this process do not delete them under the save. Any thread (a lock guards the counts).
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Iterable

__all__ = ["ReferencePins", "pins_for"]


class ReferencePins:
    """Pinned object names of one storage root, counted per save (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._held: dict[int, frozenset[str]] = {}
        self._counts: Counter[str] = Counter()

    def pin(self, names: Iterable[str]) -> int:
        """Pin ``names``; the token to :meth:`release` them with."""
        held = frozenset(names)
        with self._lock:
            token = next(self._tokens)
            self._held[token] = held
            self._counts.update(held)
        return token

    def release(self, token: int) -> None:
        """Unpin what ``token`` pinned (a token released already: nothing)."""
        with self._lock:
            held = self._held.pop(token, frozenset())
            self._counts.subtract(held)
            for name in held:
                if self._counts[name] <= 0:
                    del self._counts[name]

    def pinned(self) -> frozenset[str]:
        """Every name some save holds pinned now."""
        with self._lock:
            return frozenset(self._counts)


_REGISTRIES: dict[str, ReferencePins] = {}
_REGISTRIES_LOCK = threading.Lock()


def pins_for(url: str) -> ReferencePins:
    """The registry of the storage root ``url`` (one per url in this process)."""
    with _REGISTRIES_LOCK:
        return _REGISTRIES.setdefault(url, ReferencePins())
