"""A DTensor on the save side: its local shard, the shard's boxes in the global tensor, and
whether this rank is the one that writes them. Caller's thread, no communication: all of
it follows from the DTensor's mesh, placements and this rank's coordinate on the mesh
(:mod:`aiosnap.core.placements`).

Every placement FSDP2, tensor, context and expert parallelism and HSDP make is supported:
``Shard(dim)``, ``_StridedShard`` (FSDP2 over tensor parallelism), several mesh dimensions
sharding one tensor dimension, uneven and empty shards, meshes of any dimension. A box held
by several ranks (a ``Replicate()`` mesh dimension: DDP over FSDP, HSDP) is written by one
of them, chosen by the DTensor's path so that every rank holding it chooses the same one
(whatever else each rank holds) and the replica groups share the writing. ``Partial()``
values (pending reductions) are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.checksums import crc32c_of
from ..core.placements import local_boxes, mesh_id, replica_of
from ..errors import UnsupportedStateError

__all__ = ["DTensorShard", "dtensor_shards", "is_dtensor"]


def is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and isinstance(value, torch.Tensor)


@dataclass(frozen=True)
class DTensorShard:
    """One box of a DTensor's local shard (a local shard is one box, except under rare
    ``_StridedShard`` layouts that hold several stretches of a dimension)."""

    local: torch.Tensor
    """The box's elements: the local tensor, or a view of it."""
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    writes: bool
    """This rank writes the box (the others holding the same box do not)."""
    signature: str
    """What every rank holding this DTensor must agree on: global shape, dtype, placements, mesh."""
    mesh: int
    """The mesh (:func:`~aiosnap.core.placements.mesh_id`): boxes of one DTensor on one mesh tile it."""


def dtensor_shards(tensor: torch.Tensor, path: str) -> list[DTensorShard]:
    """The boxes of DTensor ``tensor``'s local shard (the entry at ``path``)."""
    placements = tuple(tensor.placements)  # type: ignore[attr-defined]
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    global_shape = tuple(tensor.shape)
    boxes = local_boxes(global_shape, mesh, placements, path)
    local = tensor.to_local().detach()  # type: ignore[attr-defined]
    held = tuple(max(b.local[d] + b.shape[d] for b in boxes) for d in range(len(global_shape)))
    if tuple(local.shape) != held:
        raise UnsupportedStateError(
            f"{path}: the DTensor's local shard has shape {tuple(local.shape)}, its placements give "
            f"{held} (an unevenly padded shard?)"
        )
    replica, replicas = replica_of(mesh, placements)
    writes = replica == crc32c_of(path.encode()) % replicas
    where = mesh_id(mesh)
    signature = f"{global_shape}|{tensor.dtype}|{placements}|{tuple(mesh.shape)}|{where:08x}"
    return [DTensorShard(box.view(local), box.offsets, global_shape, writes, signature, where) for box in boxes]
