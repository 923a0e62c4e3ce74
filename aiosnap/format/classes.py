"""What a rank's table and tree say about it: each entry's place in the tree, the rank's
class and its bucket digests. Pure code, no torch, no I/O.

The same functions run on both sides of a multi-rank save, so that the coordinator can
recompute from a part what the rank announced in the agreement:

- a rank, on the caller's thread, from its flattened state
  (:func:`aiosnap.distributed.ownership.holdings`);
- the coordinator's merge, from the table and tree each class's lowest rank ships in its
  part (:mod:`aiosnap.format.merge`): a part whose table and tree do not make the class
  digest its rank announced is refused.

An entry's *key* is its place in the tree, written unambiguously: the path of dict keys
and list indices joined by ``/``, with ``%``, ``/``, ``#`` and control characters of string
keys escaped (``%2F``) and every key that is not a string tagged (``%0`` is the int ``0``,
``0`` the string), so ``{"a/b": x}`` and ``{"a": {"b": y}}``, or ``{0: x}`` and
``{"0": y}``, never share a key. For the usual string keys the key is the entry's path. The
ranks' entries merge by key. A DTensor's boxes after its first (several per rank under
rare ``_StridedShard`` layouts) are named by no tree node: each takes the key of the box
before it, whose DTensor it continues.

A rank's *class* digest covers its table (each entry's key and path, kind, dtype and shape, a
DTensor's global shape and mesh) and the shape of its tree (containers and keys, not the
values of plain leaves). Its *bucket* digests cover the plain entries of each bucket
(:mod:`aiosnap.format.buckets`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .buckets import BUCKETS, bucket_of

__all__ = ["Described", "Row", "describe", "escaped_key", "word"]

Row = tuple[str, str, str, Sequence[int], int | None]
"""An entry as a class digest sees it: path, kind (``tensor``, ``pickle``, ``sharded``),
dtype name, shape (a DTensor's global shape), mesh (DTensor boxes only)."""

_SPECIAL = re.compile(r"[%/#\x00-\x1f]")
_SIGNED = 2**63


def word(data: bytes) -> int:
    """A digest as a signed 64-bit word, never 0 (0: nothing there)."""
    value = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") - _SIGNED
    return value or 1


@lru_cache(maxsize=1 << 16)
def _escaped_text(key: str) -> str:
    return _SPECIAL.sub(lambda m: f"%{ord(m.group()):02X}", key)


def escaped_key(key: Any) -> str:
    """A dict key as one component of an entry's key (see the module's docstring)."""
    if type(key) is str:
        return key if _SPECIAL.search(key) is None else _escaped_text(key)
    return "%" + _escaped_text(json.dumps(key, sort_keys=True, separators=(",", ":")))


@dataclass(frozen=True)
class Described:
    """A table and tree as the agreement and the merge see them."""

    keys: list[str]  # each entry's key
    class_digest: str  # 32 hex digits
    buckets: tuple[int, ...]  # per bucket: a digest of the plain entries there, 0 for none


class _Walk:
    """One pass over a tree: each entry's first key, and the tree's skeleton."""

    def __init__(self, count: int) -> None:
        self.keys: list[str | None] = [None] * count
        self.out: list[str] = []

    def _entry(self, node: dict[str, Any], key: str) -> None:
        index = node["id"]
        if self.keys[index] is None:
            self.keys[index] = key
        self.out.append(f"{node['t'][0]}{index}")

    def walk(self, node: Any, key: str) -> None:
        out = self.out
        if type(node) is not dict:
            out.append(".")
            return
        tag = node.get("t")
        if tag in ("dict", "odict"):
            out.append(tag)
            prefix = f"{key}/" if key else ""
            keys, search, append = self.keys, _SPECIAL.search, out.append
            for position, (name, value) in enumerate(node["items"]):
                if type(name) is str:
                    part = name if search(name) is None else _escaped_text(name)
                else:
                    part = escaped_key(name)
                    if type(name) is dict:  # a key that is a node (a tuple, a tensor: rare)
                        self.walk(name, f"{prefix}%K{position}")
                append("=" + part)
                if type(value) is dict and value.get("t") == "tensor":  # the common leaf, inline
                    index = value["id"]
                    if keys[index] is None:
                        keys[index] = prefix + part
                    append(f"t{index}")
                else:
                    self.walk(value, prefix + part)
            if "meta" in node:
                out.append("meta")
                self.walk(node["meta"], key + "#m")
            out.append("}")
        elif tag in ("list", "tuple"):
            out.append(tag)
            prefix = f"{key}/" if key else ""
            for position, value in enumerate(node["items"]):
                self.walk(value, f"{prefix}{position}")
            out.append("]")
        elif tag == "stateful":
            out.append("stateful")
            self.walk(node["v"], key)
        elif tag in ("tensor", "dtensor", "pickle"):
            self._entry(node, key)
        elif tag == "rank_local":
            out.append(f"r{node['slot']}")
        else:
            out.append(".")


def _line(row: Row, key: str) -> str:
    path, kind, dtype, shape, mesh = row
    if path != key:  # an escaped or tagged key: its path too
        key = f"{key}\t{json.dumps(path)}"
    if kind == "pickle":
        return f"{key}\tpickle"  # a pickle's bytes may differ between the ranks holding it
    if kind == "sharded":
        return f"{key}\tDTensor {dtype} {tuple(shape)} {mesh}"
    return f"{key}\t{dtype} {tuple(shape)}"


def _continues(rows: Sequence[Row], index: int) -> bool:
    """Row ``index`` is a further box of the DTensor of the row before it."""
    if index == 0:
        return False
    (path, kind, dtype, shape, mesh), before = rows[index], rows[index - 1]
    return kind == "sharded" and before[1] == "sharded" and (path, dtype, tuple(shape), mesh) == (
        before[0], before[2], tuple(before[3]), before[4],
    )  # fmt: skip


def describe(rows: Sequence[Row], tree: Any) -> Described:
    """The keys, class digest and bucket digests of a table ``rows`` and its (checked)
    ``tree``. ValueError when an entry is named by no node of the tree and continues no
    DTensor: every entry of a table must be in its tree."""
    walk = _Walk(len(rows))
    walk.walk(tree, "")
    keys = walk.keys
    lines: list[str] = []
    by_bucket: list[list[str]] = [[] for _ in range(BUCKETS)]
    for index, row in enumerate(rows):
        path, kind, dtype, shape, _ = row
        key = keys[index]
        if key is None:
            if not _continues(rows, index):
                raise ValueError(f"entry {index} ({path!r}) of the table: no node of the tree names it")
            key = keys[index] = keys[index - 1]
        assert key is not None
        line = f"{key}\t{dtype} {tuple(shape)}" if kind == "tensor" and path == key else _line(row, key)
        lines.append(line)
        if kind != "sharded":
            by_bucket[bucket_of(path)].append(line)
    whole = hashlib.blake2b(digest_size=16)
    whole.update("\n".join(lines).encode())
    whole.update(b"\0")
    whole.update("\0".join(walk.out).encode())
    buckets = tuple(word("\n".join(found).encode()) if found else 0 for found in by_bucket)
    return Described([k or "" for k in keys], whole.hexdigest(), buckets)
