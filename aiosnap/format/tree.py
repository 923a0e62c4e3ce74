"""The state's tree as a manifest stores it: checked as untrusted input, decoded to values.

The tree is JSON: plain leaves (``None``, ``bool``, ``int``, ``float``, ``str``) inline, and
nodes ``{"t": TAG, ...}`` for everything else. ``{"t": "tensor", "id": N}`` and
``{"t": "pickle", "id": N}`` point into the manifest's entry table; in a multi-rank
checkpoint ``{"t": "dtensor", "id": N}`` names a sharded entry and ``{"t": "rank_local",
"slot": N}`` stands for a value every rank saved for itself (kept beside the tree, per rank).

A manifest is read back from storage that other people may write, so :func:`check_tree`
validates every node (tags, field types, entry references whose kind must match the tag,
nesting depth, hashable dict keys) before anything acts on it; the decoder
(:mod:`aiosnap.load.decode`) enforces the pickle opt-in itself. Pure code, no torch; runs
on whichever thread calls.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from typing import Any

from .dtypes import dtype_itemsize
from .values import (
    DEVICE_TYPES,
    MAX_INT_DIGITS,
    MAX_TREE_DEPTH,
    float_text,
    inline_int,
    inline_str,
    key_text,
    plain_device,
    plain_size,
)

__all__ = [
    "DEVICE_TYPES",
    "HASHABLE_TAGS",
    "MAX_TREE_DEPTH",
    "check_tree",
    "float_text",
    "key_identity",
    "shift_entry_ids",
]

_CONTAINERS = {"dict", "odict", "list", "tuple", "stateful"}
HASHABLE_TAGS = frozenset({"float", "complex", "bytes", "dtype", "device", "size", "tensor", "pickle"})
"""Leaf tags whose values can be dict keys (as can plain leaves, and tuples of keys)."""
_MAX_SLOTS = 2**20
_ENTRY_KINDS = {"tensor": "tensor", "pickle": "pickle", "dtensor": "sharded"}
"""Tree tags that name an entry, and the kind of entry each must name."""


def _fields(node: dict[str, Any], *names: str) -> None:
    extra = set(node) - {"t", *names}
    if extra:
        raise ValueError(f"unexpected field(s) {sorted(extra)!r} in a {node['t']!r} node")
    missing = [n for n in names if n not in node and n != "meta"]
    if missing:
        raise ValueError(f"{node['t']!r} node lacks {missing!r}")


def _items(node: dict[str, Any]) -> list[Any]:
    items = node["items"]
    if not isinstance(items, list):
        raise ValueError(f"{node['t']!r} node: items must be a list")
    return items


def _check_leaf_node(node: dict[str, Any]) -> None:
    """Nodes with no children: their payload must decode."""
    tag = node["t"]
    if tag == "float":
        _fields(node, "v")
        float_text(node["v"])
    elif tag == "complex":
        _fields(node, "v")
        parts = node["v"]
        if not isinstance(parts, list) or len(parts) != 2:
            raise ValueError("complex node: v must be [real, imag]")
        for part in parts:
            float_text(part)
    elif tag == "bytes":
        _fields(node, "v")
        if not isinstance(node["v"], str):
            raise ValueError("bytes node: v must be base64 text")
        try:
            base64.b64decode(node["v"], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"bytes node: invalid base64 ({exc})") from None
    elif tag == "dtype":
        _fields(node, "v")
        dtype_itemsize(node["v"])
    elif tag == "device":
        _fields(node, "v")
        if not isinstance(node["v"], str) or not plain_device(node["v"]):
            raise ValueError(f"device node: {node['v']!r:.40} is not a device name")
    elif tag == "size":
        _fields(node, "items")
        if not plain_size(_items(node)):
            raise ValueError("size node: items must be non-negative ints")
    else:
        raise ValueError(f"unknown tree node type {tag!r:.40}")


def key_identity(key: Any) -> Any:
    """A hashable stand-in for a (checked, hashable) dict key node, equal for two nodes
    exactly when the keys they decode to are equal dict keys (``1``, ``1.0`` and ``True``
    are one key in Python, as ``(1, 2)`` and ``torch.Size([1, 2])``); a tensor or a pickled
    object as a key is equal only to itself (its entry)."""
    if type(key) is not dict:
        return key
    tag = key["t"]
    if tag == "tuple" or tag == "size":
        return tuple(key_identity(item) for item in key["items"])
    if tag == "float":
        value = float_text(key["v"])
        return value if value == value else object()  # a NaN key equals no other key (a dict may hold several)
    if tag == "complex":
        number = complex(float_text(key["v"][0]), float_text(key["v"][1]))
        return number if number == number else object()
    if tag == "bytes":
        return base64.b64decode(key["v"])
    return (_MARK, tag, key.get("v", key.get("id")))  # dtype, device; tensor and pickle by their entry


_MARK = object()
"""Tags the identities of keys no plain value equals (a dtype, a device, an entry)."""


class _TreeError(ValueError):
    """A problem already located in the tree."""


class _Checker:
    def __init__(self, kinds: Sequence[str], local: bool) -> None:
        self.kinds = kinds
        self.local = local
        self.slots: set[int] = set()

    def check(self, node: Any, path: str, depth: int) -> bool:
        """Validate ``node``, inside ``depth`` JSON arrays and objects; returns whether the
        value it decodes to is hashable."""
        try:
            return self._check(node, path, depth)
        except _TreeError:
            raise
        except ValueError as exc:
            raise _TreeError(f"tree at {path or '/'!r}: {exc}") from None

    def _check(self, node: Any, path: str, depth: int) -> bool:
        if node is None or type(node) is bool:
            return True
        if type(node) is int:
            if not inline_int(node):
                raise ValueError(f"an int of more than {MAX_INT_DIGITS} digits")
            return True
        if type(node) is str:
            if not inline_str(node):
                raise ValueError("a str that is not valid UTF-8")
            return True
        if type(node) is float:
            if not math.isfinite(node):
                raise ValueError("non-finite float leaf")
            return True
        if not isinstance(node, dict) or type(node.get("t")) is not str:
            raise ValueError(f"malformed tree node {_shown(node)}")
        tag = node["t"]
        _nest(depth + 1)  # the node itself
        if tag in _ENTRY_KINDS:
            _fields(node, "id")
            index = node["id"]
            if type(index) is not int or not 0 <= index < len(self.kinds):
                raise ValueError(f"{tag} node names no entry ({index!r:.20})")
            if self.kinds[index] != _ENTRY_KINDS[tag]:
                raise ValueError(f"{tag} node names entry {index}, which is a {self.kinds[index]}")
            return True
        if tag == "rank_local":
            _fields(node, "slot")
            slot = node["slot"]
            if self.local or type(slot) is not int or not 0 <= slot < _MAX_SLOTS or slot in self.slots:
                raise ValueError(f"invalid rank-local node (slot {slot!r:.20})")
            self.slots.add(slot)
            return False
        if tag not in _CONTAINERS:
            if tag in ("complex", "size"):
                _nest(depth + 2)  # [real, imag], the items
            _check_leaf_node(node)
            return tag in HASHABLE_TAGS
        if tag == "stateful":
            _fields(node, "v")
            self.check(node["v"], path, depth + 1)
            return False
        _nest(depth + 2)  # the items
        if tag in ("list", "tuple"):
            _fields(node, "items")
            hashable = [self.check(v, f"{path}/{i}", depth + 2) for i, v in enumerate(_items(node))]
            return tag == "tuple" and all(hashable)
        _fields(node, *(("items", "meta") if tag == "odict" else ("items",)))  # metadata: OrderedDicts only
        keys: set[Any] = set()
        for pair in _items(node):
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError("dict node: each item must be [key, value]")
            _nest(depth + 3)
            if not self.check(pair[0], path, depth + 3):
                raise ValueError("dict node: a key that cannot be a dict key")
            identity = key_identity(pair[0])
            if identity in keys:
                raise ValueError(f"dict node: the key {_key_text(pair[0])!r} twice")
            keys.add(identity)
            self.check(pair[1], f"{path}/{_key_text(pair[0])}", depth + 3)
        if "meta" in node:
            self.check(node["meta"], path + "#_metadata", depth + 1)
        return False


def _nest(level: int) -> None:
    """Refuse a JSON array or object at ``level`` (the tree's own node at 1) past the bound."""
    if level > MAX_TREE_DEPTH:
        raise ValueError(f"nested deeper than {MAX_TREE_DEPTH} levels of JSON")


def _key_text(node: Any) -> str:
    return key_text(node) if not isinstance(node, dict) else _shown(node)


def _shown(node: Any) -> str:
    """A bounded text of an untrusted node for messages (never fails: an int's text is
    bounded by the process's digit limit)."""
    if type(node) is int:
        return key_text(node)[:40]
    try:
        return repr(node)[:60]
    except ValueError:  # an int inside, longer than this process prints
        return f"a {type(node).__name__}"


def check_tree(tree: Any, entry_kinds: Sequence[str], *, local: bool = False) -> int:
    """Raise ValueError (naming the place) unless ``tree`` is a well-formed tree whose
    tensor, pickle and dtensor nodes name entries of their kind (``tensor``, ``pickle``,
    ``sharded``). Returns how many ``rank_local`` nodes it has (numbered 0..N-1, each once;
    none in a ``local`` tree: a rank's own values). Iterative in effect: bounded by
    :data:`MAX_TREE_DEPTH`, so no input can exhaust the stack."""
    checker = _Checker(entry_kinds, local)
    try:
        checker.check(tree, "", 0)
    except RecursionError:  # pragma: no cover - the depth bound is far below the stack limit
        raise ValueError("tree nested too deeply") from None
    if checker.slots != set(range(len(checker.slots))):
        raise ValueError(f"rank-local slots {sorted(checker.slots)[:8]} are not numbered from 0")
    return len(checker.slots)


def shift_entry_ids(node: Any, by: int) -> Any:
    """``node`` with the ids of its tensor and pickle nodes moved by ``by``: a rank-local
    value's tree between its own entry table and the one it is joined to."""
    if isinstance(node, dict):
        if node.get("t") in ("tensor", "pickle"):
            return {**node, "id": node["id"] + by}
        return {k: shift_entry_ids(v, by) for k, v in node.items()}
    if isinstance(node, list):
        return [shift_entry_ids(v, by) for v in node]
    return node
