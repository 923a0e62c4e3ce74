"""A DTensor on the save side: its local shard, the shard's box in the global tensor, and
whether this rank is the one that writes it. Caller's thread, no communication: all of it
follows from the DTensor's mesh, placements and this rank's coordinate on the mesh.

``Shard(dim)`` and ``Replicate()`` placements on meshes of any dimension are supported,
uneven shards included. A box held by several ranks (a ``Replicate()`` mesh dimension:
DDP over FSDP, HSDP) is written by one of them, chosen by the entry's index so that the
replica groups share the writing. ``Partial()`` values (pending reductions) and strided
shards (FSDP2 combined with tensor parallelism) are refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedStateError

__all__ = ["DTensorShard", "dtensor_shard", "is_dtensor"]


def is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and isinstance(value, torch.Tensor)


@dataclass(frozen=True)
class DTensorShard:
    local: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    writes: bool
    """This rank writes the shard (the others holding the same box do not)."""
    signature: str
    """What every rank must agree on: global shape, dtype and placements."""


def dtensor_shard(tensor: torch.Tensor, path: str, index: int) -> DTensorShard:
    """The local shard of DTensor ``tensor`` (the entry ``index`` at ``path``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(tensor.placements)  # type: ignore[attr-defined]
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    for placement in placements:
        if placement.is_partial():
            raise UnsupportedStateError(
                f"{path}: a DTensor with a Partial placement holds a pending reduction, not a value; "
                "redistribute it to Shard or Replicate first"
            )
        if not (placement.is_shard() or placement.is_replicate()) or type(placement).__name__ == "_StridedShard":
            raise UnsupportedStateError(f"{path}: DTensor placement {placement} is not supported (Shard, Replicate)")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedStateError(f"{path}: this rank is not in the DTensor's device mesh")
    global_shape = tuple(tensor.shape)
    local_shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    local = tensor.to_local().detach()  # type: ignore[attr-defined]
    if tuple(local.shape) != tuple(local_shape):
        raise UnsupportedStateError(
            f"{path}: the DTensor's local shard has shape {tuple(local.shape)}, its placements give "
            f"{tuple(local_shape)} (an unevenly padded shard?)"
        )
    replicated = [dim for dim, p in enumerate(placements) if p.is_replicate()]
    replica = 0
    for dim in replicated:
        replica = replica * mesh.size(dim) + coordinate[dim]
    replicas = math.prod(mesh.size(dim) for dim in replicated)
    signature = f"{tuple(global_shape)}|{tensor.dtype}|{placements}|{tuple(mesh.shape)}"
    return DTensorShard(local, tuple(offsets), global_shape, replica == index % replicas, signature)
