"""Plain values read from a foreign checkpoint, as nodes of an aiosnap tree
(:mod:`aiosnap.format.tree`): what a translated manifest holds besides its tensors.

Pure code, no torch. The values come from :func:`aiosnap.interop.torchpickle.parse_pickle` (or
another format's parser): None, bool, int, float, str, bytes, complex, lists, tuples, dicts
and OrderedDicts, and the stand-ins for dtypes, sizes and devices; each tensor leaf is handed
to ``tensor`` (which gives the node that stands for it).
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..errors import CorruptCheckpointError
from .torchpickle import DeviceValue, DtypeValue, SizeValue, TensorRef

__all__ = ["dict_node", "encode_value", "nest_paths"]


def dict_node(items: list[list[Any]], ordered: bool = False) -> dict[str, Any]:
    """A dict node of encoded ``[key, value]`` pairs."""
    return {"t": "odict" if ordered else "dict", "items": items}


def encode_value(value: Any, where: str, tensor: Callable[[TensorRef], Any] | None = None) -> Any:
    """``value`` as a tree node (keys of dicts encoded the same way)."""
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {"t": "float", "v": repr(value)}
    if isinstance(value, TensorRef):
        if tensor is None:
            raise CorruptCheckpointError(f"{where}: a tensor inside a value (not read here)")
        return tensor(value)
    if type(value) in (dict, OrderedDict):
        node = dict_node(
            [[encode_value(k, where, tensor), encode_value(v, where, tensor)] for k, v in value.items()],
            ordered=type(value) is OrderedDict,
        )
        meta = getattr(value, "_metadata", None)
        if meta is not None:
            node["meta"] = encode_value(meta, where)
        return node
    if type(value) is list:
        return {"t": "list", "items": [encode_value(v, where, tensor) for v in value]}
    if type(value) is tuple:
        return {"t": "tuple", "items": [encode_value(v, where, tensor) for v in value]}
    if type(value) is bytes:
        return {"t": "bytes", "v": base64.b64encode(value).decode("ascii")}
    if type(value) is complex:
        return {"t": "complex", "v": [repr(value.real), repr(value.imag)]}
    if isinstance(value, SizeValue):
        return {"t": "size", "items": list(value.items)}
    if isinstance(value, DtypeValue):
        return {"t": "dtype", "v": value.name}
    if isinstance(value, DeviceValue):
        return {"t": "device", "v": value.name}
    raise CorruptCheckpointError(f"{where}: a value of type {type(value).__name__} has no place in a tree")


def nest_paths(leaves: list[tuple[tuple[Any, ...], Any]], where: str) -> dict[str, Any]:
    """A tree of nested dicts holding each encoded leaf at its key path (``("model",
    "w")``: ``{"model": {"w": leaf}}``), keys in first-seen order; below the top, a level
    whose keys are the integers 0 to n-1 is a list (as DCP flattens lists:
    ``("param_groups", 0, "lr")``). A path that is a prefix of another (a value and a dict
    under one key) is a CorruptCheckpointError."""
    root: dict[Any, Any] = {}
    for path, leaf in leaves:
        if not path:
            raise CorruptCheckpointError(f"{where}: an empty key path")
        node = root
        for key in path[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise CorruptCheckpointError(f"{where}: key path {list(path)[:20]!r} runs through a value")
            node = child
        if path[-1] in node:
            raise CorruptCheckpointError(f"{where}: key path {list(path)[:20]!r} is there twice")
        node[path[-1]] = _Leaf(leaf)

    def build(node: dict[Any, Any]) -> dict[str, Any]:
        children = [(k, v.node if isinstance(v, _Leaf) else build(v)) for k, v in node.items()]
        if all(type(k) is int for k in node) and sorted(node) == list(range(len(node))) and node is not root:
            return {"t": "list", "items": [child for _, child in sorted(children, key=lambda kv: int(kv[0]))]}
        return dict_node([[encode_value(k, where), child] for k, child in children])

    return build(root)


class _Leaf:
    __slots__ = ("node",)

    def __init__(self, node: Any) -> None:
        self.node = node
