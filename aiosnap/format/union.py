"""The union of the ranks' trees: one checkpoint from ranks that hold different keys.

Pure code on checked trees (no torch, no I/O); the coordinator's merge runs it
(:mod:`aiosnap.format.merge`) on the trees of the lowest rank of each class, in rank order,
their entry ids already mapped into the merged entry table. The rule:

- dicts (and OrderedDicts, with their metadata) merge key by key, the keys of lower ranks
  first; a Stateful value's state dict merges as a dict; lists and tuples of the same
  length merge item by item;
- a key names one entry on every rank that holds it: tensors of one dtype and shape,
  DTensors of one global shape and dtype (two ranks naming two entries at one key, such as
  an embedding tied to the output head on the last pipeline stage, keep the lower rank's
  if both have one layout);
- anything else held at one key by several ranks (a plain value, a pickled object, lists
  of different lengths) is taken from the lowest rank that holds it, unless one of them holds
  a tensor there: then :class:`~aiosnap.errors.RanksDisagreeError` names the key and the ranks;
- but a torch optimizer's own state dict (``state`` by parameter index, ``param_groups``)
  is not a plain value: the trees being merged are those of ranks of different classes
  (pipeline stages, ranks holding other keys), whose parameters 0..n-1 are not the same
  parameters, so two of them holding one at a key is a
  :class:`~aiosnap.errors.RanksDisagreeError` saying to save it through
  ``aiosnap.ShardedState`` (by parameter name). Refused even when equal at this step: whether
  they are equal says nothing of the next one.

The entries a merge leaves out (the later rank's at a tie, the pickled objects of a plain
value taken from a lower rank) are recorded (:attr:`TreeUnion.ties`,
:attr:`TreeUnion.dropped`): the merge checks that a tie's values are equal and that no
entry is left out otherwise.

Each merge touches only the nodes of the tree being added (dict keys are found through an
index), so the union of N trees costs their total size, not N times the union's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import RanksDisagreeError
from .tree import key_identity

__all__ = ["TreeUnion", "map_entry_ids", "referenced_entries"]

_ENTRY_TAGS = ("tensor", "dtensor", "pickle")


def map_entry_ids(node: Any, mapping: Sequence[int]) -> Any:
    """A copy of ``node`` whose entry nodes name ``mapping[id]`` instead of ``id``."""
    if isinstance(node, dict):
        if node.get("t") in _ENTRY_TAGS:
            return {**node, "id": mapping[node["id"]]}
        return {k: map_entry_ids(v, mapping) for k, v in node.items()}
    if isinstance(node, list):
        return [map_entry_ids(v, mapping) for v in node]
    return node


def referenced_entries(node: Any) -> set[int]:
    """The entry ids named anywhere in ``node``."""
    found: set[int] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            if current.get("t") in _ENTRY_TAGS:
                found.add(current["id"])
            else:
                stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)
    return found


def _holds_tensors(node: Any) -> bool:
    """Whether ``node`` holds a tensor, a DTensor or a rank-local value (a pickled object is
    a plain value)."""
    if isinstance(node, dict):
        if node.get("t") in ("tensor", "dtensor", "rank_local"):
            return True
        return any(_holds_tensors(v) for v in node.values())
    if isinstance(node, list):
        return any(_holds_tensors(v) for v in node)
    return False


def _tag(node: Any) -> str | None:
    return node.get("t") if isinstance(node, dict) else None


COLLIDING_OPTIMIZERS = (
    "pipeline stages saving optimizer state by parameter index collide: use aiosnap.ShardedState, which saves it "
    "by parameter name"
)
"""What to do when ranks' optimizer states differ at one key (the usual cause)."""


def _items_of(node: Any, tag: str) -> list[Any] | None:
    return node["items"] if _tag(node) == tag or (tag == "dict" and _tag(node) == "odict") else None


def _optimizer_state(node: Any) -> bool:
    """Whether ``node`` is a torch optimizer's own state dict: ``state`` by parameter index
    (ints), ``param_groups`` a list of dicts with ``params``."""
    items = _items_of(node, "dict")
    if items is None or len(items) != 2:  # what Optimizer.state_dict() returns: those two keys
        return False
    found = {k: v for k, v in items if type(k) is str}
    state_items, group_items = _items_of(found.get("state"), "dict"), _items_of(found.get("param_groups"), "list")
    if state_items is None or not group_items or not all(type(k) is int for k, _ in state_items):
        return False
    return all(any(k == "params" for k, _ in (_items_of(g, "dict") or ())) for g in group_items)


def _shown(key: Any) -> str:
    return key if type(key) is str else json.dumps(key)[:40]


def _describe(node: Any) -> str:
    tag = _tag(node)
    if tag in _ENTRY_TAGS:
        return {"tensor": "a tensor", "dtensor": "a DTensor", "pickle": "a pickled value"}[tag]
    if tag == "rank_local":
        return "a rank-local value"
    if tag in ("dict", "odict", "list", "tuple"):
        return f"a {tag} of {len(node['items'])} item(s)" + (" with tensors" if _holds_tensors(node) else "")
    if tag == "stateful":
        return "a Stateful object's state"
    return "a plain value"


class TreeUnion:
    """Trees added in rank order; ``conflict(a, b)`` describes entries ``a`` and ``b`` when
    their layouts differ (None: one layout), for two ranks naming different entries at one key."""

    def __init__(self, conflict: Callable[[int, int], tuple[str, str] | None]) -> None:
        self.tree: Any = None
        self._conflict = conflict
        self._index: dict[int, dict[Any, int]] = {}  # id(items of a dict node) -> key -> position
        self._owner: dict[int, int] = {}  # id([key, value] pair added by a later tree) -> its rank
        self._first = -1
        self.ties: list[tuple[int, int, int, int, str]] = []
        """(entry kept, its rank, entry left out, its rank) at one key, with the key"""
        self.dropped: set[int] = set()
        """Entries left out: the later rank's at a tie, pickled objects under a plain value taken from a lower rank."""

    def add(self, rank: int, tree: Any) -> None:
        """Merge ``tree`` (rank ``rank``'s, entry ids already mapped; consumed) into the union."""
        if self._first < 0:
            self.tree, self._first = tree, rank
        else:
            self.tree = self._merge(self.tree, tree, "", self._first, rank)

    def _merge(self, a: Any, b: Any, path: str, rank_a: int, rank_b: int) -> Any:
        ta, tb = _tag(a), _tag(b)
        if ta in ("dict", "odict") and ta == tb:
            self._check_optimizers(a, b, path, rank_a, rank_b)
            self._merge_dicts(a, b, path, rank_a, rank_b)
            return a
        if ta == "stateful" and tb == "stateful":
            a["v"] = self._merge(a["v"], b["v"], path, rank_a, rank_b)
            return a
        if ta in ("list", "tuple") and ta == tb and len(a["items"]) == len(b["items"]):
            items = a["items"]
            for position, value in enumerate(b["items"]):
                items[position] = self._merge(items[position], value, f"{path}/{position}", rank_a, rank_b)
            return a
        if ta in _ENTRY_TAGS and tb in _ENTRY_TAGS:
            if a["id"] == b["id"]:
                return a
            problem = self._conflict(a["id"], b["id"])
            if problem is None:
                self.ties.append((a["id"], rank_a, b["id"], rank_b, path or "/"))
                self.dropped.add(b["id"])
                return a
            raise RanksDisagreeError(
                f"{path or '/'!r}: rank {rank_b} holds {problem[1]} where rank {rank_a} holds {problem[0]}"
            )
        if ta == "rank_local" and tb == "rank_local" and a["slot"] == b["slot"]:
            return a
        if _holds_tensors(a) or _holds_tensors(b):
            raise RanksDisagreeError(
                f"{path or '/'!r}: rank {rank_b} holds {_describe(b)} where rank {rank_a} holds {_describe(a)}"
            )
        self.dropped |= referenced_entries(b)
        return a  # plain values held by several ranks: the lowest rank's

    @staticmethod
    def _check_optimizers(a: Any, b: Any, path: str, rank_a: int, rank_b: int) -> None:
        if _optimizer_state(a) and _optimizer_state(b):
            raise RanksDisagreeError(
                f"different values at one path: {path or '/'!r}: ranks {rank_a} and {rank_b}, which hold different "
                f"keys, both hold a torch optimizer's own state dict there (its state by parameter index); "
                f"{COLLIDING_OPTIMIZERS}"
            )

    def _merge_dicts(self, a: dict[str, Any], b: dict[str, Any], path: str, rank_a: int, rank_b: int) -> None:
        items: list[list[Any]] = a["items"]
        index = self._index.get(id(items))
        if index is None:
            index = self._index[id(items)] = {key_identity(k): i for i, (k, _) in enumerate(items)}
        prefix = f"{path}/" if path else ""
        for pair in b["items"]:
            identity = key_identity(pair[0])
            position = index.get(identity)
            if position is None:
                index[identity] = len(items)
                items.append(pair)
                self._owner[id(pair)] = rank_b
                continue
            held = items[position]
            origin = self._owner.get(id(held), rank_a)
            held[1] = self._merge(held[1], pair[1], prefix + _shown(pair[0]), origin, rank_b)
        if "meta" in b:
            a["meta"] = (
                self._merge(a["meta"], b["meta"], path + "#_metadata", rank_a, rank_b) if "meta" in a else b["meta"]
            )
