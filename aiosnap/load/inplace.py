"""In-place loads: which of the caller's tensors can receive an entry's bytes directly.

``load(state)`` reads an entry straight into the tensor it will restore when that tensor is
a contiguous CPU tensor of the entry's dtype and shape whose memory overlaps no other
destination: no second copy of the state is allocated, and restoring it is then a no-op
(the bytes are already there). Everything else (CUDA targets, other dtypes or layouts,
tensors sharing memory) is read into a fresh tensor and copied, as before.

- :func:`target_tree` runs on the caller's thread before the load: the state as the load
  will restore it, each Stateful object replaced by its ``state_dict()`` (whose tensors are,
  for modules and optimizers, the object's own memory).
- :func:`destinations` runs on the loop thread once the manifest is read: it pairs the
  checkpoint's tree with that target tree (reading only tensor metadata).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..format.manifest import Manifest
from ..stateful import is_stateful
from .select import entries_under

__all__ = ["destinations", "target_tree"]


def target_tree(state: Any) -> Any:
    """Caller's thread: ``state`` with Stateful objects replaced by their state dicts;
    dicts, lists and tuples walked, tensors kept, anything else None."""
    if isinstance(state, torch.Tensor):
        return state
    if is_stateful(state) and not isinstance(state, (dict, list, tuple)):
        return target_tree(state.state_dict())
    if isinstance(state, dict):
        return {key: target_tree(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return [target_tree(value) for value in state]
    return None


def _usable(target: torch.Tensor, manifest: Manifest, index: int) -> bool:
    entry = manifest.entries[index]
    return (
        entry.kind == "tensor"
        and type(target) in (torch.Tensor, torch.nn.Parameter)
        and target.device.type == "cpu"
        and target.layout == torch.strided
        and not target.is_meta
        and not target.is_conj()
        and not target.is_neg()
        and target.is_contiguous()
        and str(target.dtype).removeprefix("torch.") == entry.dtype
        and list(target.shape) == entry.shape
        and entry.nbytes > 0
    )


def destinations(manifest: Manifest, targets: Any, decode_key: Callable[[Any], Any]) -> dict[int, torch.Tensor]:
    """Loop thread: entry id -> the caller's tensor its bytes can be read into."""
    found: dict[int, torch.Tensor] = {}
    pending: list[tuple[Any, Any]] = [(manifest.tree, targets)]
    while pending:
        node, target = pending.pop()
        if target is None or not isinstance(node, dict):
            continue
        tag = node.get("t")
        if tag == "tensor" and isinstance(target, torch.Tensor):
            index = node["id"]
            if index not in found and _usable(target, manifest, index):
                found[index] = target
        elif tag == "stateful":
            pending.append((node["v"], target))
        elif tag in ("dict", "odict") and isinstance(target, dict):
            for raw_key, child in node["items"]:
                if entries_under(raw_key):  # a tensor or pickled key needs data: not in place
                    continue
                key = decode_key(raw_key)
                if key in target:
                    pending.append((child, target[key]))
        elif tag in ("list", "tuple") and isinstance(target, list) and len(target) == len(node["items"]):
            pending.extend(zip(node["items"], target, strict=True))
    return _without_overlaps(found)


def _without_overlaps(found: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Drop destinations whose memory overlaps another's (tensors sharing a storage, views):
    two reads must never land in the same bytes."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i) for i, t in found.items())
    clash: set[int] = set()
    reach, holder = -1, -1
    for start, end, index in spans:
        if start < reach:
            clash |= {index, holder}
        if end > reach:
            reach, holder = end, index
    return {i: t for i, t in found.items() if i not in clash}
