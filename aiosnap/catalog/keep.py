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
hand-edited, newer; even one no longer JSON, such as a flipped top bit or a cut tail) keeps
every object in every attempt folder its bytes mention (a damaged name still lies in a folder
that its other names mention), so a damaged step that is repaired still loads. Such a folder
is kept as an element ``"<step folder>/<save id>/"`` of :class:`KeptNames`. Pure code, no
I/O; any thread (a lock guards the cache).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from typing import Any

from ..core.names import attempt_of_object

__all__ = ["KeptNames", "names_in_manifest"]

_ATTEMPT_IN_TEXT = re.compile(r"(?<![0-9])([0-9]{12,20})/([0-9a-f]{16})/")


class KeptNames(set[str]):
    """Object names that must stay, and attempt folders (elements ending in ``/``) all of
    whose objects must: ``name in kept`` is true for both (see the module docstring)."""

    def __contains__(self, name: object) -> bool:
        if set.__contains__(self, name):
            return True
        if not isinstance(name, str):
            return False
        parts = name.split("/", 2)
        return len(parts) == 3 and set.__contains__(self, f"{parts[0]}/{parts[1]}/")


_CACHE_LIMIT = 64
_cache: OrderedDict[tuple[int, bytes], frozenset[str]] = OrderedDict()
_cache_lock = threading.Lock()


def names_in_manifest(step: int, data: bytes, *, valid: bool = False) -> frozenset[str]:
    """The object names the manifest ``data`` of ``step`` names: its own objects and its
    references when it is ``valid`` (a reader accepted it: its ranges name nothing else), and
    every other string in it that names an object in an attempt folder otherwise, and every
    attempt folder its bytes mention (``"<step folder>/<save id>/"``: all of its objects stay;
    see :class:`KeptNames`), JSON or not (a damaged manifest may be repaired). Remembered by content: the
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
        doc = None
    if valid:  # the ranges of a valid manifest name only listed objects
        return (
            frozenset(_listed(doc.get("objects")) | _listed(doc.get("references")))
            if isinstance(doc, dict)
            else frozenset()
        )
    found = _attempt_folders(data)
    if isinstance(doc, dict):
        found |= _listed(doc.get("objects")) | _listed(doc.get("references"))
    if doc is not None:
        found |= _every_object_name(doc)
    return frozenset(found)


def _attempt_folders(data: bytes) -> set[str]:
    """Every attempt folder (``"<step folder>/<save id>/"``) the bytes of a refused manifest
    mention, read as Latin-1 (every byte a character: damage cannot stop the scan)."""
    found: set[str] = set()
    for match in _ATTEMPT_IN_TEXT.finditer(data.decode("latin-1")):
        folder = f"{match[1]}/{match[2]}/"
        if attempt_of_object(folder + "x") is not None:  # a step folder aiosnap would write
            found.add(folder)
    return found


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
