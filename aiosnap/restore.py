"""Turning a manifest's tree back into Python values, and applying them to a live state.

Pure code (no I/O); runs on the caller's thread so ``load_state_dict()`` of modules,
optimizers and user objects runs where the caller expects it.
"""

from __future__ import annotations

import base64
import pickle
from collections import OrderedDict
from typing import Any

import torch

from .errors import ManifestError, PickleNotAllowedError
from .manifest import Manifest, dtype_from_name
from .plan import is_stateful
from .tensorio import bytes_view

__all__ = ["apply_state", "check_pickles", "decode_tree"]


def check_pickles(manifest: Manifest, allow_pickle: bool) -> None:
    """Refuse a checkpoint holding pickled objects unless the caller opted in."""
    pickled = [e.path for e in manifest.entries if e.kind == "pickle"]
    if pickled and not allow_pickle:
        shown = ", ".join(repr(p) for p in pickled[:5]) + (" ..." if len(pickled) > 5 else "")
        raise PickleNotAllowedError(
            f"step {manifest.step} holds {len(pickled)} pickled object(s) ({shown}); loading them "
            "can execute arbitrary code: pass allow_pickle=True only if you trust this checkpoint"
        )


class _Decoder:
    def __init__(self, tensors: dict[int, torch.Tensor], manifest: Manifest) -> None:
        self.tensors = tensors
        self.manifest = manifest

    def __call__(self, node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if not isinstance(node, dict) or "t" not in node:
            raise ManifestError(f"step {self.manifest.step}: malformed tree node {node!r:.80}")
        tag = node["t"]
        if tag == "tensor":
            return self.tensors[node["id"]]
        if tag in ("dict", "odict"):
            items = ((self(k), self(v)) for k, v in node["items"])
            result: dict[Any, Any] = dict(items) if tag == "dict" else OrderedDict(items)
            if "meta" in node:
                result._metadata = self(node["meta"])  # type: ignore[attr-defined]
            return result
        if tag == "list":
            return [self(v) for v in node["items"]]
        if tag == "tuple":
            return tuple(self(v) for v in node["items"])
        if tag == "stateful":
            return self(node["v"])
        if tag == "float":
            return float(node["v"])
        if tag == "size":
            return torch.Size(node["items"])
        if tag == "dtype":
            return dtype_from_name(node["v"])
        if tag == "device":
            return torch.device(node["v"])
        if tag == "bytes":
            return base64.b64decode(node["v"])
        if tag == "complex":
            return complex(float(node["v"][0]), float(node["v"][1]))
        if tag == "pickle":
            return pickle.loads(bytes(bytes_view(self.tensors[node["id"]])))  # noqa: S301 - opted in
        raise ManifestError(f"step {self.manifest.step}: unknown tree node type {tag!r}")


def decode_tree(manifest: Manifest, tensors: dict[int, torch.Tensor]) -> Any:
    """The saved state as new Python objects (Stateful values come back as state dicts)."""
    return _Decoder(tensors, manifest)(manifest.tree)


def _dict_node_items(node: Any) -> list[tuple[Any, Any]] | None:
    if isinstance(node, dict) and node.get("t") in ("dict", "odict"):
        return list(node["items"])
    return None


def apply_state(manifest: Manifest, tensors: dict[int, torch.Tensor], state: dict[str, Any]) -> None:
    """Restore into ``state`` in place: Stateful values get ``load_state_dict``, tensors are
    copied into, nested dicts are walked, other values are replaced. Every key of ``state``
    must be in the checkpoint; keys only in the checkpoint are left out."""
    decode = _Decoder(tensors, manifest)
    _apply(decode, manifest.tree, state, "")


def _apply(decode: _Decoder, node: Any, target: dict[Any, Any], path: str) -> None:
    items = _dict_node_items(node)
    if items is None:
        raise ValueError(f"{path or 'state'}: checkpoint holds no dict here to load into a dict")
    saved = {decode(k): v for k, v in items}
    missing = [k for k in target if k not in saved]
    if missing:
        raise KeyError(
            f"{path or 'state'}: key(s) {missing!r} are not in checkpoint step {decode.manifest.step} "
            f"(it has {sorted(map(str, saved))!r})"
        )
    for key, current in target.items():
        child = saved[key]
        where = f"{path}/{key}" if path else str(key)
        if is_stateful(current) and not isinstance(current, dict):
            current.load_state_dict(decode(child))
        elif isinstance(current, torch.Tensor):
            value = decode(child)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{where}: checkpoint holds {type(value).__name__}, state has a tensor")
            if value.shape != current.shape:
                raise ValueError(
                    f"{where}: checkpoint shape {tuple(value.shape)} != state shape {tuple(current.shape)}"
                )
            with torch.no_grad():
                current.copy_(value)
        elif isinstance(current, dict) and _dict_node_items(child) is not None:
            _apply(decode, child, current, where)
        else:
            target[key] = decode(child)
