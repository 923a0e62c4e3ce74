"""Which objects a deletion must leave in place: every object a committed manifest names (its
own and its ``references``) and every object a save in flight in this process pins.

An incremental save's manifest names ranges of objects that earlier saves of its root wrote
(:attr:`~aiosnap.format.manifest.Manifest.references`), so the step that first wrote a frozen
weight may be deleted while its bytes stay, named by a later step. Every deletion of a
committed step's data (retention, rollback, purge, a re-save replacing an attempt, ``aiosnap
gc``) therefore deletes only what no committed manifest names and no pin holds.

The rule under concurrency (other processes' retention or gc while saves run):

- *Mark after list*: a deletion lists what it would delete first, then reads the pins, then
  the set of committed manifests (:func:`~aiosnap.catalog.steps.objects_to_keep`), then
  deletes what is listed and not kept. Pins are read before the manifests: a save that
  commits and releases its pin in between is seen through its manifest. A manifest gone by
  its read, or a listing of the committed steps that changed by the end of the mark (a
  newer step committed and its retention ran), makes the whole mark run again.
- A save references only objects that the newest committed step's manifest names (a save
  begun while an earlier one to its root is in flight waits for that one first), and checks
  that they exist right before its manifest is written; retention and gc never delete the newest committed step
  (nor anything it names), so what a save references stays while it runs.
- What remains: two writers committing to one root at once (a newer step of another writer
  may make this writer's base an old step that retention deletes between this writer's check
  and its commit), and ``rollback``/``purge`` run by another process during a save (stop the
  job first, as their docs say). A crash between a commit and its retention leaves old steps
  committed (the next retention deletes them); a crash in the middle of a deletion leaves
  objects no manifest names in folders without one, which only ``aiosnap gc`` removes.

Names are read from a manifest's JSON (:func:`names_in_manifest`): what is kept may only be
more than a reader would accept, never less. A manifest that a reader refuses (damaged,
hand-edited, newer; even one no longer JSON, such as a flipped top bit or a cut tail, which
may have lost every mention of what it references) keeps every object of every attempt of
its step and of all earlier steps (:meth:`KeptNames.hold_through`), so a damaged step that
is repaired still loads; what it kept goes once the step is repaired and retention or gc runs
again, or once the step is deleted (``rollback``, ``purge``). Pure code, no I/O; any thread
(a lock guards the cache).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from ..core.names import attempt_of_object

__all__ = ["KeptNames", "names_in_manifest"]


class KeptNames(set[str]):
    """Object names that must stay, and (:meth:`hold_through`) every object of every attempt
    folder up to a step: ``name in kept`` is true for both (see the module docstring)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        super().__init__(names)
        self.through = -1
        """Every object in an attempt folder of a step up to this one stays (-1: none)."""

    def hold_through(self, step: int) -> None:
        """Keep every object of every attempt of ``step`` and of the steps before it."""
        self.through = max(self.through, step)

    def __contains__(self, name: object) -> bool:
        if set.__contains__(self, name):
            return True
        if self.through < 0 or not isinstance(name, str):
            return False
        attempt = attempt_of_object(name)
        return attempt is not None and attempt[0] <= self.through

    def holds_under(self, prefix: str) -> bool:
        """Whether an object under the folder ``prefix`` is kept (for a backend that cannot
        list the folder)."""
        attempt = attempt_of_object(prefix + "/x")
        held = attempt is not None and attempt[0] <= self.through
        return held or any(name.startswith(prefix + "/") for name in self)


_CACHE_LIMIT = 64
_cache: OrderedDict[tuple[int, bytes], frozenset[str]] = OrderedDict()
_cache_lock = threading.Lock()


def names_in_manifest(step: int, data: bytes, *, valid: bool = False) -> frozenset[str]:
    """The object names the manifest ``data`` of ``step`` names: its own objects and its
    references when it is ``valid`` (a reader accepted it: its ranges name nothing else), and
    every other string in it that names an object in an attempt folder otherwise; a document
    that is not JSON names nothing here (the caller keeps every attempt up to its step: see
    :class:`KeptNames`). Remembered by content: the
    manifests of kept steps are read at every retention."""
    key = (step, hashlib.blake2b(data + (b"\x01" if valid else b"\x00"), digest_size=32).digest())
    with _cache_lock:
        found = _cache.get(key)
        if found is not None:
            _cache.move_to_end(key)
            return found
    found = _names(data, valid)
    with _cache_lock:
        _cache[key] = found
        while len(_cache) > _CACHE_LIMIT:
            _cache.popitem(last=False)
    return found


def _names(data: bytes, valid: bool) -> frozenset[str]:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return frozenset()  # the caller keeps every attempt up to its step (module docstring)
    if not isinstance(doc, dict):
        return frozenset()
    listed = _listed(doc.get("objects")) | _listed(doc.get("references"))
    if valid:
        return frozenset(listed)  # the ranges of a valid manifest name only listed objects
    return frozenset(listed | _every_object_name(doc))


def _listed(objects: Any) -> set[str]:
    if not isinstance(objects, list):
        return set()
    return {o["name"] for o in objects if isinstance(o, dict) and isinstance(o.get("name"), str)}


def _every_object_name(doc: Any) -> set[str]:
    """Every string in ``doc`` that names an object in an attempt folder (iteratively: a
    hostile document may nest deeply)."""
    found: set[str] = set()
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if attempt_of_object(node) is not None:
                found.add(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found
