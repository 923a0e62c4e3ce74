"""Partial loads: which entries a load needs, so that only their bytes are read.

Pure code on a checked tree (no I/O, no tensors); runs on the loop thread between reading
the manifest and fetching data.

- :func:`needed_for_state`: ``load(state)`` restores only the keys ``state`` has (see
  :func:`aiosnap.load.apply.apply_state`), walking nested plain dicts as it does; everything
  under a key that is restored whole (a tensor, a Stateful object, any other value) is needed.
- :func:`select_paths`: ``load(paths=[...])`` keeps the parts of the tree whose key path
  (``"model/layer1/weight"``: dict keys joined by ``/``, a Stateful object's state dict
  included) matches one of the glob patterns (``fnmatch``: escape ``*?[`` in keys as
  ``[*]``), with the dicts above them. Keys that are tensors or pickled objects are neither
  matched nor walked into (naming them would need their data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase
from typing import Any

from ..core.stateful import is_stateful, restores_by_key
from ..errors import StateMismatchError
from ..format.union import referenced_entries
from ..format.values import key_path

__all__ = [
    "UNAVAILABLE", "check_keys_present", "check_patterns", "dict_node", "entries_under", "needed_for_state",
    "read_keys_only", "refuse_unavailable", "saved_children", "select_paths",
]  # fmt: skip

UNAVAILABLE = "unavailable"
"""The tag of a node this load cannot restore (another rank's value: :mod:`aiosnap.load.ranks`),
with the reason as ``why``."""


def refuse_unavailable(node: Any) -> None:
    """:class:`StateMismatchError` (its reason) if ``node`` holds a value this load cannot
    restore; before anything is read."""
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            if current.get("t") == UNAVAILABLE:
                raise StateMismatchError(str(current["why"]))
            if current.get("t") not in ("tensor", "pickle", "dtensor"):
                stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)


def entries_under(node: Any) -> set[int]:
    """The entry ids (tensors, DTensors and pickles) anywhere below ``node``."""
    return referenced_entries(node)


def _dict_items(node: Any) -> list[Any] | None:
    if isinstance(node, dict) and node.get("t") in ("dict", "odict"):
        return list(node["items"])
    return None


def dict_node(node: Any) -> Any | None:
    """The dict node a load into a dict walks: a dict's, or the state dict a Stateful object
    saved (a step saved from a module restores into a plain dict of its tensors); None for
    anything else."""
    if isinstance(node, dict) and node.get("t") == "stateful":
        node = node["v"]
    return node if _dict_items(node) is not None else None


def saved_children(items: Iterable[Any], target: dict[Any, Any], decode_key: Callable[[Any], Any]) -> dict[Any, Any]:
    """The children of a dict node's ``items`` by decoded key, enough to find every key of
    ``target``: the keys that are plain values, and the keys that are tensors or pickled
    objects (which need their data, or ``allow_pickle``) only when a key of ``target`` is not
    among those. (Keys of one dict are distinct, so no other key can match a found one.)"""
    items = list(items)
    plain = {decode_key(k): v for k, v in items if not entries_under(k)}
    if all(key in plain for key in target):
        return plain
    return {decode_key(k): v for k, v in items}


def _listed(keys: list[Any], limit: int = 8) -> str:
    shown = ", ".join(repr(k)[:80] for k in keys[:limit])
    return f"[{shown}{f', ... ({len(keys)} in all)' if len(keys) > limit else ''}]"


_NESTED_OPTIMIZER = (
    "the checkpoint holds an optimizer's own nested state dict ('state', 'param_groups': how aiosnap.ShardedState "
    "saved it before pipeline layouts were supported, and with flatten_optimizer=False): load it with "
    "ShardedState(model, optimizer, flatten_optimizer=False)"
)
_FLAT_OPTIMIZER = (
    "the checkpoint holds an optimizer's state flattened by parameter name (aiosnap.ShardedState's default): "
    "load it with ShardedState(model, optimizer) (flatten_optimizer=True)"
)


def _optimizer_hint(missing: list[Any], saved: dict[Any, Any]) -> str:
    """Why an optimizer's keys are missing, when it is the other layout of ShardedState's."""

    def flat(key: Any) -> bool:
        return isinstance(key, str) and key.startswith(("state.", "param_groups."))

    if {"state", "param_groups"} <= set(saved) and any(flat(k) for k in missing):
        return f"; {_NESTED_OPTIMIZER}"
    if {"state", "param_groups"} & set(missing) and any(flat(k) for k in saved):
        return f"; {_FLAT_OPTIMIZER}"
    return ""


def check_keys_present(target: dict[Any, Any], saved: dict[Any, Any], step: int, path: str) -> None:
    """:class:`StateMismatchError` unless every key of ``target`` is among ``saved``'s, and
    unless ``target`` names a key at all where the checkpoint has some (an empty dict would
    restore nothing, silently)."""
    if not target and saved:
        shown = sorted(map(str, saved))
        raise StateMismatchError(
            f"{path or 'state'}: the dict to load into is empty, so nothing would be restored, but checkpoint "
            f"step {step} holds key(s) {shown!r:.300} here: put the objects to restore under those keys, "
            "or load() without a state for new objects"
        )
    missing = [k for k in target if k not in saved]
    if missing:
        raise StateMismatchError(
            f"{path or 'state'}: key(s) {_listed(missing)} are not in checkpoint step {step} "
            f"(it has {_listed(sorted(map(str, saved)))}){_optimizer_hint(missing, saved)}"
        )


def needed_for_state(
    tree: Any, state: dict[Any, Any], decode_key: Callable[[Any], Any], step: int, targets: Any = None
) -> set[int] | None:
    """Entries ``load(state)`` reads; None when it cannot tell (keys that are not plain
    values): then everything is read. A key of ``state`` missing from the checkpoint is a
    :class:`StateMismatchError` here, before anything is read. With ``targets`` (the state
    as :func:`~aiosnap.load.inplace.target_tree` gives it), a Stateful object restored by
    key (:func:`~aiosnap.core.stateful.restores_by_key`) needs only the entries of the keys
    its state dict has."""
    needed: set[int] = set()
    pending: list[tuple[Any, dict[Any, Any], str, Any]] = [(tree, state, "", targets)]
    while pending:
        node, target, path, below = pending.pop()
        items = _dict_items(node)
        if items is None:
            return None  # apply_state reports the mismatch
        try:
            saved = saved_children(items, target, decode_key)
        except Exception:  # a key the selection cannot decode without the data
            return None
        check_keys_present(target, saved, step, path)
        for key, current in target.items():
            child = saved[key]
            refuse_unavailable(child)
            where = key_path(path, key)
            below_key = below.get(key) if isinstance(below, dict) else None
            inner = dict_node(child) if isinstance(current, dict) and not is_stateful(current) else None
            if inner is not None:
                pending.append((inner, current, where, below_key))
            elif restores_by_key(current) and isinstance(below_key, dict) and _stateful_dict(child) is not None:
                pending.append((_stateful_dict(child), below_key, where, below_key))
            else:
                needed |= entries_under(child)
    return needed


def _stateful_dict(node: Any) -> Any:
    """The state dict node of a Stateful node, when it is a dict."""
    if isinstance(node, dict) and node.get("t") == "stateful" and _dict_items(node["v"]) is not None:
        return node["v"]
    return None


def read_keys_only(node: Any, read: Callable[[int], bool]) -> Any:
    """``node`` (a Stateful's state dict) without the keys holding entries this load did not
    ``read``: what a Stateful restored by key gets (its own keys, and plain values)."""
    if isinstance(node, dict) and node.get("t") == "stateful":
        return {**node, "v": read_keys_only(node["v"], read)}
    items = _dict_items(node)
    if items is None:
        return node
    kept = []
    for key, child in items:
        if _dict_items(child) is not None:
            kept.append([key, read_keys_only(child, read)])
        elif all(read(index) for index in entries_under(child)):
            kept.append([key, child])
    return {**node, "items": kept}


def check_patterns(patterns: Iterable[str]) -> list[str]:
    """``patterns`` as a list, or ValueError unless it is a non-empty list of non-empty strings."""
    wanted = list(patterns)
    if not wanted or not all(isinstance(p, str) and p for p in wanted):
        raise ValueError(f"paths must be non-empty glob patterns, got {wanted!r:.200}")
    return wanted


def select_paths(tree: Any, patterns: Iterable[str], decode_key: Callable[[Any], Any]) -> Any:
    """The part of ``tree`` that ``patterns`` select (a dict node; nested dicts kept where
    something below them matches). :class:`StateMismatchError` when nothing matches."""
    wanted = check_patterns(patterns)

    def keep(node: Any, prefix: str) -> Any | None:
        if isinstance(node, dict) and node.get("t") == "stateful":  # its state dict
            inner = keep(node["v"], prefix)
            return None if inner is None else {**node, "v": inner}
        items = _dict_items(node)
        if items is None:
            return None
        kept = []
        for raw_key, child in items:
            if entries_under(raw_key):  # a tensor or pickled key: needs data to be named
                continue
            key = decode_key(raw_key)
            path = key_path(prefix, key)
            if any(fnmatchcase(path, p) for p in wanted):
                kept.append([raw_key, child])
                continue
            below = keep(child, path)
            if below is not None:
                kept.append([raw_key, below])
        if not kept:
            return None
        return {**node, "items": kept}

    selected = keep(tree, "")
    if selected is None:
        top = [str(decode_key(k)) for k, _ in (_dict_items(tree) or [])]
        raise StateMismatchError(f"no key path matches {wanted!r} (the checkpoint's top-level keys: {top!r:.300})")
    return selected
