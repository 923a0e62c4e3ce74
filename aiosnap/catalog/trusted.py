"""Manifests this process has validated, remembered by content (any thread).

Retention and the commit protocol ask every few saves whose each recent step is; validating
a manifest of tens of thousands of entries again each time costs about a second, hashing its
bytes milliseconds (see :mod:`aiosnap.catalog.steps`, the only user).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict

from ..format.manifest import Manifest

__all__ = ["TRUSTED", "TrustedManifests"]


class TrustedManifests:
    """Digests of manifests this process has validated, with their save ids: retention and
    the commit protocol ask every few saves whose each recent step is, and validating a
    manifest of tens of thousands of entries again each time costs about a second; hashing
    its bytes costs milliseconds. Keyed by step and content, so a manifest that changed
    (replaced, damaged) is validated afresh. Any thread (a lock guards the table)."""

    LIMIT = 256

    def __init__(self) -> None:
        self._known: OrderedDict[tuple[int, bytes], str] = OrderedDict()
        self._objects: weakref.WeakValueDictionary[tuple[int, bytes], Manifest] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    @staticmethod
    def _key(step: int, data: bytes) -> tuple[int, bytes]:
        return step, hashlib.blake2b(data, digest_size=32).digest()

    def learn(self, step: int, data: bytes, save_id: str) -> None:
        key = self._key(step, data)
        with self._lock:
            self._known[key] = save_id
            self._known.move_to_end(key)
            while len(self._known) > self.LIMIT:
                self._known.popitem(last=False)

    def save_id(self, step: int, data: bytes) -> str | None:
        key = self._key(step, data)
        with self._lock:
            return self._known.get(key)

    def keep_object(self, step: int, data: bytes, manifest: Manifest) -> None:
        """``manifest`` is ``data`` parsed, for as long as someone else holds it."""
        key = self._key(step, data)
        with self._lock:
            self._objects[key] = manifest

    def manifest(self, step: int, data: bytes) -> Manifest | None:
        key = self._key(step, data)
        with self._lock:
            return self._objects.get(key)


TRUSTED = TrustedManifests()
"""The one table of this process."""
