"""Objects that saves in flight in this process reference: retention and gc here keep them.

An incremental save names ranges of objects that earlier saves of its root wrote. Until its
manifest is committed nothing in storage says so, so the save *pins* those objects here
first (:meth:`ReferencePins.pin`, before its first upload) and releases them after its
commit or failure (:meth:`ReferencePins.release`). Every deletion in this process
(:mod:`aiosnap.catalog.steps`, :mod:`aiosnap.catalog.garbage`) leaves pinned objects alone.
Pins are in-process only: another process's retention or gc cannot see them (see
:mod:`aiosnap.catalog.keep` for the rule that covers that case).

Thread-safe: saves pin on the checkpointer's loop thread, retention and gc may run on any.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable

__all__ = ["ReferencePins", "pins_for"]


class ReferencePins:
    """The objects of one storage root that saves in flight reference (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, frozenset[str]] = {}
        self._tokens = itertools.count(1)
        self._pinned: frozenset[str] = frozenset()

    def pin(self, names: Iterable[str]) -> int:
        """Keep ``names`` (root-relative object names) from every deletion in this process
        until :meth:`release` is called with the returned token."""
        held = frozenset(names)
        with self._lock:
            token = next(self._tokens)
            self._held[token] = held
            self._pinned = self._pinned | held
        return token

    def release(self, token: int) -> None:
        """Drop the pin ``token`` (one already released, or never issued, is ignored: a save
        may release in more than one cleanup path)."""
        with self._lock:
            if self._held.pop(token, None) is None:
                return
            self._pinned = frozenset().union(*self._held.values())

    def pinned(self) -> frozenset[str]:
        """Every object some pin holds now."""
        with self._lock:
            return self._pinned

    def __len__(self) -> int:
        """Pins held now."""
        with self._lock:
            return len(self._held)


_REGISTRY: dict[str, ReferencePins] = {}
_REGISTRY_LOCK = threading.Lock()


def pins_for(url: str) -> ReferencePins:
    """The pins of the storage root ``url`` (as :attr:`Storage.url
    <aiosnap.storage.base.Storage.url>` spells it): one registry per root in this process."""
    with _REGISTRY_LOCK:
        found = _REGISTRY.get(url)
        if found is None:
            found = _REGISTRY[url] = ReferencePins()
        return found
