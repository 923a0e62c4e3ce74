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
import re
from collections.abc import Sequence
from typing import Any

from .dtypes import dtype_itemsize

__all__ = ["DEVICE_TYPES", "MAX_TREE_DEPTH", "check_tree", "float_text", "key_identity", "shift_entry_ids"]

MAX_TREE_DEPTH = 100
"""Deepest nesting of containers a tree may have (saving a deeper state is refused)."""

_CONTAINERS = {"dict", "odict", "list", "tuple", "stateful"}
_HASHABLE_TAGS = {"float", "complex", "bytes", "dtype", "device", "size", "tensor", "pickle"}
_MAX_DIM = 2**62
_MAX_SLOTS = 2**20
_ENTRY_KINDS = {"tensor": "tensor", "pickle": "pickle", "dtensor": "sharded"}
"""Tree tags that name an entry, and the kind of entry each must name."""


DEVICE_TYPES = (
    "cpu", "cuda", "mps", "xpu", "xla", "meta", "hpu", "mtia", "hip", "ipu", "maia", "privateuseone", "lazy", "ve",
    "vulkan", "fpga", "opengl", "opencl", "ideep",
)  # fmt: skip
_DEVICE = re.compile(rf"({'|'.join(DEVICE_TYPES)})(:[0-9]{{1,4}})?")


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


def float_text(value: Any) -> float:
    if not isinstance(value, str) or len(value) > 64:
        raise ValueError(f"expected a float as text, got {value!r:.40}")
    return float(value)


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
        if not isinstance(node["v"], str) or not _DEVICE.fullmatch(node["v"]):
            raise ValueError(f"device node: {node['v']!r:.40} is not a device name")
    elif tag == "size":
        _fields(node, "items")
        if not all(type(d) is int and 0 <= d < _MAX_DIM for d in _items(node)):
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
        value = float(key["v"])
        return value if value == value else (_MARK, "nan", key["v"])  # NaN keys: equal only to the same text
    if tag == "complex":
        return complex(float(key["v"][0]), float(key["v"][1]))
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
        """Validate ``node``; returns whether the value it decodes to is hashable."""
        try:
            return self._check(node, path, depth)
        except _TreeError:
            raise
        except ValueError as exc:
            raise _TreeError(f"tree at {path or '/'!r}: {exc}") from None

    def _check(self, node: Any, path: str, depth: int) -> bool:
        if node is None or type(node) in (bool, int, str):
            return True
        if type(node) is float:
            if not math.isfinite(node):
                raise ValueError("non-finite float leaf")
            return True
        if not isinstance(node, dict) or type(node.get("t")) is not str:
            raise ValueError(f"malformed tree node {node!r:.60}")
        tag = node["t"]
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
            _check_leaf_node(node)
            return tag in _HASHABLE_TAGS
        if depth >= MAX_TREE_DEPTH:
            raise ValueError(f"nested deeper than {MAX_TREE_DEPTH} levels")
        if tag == "stateful":
            _fields(node, "v")
            self.check(node["v"], path, depth + 1)
            return False
        if tag in ("list", "tuple"):
            _fields(node, "items")
            hashable = [self.check(v, f"{path}/{i}", depth + 1) for i, v in enumerate(_items(node))]
            return tag == "tuple" and all(hashable)
        _fields(node, *(("items", "meta") if tag == "odict" else ("items",)))  # metadata: OrderedDicts only
        keys: set[Any] = set()
        for pair in _items(node):
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError("dict node: each item must be [key, value]")
            if not self.check(pair[0], path, depth + 1):
                raise ValueError("dict node: a key that cannot be a dict key")
            identity = key_identity(pair[0])
            if identity in keys:
                raise ValueError(f"dict node: the key {_key_text(pair[0])!r} twice")
            keys.add(identity)
            self.check(pair[1], f"{path}/{_key_text(pair[0])}", depth + 1)
        if "meta" in node:
            self.check(node["meta"], path + "#_metadata", depth + 1)
        return False


def _key_text(node: Any) -> str:
    return node if isinstance(node, str) else repr(node)[:40]


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
