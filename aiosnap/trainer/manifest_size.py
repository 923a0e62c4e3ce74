"""Whether the manifest of a save would be small enough to be read back (caller's thread).

A reader refuses a manifest over :data:`~aiosnap.format.manifest.MAX_MANIFEST_BYTES` unread,
so ``save()`` refuses a state whose manifest would be larger, naming its size and the paths
that make it large (a long string, a long list, a table of very many tensors). First a
cheap bound from what the flattener counted; only a state that passes it is weighed as
JSON. The commit checks the exact bytes again before it writes them (see
:func:`aiosnap.transfer.commit.commit_manifest`). Pure code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic_core import PydanticSerializationError, to_json

from ..errors import UnsupportedStateError
from ..format.manifest import MAX_MANIFEST_BYTES
from ..format.values import key_path, key_text
from .flatten import Flattener

__all__ = ["check_manifest_size"]

_NODE_BYTES = 64
"""Most bytes of one encoded value in the tree, text aside (a float, a tag, brackets)."""
_ENTRY_BYTES = 160
"""One entry's record in the table and its node in the tree, path, dims and ranges aside."""
_RANGE_BYTES = 128
"""One byte range of an entry (its object's name included)."""
_MIB = 1024**2
_MOST_CHILDREN = 1000
"""Containers with more items are reported as a whole, not item by item."""


def _weigh(value: Any) -> int:
    """Bytes of ``value`` as manifest JSON, written by the manifest's own serializer; 0 for
    what it cannot write (the commit's own check decides about that)."""
    try:
        return len(to_json(value))
    except (PydanticSerializationError, ValueError, TypeError, RecursionError):
        return 0


def _entries_weight(flat: Flattener, chunk_bytes: int) -> int:
    """A bound of the bytes of the entry tables (the shared one, and this rank's own)."""
    weight = 0
    for table in (flat, flat.local):
        if table is not None:
            count = len(table.entries)
            weight += (
                count * (_ENTRY_BYTES + 2 * _RANGE_BYTES) + table.table + table.nbytes // chunk_bytes * _RANGE_BYTES
            )
    return weight


def check_manifest_size(flat: Flattener, tree: Any, metadata: dict[str, Any], chunk_bytes: int) -> None:
    """Raise :class:`UnsupportedStateError` when the manifest of the state ``flat`` flattened
    into ``tree`` (with ``metadata``) would exceed what a reader accepts."""
    entries = _entries_weight(flat, chunk_bytes)
    meta = _weigh(metadata) if metadata else 2
    counted = [f for f in (flat, flat.local) if f is not None]
    bound = sum(f.nodes * _NODE_BYTES + f.text * 6 + f.exact for f in counted) + entries + meta
    if bound <= MAX_MANIFEST_BYTES:
        return  # the common case: far below, decided without looking at the tree again
    parts = [
        _weighed(node, path) for path, node in [("", tree), *zip(flat.local_paths, flat.local_values, strict=True)]
    ]
    total = sum(part.weight for part in parts) + entries + meta
    if total <= MAX_MANIFEST_BYTES:
        return
    heavy = [found for part in parts for found in _heavy_paths(part, total)]
    if entries * 16 >= total:
        heavy.append((entries, f"the table of its {len(flat.entries)} tensors"))
    if meta * 16 >= total:
        heavy.append((meta, "metadata"))
    shown = ", ".join(
        f"{_short(where)!r} ({weight / _MIB:.1f} MiB)" for weight, where in sorted(heavy, reverse=True)[:3]
    )
    raise UnsupportedStateError(
        f"the manifest of this save would be about {total / _MIB:.0f} MiB, more than the "
        f"{MAX_MANIFEST_BYTES // _MIB} MiB a reader accepts; most of it is in {shown}. Plain values "
        "(str, bytes, lists, dicts) are stored in the manifest: keep large data in tensors "
        "(bytes as torch.frombuffer(bytearray(data), dtype=torch.uint8)), or out of the state"
    )


def _children(node: Any, path: str) -> list[tuple[Any, str, int]] | None:
    """The children of a container node of the tree, with their paths and the bytes that
    go with each besides its own node (a dict's key, brackets, separators); None for a leaf."""
    if not isinstance(node, dict):
        return None
    tag = node.get("t")
    if tag in ("dict", "odict"):
        found = [(value, key_path(path, key if isinstance(key, str) else _shown(key)), _weigh(key) + 4)
                 for key, value in node["items"]]  # fmt: skip
        if "meta" in node:
            found.append((node["meta"], f"{path}#_metadata", 8))
        return found
    if tag in ("list", "tuple"):
        return [(value, key_path(path, index), 1) for index, value in enumerate(node["items"])]
    if tag == "stateful":
        return [(node["v"], path, 0)]
    return None


def _short(path: str) -> str:
    """A path as a message shows it (a key of a megabyte is a path of a megabyte)."""
    return path if len(path) <= 120 else f"{path[:100]}... ({len(path)} characters)"


def _shown(key: Any) -> str:
    """A key node as a path names it (a tuple's node, an int's text: short)."""
    return key_text(key) if not isinstance(key, dict) else f"<a {key.get('t')} key>"


@dataclass
class _Weight:
    """The bytes a node of the tree takes as JSON, and those of its children."""

    path: str
    weight: int
    children: list[_Weight]


def _weighed(node: Any, path: str) -> _Weight:
    """Weigh ``node`` once, bottom up: each leaf (and each container of more than
    :data:`_MOST_CHILDREN` items, as a whole) as JSON, containers as their children and
    their own few bytes."""
    children = _children(node, path)
    if children is None or len(children) > _MOST_CHILDREN:
        return _Weight(path, _weigh(node), [])
    parts = []
    for child, at, beside in children:
        part = _weighed(child, at)
        part.weight += beside  # a heavy key is named by its path, as a heavy value is
        parts.append(part)
    return _Weight(path, sum(p.weight for p in parts) + 24, parts)


def _heavy_paths(node: _Weight, total: int) -> list[tuple[int, str]]:
    """(bytes, path) of the nodes under ``node`` where at least a sixteenth of ``total``
    sits: the heavy children of a container are looked into; what its light ones weigh
    together is the container's own."""
    found: list[tuple[int, str]] = []
    pending = [node]
    while pending:
        current = pending.pop()
        heavy = [child for child in current.children if child.weight * 16 >= total]
        pending += heavy
        rest = current.weight - sum(child.weight for child in heavy)
        if rest * 16 >= total:
            found.append((rest, current.path or "state"))
    return found
