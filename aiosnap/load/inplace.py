"""In-place loads: which of the caller's tensors can receive an entry's bytes directly.

``load(state)`` reads an entry straight into the tensor it will restore when that tensor is
a contiguous CPU tensor of the entry's dtype and shape whose memory overlaps no other
destination: no second copy of the state is allocated, and restoring it is then a no-op
(the bytes are already there). A CUDA tensor or a strided CPU view of the entry's dtype
and shape is loaded through staging slabs instead (:mod:`aiosnap.load.staged`): the same
outcome, in bounded host memory. Everything else (other dtypes or shapes, tensors sharing
memory, subclasses) is read into a fresh tensor and copied, as before.

- :func:`target_tree` runs on the caller's thread before the load: the state as the load
  will restore it, each Stateful object replaced by its ``state_dict()`` (whose tensors are,
  for modules and optimizers, the object's own memory).
- :func:`destinations` runs on the loop thread once the manifest is read: it pairs the
  checkpoint's tree with that target tree (reading only tensor metadata).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..core.stateful import is_stateful
from ..format.manifest import Manifest
from ..format.values import key_path
from .select import entries_under

__all__ = ["destinations", "staged_destinations", "target_tree", "tensor_paths", "tensor_targets"]


def target_tree(state: Any, *, inside_stateful: bool = False) -> Any:
    """Caller's thread: ``state`` as the load restores it: tensors (copied into) kept, dicts
    walked, Stateful objects replaced by their state dicts (walked, lists included: they are
    handed to ``load_state_dict``); anything else None -- among them lists and tuples of the
    state itself, which a load replaces rather than writes into, and a Stateful whose
    ``state_dict()`` fails (it is restored from new tensors)."""
    if isinstance(state, torch.Tensor):
        return state
    if is_stateful(state) and not isinstance(state, (dict, list, tuple)):
        try:
            own = state.state_dict()
        except Exception:  # restorable before it can be saved (not set up yet): no in-place read
            return None
        return target_tree(own, inside_stateful=True)
    if isinstance(state, dict):
        return {key: target_tree(value, inside_stateful=inside_stateful) for key, value in state.items()}
    if inside_stateful and isinstance(state, (list, tuple)):
        return [target_tree(value, inside_stateful=True) for value in state]
    return None


def _same_tensor(target: torch.Tensor, manifest: Manifest, index: int) -> bool:
    """``target`` is a plain tensor of entry ``index``'s dtype and shape, in host or CUDA memory."""
    entry = manifest.entries[index]
    return (
        entry.kind == "tensor"
        and type(target) in (torch.Tensor, torch.nn.Parameter)
        and target.device.type in ("cpu", "cuda")
        and target.layout == torch.strided
        and not target.is_meta
        and not target.is_conj()
        and not target.is_neg()
        and str(target.dtype).removeprefix("torch.") == entry.dtype
        and list(target.shape) == entry.shape
        and entry.nbytes > 0
        and all(step != 0 or size <= 1 for size, step in zip(target.shape, target.stride(), strict=True))
    )  # (a stride of 0: elements sharing memory, which no copy may write)


def _usable(target: torch.Tensor, manifest: Manifest, index: int) -> bool:
    return _same_tensor(target, manifest, index) and target.device.type == "cpu" and target.is_contiguous()


def tensor_targets(tree: Any, targets: Any, decode_key: Callable[[Any], Any]) -> Iterator[tuple[int, torch.Tensor]]:
    """Loop thread: (entry id, the caller's tensor it restores) for every tensor or dtensor
    node of ``tree`` that ``targets`` (:func:`target_tree`) has a tensor for, walking dicts
    (by decoded key), Stateful state dicts and lists of equal length."""
    pending: list[tuple[Any, Any]] = [(tree, targets)]
    while pending:
        node, target = pending.pop()
        if target is None or not isinstance(node, dict):
            continue
        tag = node.get("t")
        if tag in ("tensor", "dtensor") and isinstance(target, torch.Tensor):
            yield node["id"], target
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


def destinations(manifest: Manifest, targets: Any, decode_key: Callable[[Any], Any]) -> dict[int, torch.Tensor]:
    """Loop thread: entry id -> the caller's tensor its bytes can be read into."""
    found: dict[int, torch.Tensor] = {}
    for index, target in tensor_targets(manifest.tree, targets, decode_key):
        if index not in found and _usable(target, manifest, index):
            found[index] = target
    return _without_overlaps(found, written_tensors(targets))


def staged_destinations(
    manifest: Manifest,
    targets: Any,
    decode_key: Callable[[Any], Any],
    direct: dict[int, torch.Tensor],
    stageable: Callable[[int], bool],
) -> dict[int, torch.Tensor]:
    """Loop thread: entry id -> the caller's tensor (CUDA, or a strided CPU view) its bytes
    can be copied into through staging slabs; not those read ``direct``, nor entries whose
    ranges ``stageable`` refuses."""
    found: dict[int, torch.Tensor] = {}
    for index, target in tensor_targets(manifest.tree, targets, decode_key):
        if index not in found and index not in direct and _same_tensor(target, manifest, index) and stageable(index):
            found[index] = target
    return _without_overlaps(found, written_tensors(targets))


def written_tensors(targets: Any) -> list[torch.Tensor]:
    """Every host or CUDA tensor the load may write (in place, staged or by copying), each
    time it appears."""
    found: list[torch.Tensor] = []
    pending = [targets]
    while pending:
        current = pending.pop()
        if isinstance(current, torch.Tensor):
            if current.device.type in ("cpu", "cuda") and current.layout == torch.strided and not current.is_meta:
                found.append(current)
        elif isinstance(current, dict):
            pending.extend(current.values())
        elif isinstance(current, list):
            pending.extend(current)
    return found


def tensor_paths(targets: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``targets`` (:func:`target_tree`) with its key path, in order."""
    pending: list[tuple[Any, str]] = [(targets, "")]
    while pending:
        current, path = pending.pop()
        if isinstance(current, torch.Tensor):
            yield path or "state", current
            continue
        if isinstance(current, dict):
            children: list[tuple[Any, Any]] = list(current.items())
        elif isinstance(current, list):
            children = list(enumerate(current))
        else:
            continue
        pending.extend(reversed([(value, key_path(path, key)) for key, value in children]))


def _span(tensor: torch.Tensor) -> tuple[str, int, int]:
    """The bytes ``tensor`` can touch: its device and its extent in that device's memory,
    whatever its (non-negative) strides."""
    device = str(tensor.device)
    if tensor.numel() == 0:
        return device, tensor.data_ptr(), tensor.data_ptr()
    last = sum((size - 1) * step for size, step in zip(tensor.shape, tensor.stride(), strict=True))
    return device, tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()


def _without_overlaps(found: dict[int, torch.Tensor], written: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Keep only destinations whose memory no other tensor the load writes can touch (a
    tensor given twice, views of one buffer, tensors sharing a storage): a read must never
    land in bytes that another write, read or copy, also reaches."""
    spans = sorted((*_span(t), id(t)) for t in written)
    crowded: set[int] = set()  # ids of tensors overlapping another (or themselves, given twice)
    reach, holder, memory = -1, -1, ""
    for device, start, end, owner in spans:
        if device != memory:  # another device's memory: nothing before overlaps it
            reach, holder, memory = -1, -1, device
        if start < reach and end > start:
            crowded |= {owner, holder}
        if end > reach:
            reach, holder = end, owner
    return {i: t for i, t in found.items() if id(t) not in crowded}
