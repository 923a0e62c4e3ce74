"""The state's tree as a manifest stores it: checked as untrusted input, decoded to values.

The tree is JSON: plain leaves (``None``, ``bool``, ``int``, ``float``, ``str``) inline, and
nodes ``{"t": TAG, ...}`` for everything else. ``{"t": "tensor", "id": N}`` and
``{"t": "pickle", "id": N}`` point into the manifest's entry table.

A manifest is read back from storage that other people may write, so :func:`check_tree`
validates every node (tags, field types, entry references whose kind must match the tag,
nesting depth, hashable dict keys) before anything acts on it, and :class:`TreeDecoder`
enforces the pickle opt-in itself: a tree that names a pickle is refused unless the caller
allowed pickles, whatever the entry table says. Pure code; runs on whichever thread calls.
"""

from __future__ import annotations

import base64
import binascii
import math
import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ManifestError, PickleNotAllowedError

__all__ = ["MAX_TREE_DEPTH", "TreeDecoder", "check_tree", "dtype_from_name"]

MAX_TREE_DEPTH = 100
"""Deepest nesting of containers a tree may have (saving a deeper state is refused)."""

_CONTAINERS = {"dict", "odict", "list", "tuple", "stateful"}
_HASHABLE_TAGS = {"float", "complex", "bytes", "dtype", "device", "size", "tensor", "pickle"}
_MAX_DIM = 2**62


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ValueError for anything that is not a dtype."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


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


def _float_text(value: Any) -> float:
    if not isinstance(value, str) or len(value) > 64:
        raise ValueError(f"expected a float as text, got {value!r:.40}")
    return float(value)


def _check_leaf_node(node: dict[str, Any]) -> None:
    """Nodes with no children: their payload must decode."""
    tag = node["t"]
    if tag == "float":
        _fields(node, "v")
        _float_text(node["v"])
    elif tag == "complex":
        _fields(node, "v")
        parts = node["v"]
        if not isinstance(parts, list) or len(parts) != 2:
            raise ValueError("complex node: v must be [real, imag]")
        for part in parts:
            _float_text(part)
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
        dtype_from_name(node["v"])
    elif tag == "device":
        _fields(node, "v")
        if not isinstance(node["v"], str) or len(node["v"]) > 64:
            raise ValueError("device node: v must be a device name")
        try:
            torch.device(node["v"])
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"device node: {exc}") from None
    elif tag == "size":
        _fields(node, "items")
        if not all(type(d) is int and 0 <= d < _MAX_DIM for d in _items(node)):
            raise ValueError("size node: items must be non-negative ints")
    else:
        raise ValueError(f"unknown tree node type {tag!r:.40}")


class _TreeError(ValueError):
    """A problem already located in the tree."""


class _Checker:
    def __init__(self, kinds: Sequence[str]) -> None:
        self.kinds = kinds

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
        if tag in ("tensor", "pickle"):
            _fields(node, "id")
            index = node["id"]
            if type(index) is not int or not 0 <= index < len(self.kinds):
                raise ValueError(f"{tag} node names no entry ({index!r:.20})")
            if self.kinds[index] != tag:
                raise ValueError(f"{tag} node names entry {index}, which is a {self.kinds[index]}")
            return True
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
        for pair in _items(node):
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError("dict node: each item must be [key, value]")
            if not self.check(pair[0], path, depth + 1):
                raise ValueError("dict node: a key that cannot be a dict key")
            self.check(pair[1], f"{path}/{_key_text(pair[0])}", depth + 1)
        if "meta" in node:
            self.check(node["meta"], path + "#_metadata", depth + 1)
        return False


def _key_text(node: Any) -> str:
    return node if isinstance(node, str) else repr(node)[:40]


def check_tree(tree: Any, entry_kinds: Sequence[str]) -> None:
    """Raise ValueError (naming the place) unless ``tree`` is a well-formed tree whose
    tensor and pickle nodes name entries of that kind. Iterative in effect: bounded by
    :data:`MAX_TREE_DEPTH`, so no input can exhaust the stack."""
    checker = _Checker(entry_kinds)
    try:
        checker.check(tree, "", 0)
    except RecursionError:  # pragma: no cover - the depth bound is far below the stack limit
        raise ValueError("tree nested too deeply") from None


class TreeDecoder:
    """Turns a checked tree back into Python values. ``tensor_of(index)`` gives an entry's
    tensor; pickle nodes are unpickled only when ``allow_pickle`` is true (else
    :class:`PickleNotAllowedError`), and only for entries of kind ``pickle``."""

    def __init__(
        self,
        tensor_of: Callable[[int], torch.Tensor],
        entry_kinds: Sequence[str],
        entry_paths: Sequence[str],
        *,
        allow_pickle: bool,
        where: str,
    ) -> None:
        self.tensor_of = tensor_of
        self.kinds = entry_kinds
        self.paths = entry_paths
        self.allow_pickle = allow_pickle
        self.where = where

    def __call__(self, node: Any) -> Any:
        try:
            return self._decode(node)
        except (PickleNotAllowedError, ManifestError):
            raise
        except (KeyError, IndexError, TypeError, ValueError, OverflowError, AttributeError, RecursionError) as exc:
            raise ManifestError(f"{self.where}: malformed tree: {type(exc).__name__}: {exc}") from exc

    def _entry(self, node: dict[str, Any], kind: str) -> int:
        index = node["id"]
        if type(index) is not int or not 0 <= index < len(self.kinds) or self.kinds[index] != kind:
            raise ManifestError(f"{self.where}: a {kind} node names entry {index!r:.20}, which is not a {kind}")
        return index

    def _decode(self, node: Any) -> Any:
        if node is None or type(node) in (bool, int, float, str):
            return node
        if not isinstance(node, dict) or "t" not in node:
            raise ManifestError(f"{self.where}: malformed tree node {node!r:.80}")
        tag = node["t"]
        if tag == "tensor":
            return self.tensor_of(self._entry(node, "tensor"))
        if tag == "pickle":
            index = self._entry(node, "pickle")
            if not self.allow_pickle:
                raise PickleNotAllowedError(
                    f"{self.where} holds a pickled object ({self.paths[index]!r}); loading it can execute "
                    "arbitrary code: pass allow_pickle=True only if you trust this checkpoint"
                )
            from ..trainer.tensorio import bytes_view

            blob = bytes(bytes_view(self.tensor_of(index)))
            return pickle.loads(blob)  # noqa: S301 - the caller opted in
        if tag in ("dict", "odict"):
            items = [(self._decode(k), self._decode(v)) for k, v in node["items"]]
            if tag == "dict":
                return dict(items)
            ordered: OrderedDict[Any, Any] = OrderedDict(items)
            if "meta" in node:  # a module's state dict carries its version metadata
                ordered._metadata = self._decode(node["meta"])  # type: ignore[attr-defined]
            return ordered
        if tag == "list":
            return [self._decode(v) for v in node["items"]]
        if tag == "tuple":
            return tuple(self._decode(v) for v in node["items"])
        if tag == "stateful":
            return self._decode(node["v"])
        if tag == "float":
            return _float_text(node["v"])
        if tag == "size":
            return torch.Size(node["items"])
        if tag == "dtype":
            return dtype_from_name(node["v"])
        if tag == "device":
            return torch.device(node["v"])
        if tag == "bytes":
            return base64.b64decode(node["v"], validate=True)
        if tag == "complex":
            return complex(_float_text(node["v"][0]), _float_text(node["v"][1]))
        raise ManifestError(f"{self.where}: unknown tree node type {tag!r:.40}")
