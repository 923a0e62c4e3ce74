"""Where a DTensor's local shard lies in its global tensor, for every placement torch makes.

A DTensor's local tensor holds, along each dimension, a list of the global tensor's
indices: ``Shard(d)`` placements cut dimension ``d`` into chunks (uneven ones included),
several mesh dimensions may cut the same tensor dimension in turn, and ``_StridedShard``
(FSDP2 over tensor parallelism, expert parallelism under FSDP) cuts it as if later mesh
dimensions had cut it first. The local shard is the Cartesian product of those index
lists. Where every list is one run of consecutive indices (every layout FSDP2, TP, HSDP,
CP and EP produce in practice) the shard is one box of the global tensor; otherwise it is
split into :class:`Box` pieces, one per combination of runs, each a slice of the local
tensor.

The index lists follow torch's own definition of the layout: each sharding placement, in
mesh order, is applied with the placement's own ``_split_tensor`` to a one-dimensional
tensor of indices (what ``distribute_tensor`` does to the data), so the boxes agree with
torch whatever its sharding rules. Caller's thread (``save()``) or the loop thread (a
load's planning); no communication: all of it follows from the mesh's shape, this rank's
coordinate and the placements. ``Partial`` placements (a pending reduction, not a value)
are refused by name.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedStateError

__all__ = ["Box", "local_boxes", "mesh_id", "replica_of"]


@dataclass(frozen=True)
class Box:
    """A piece of a local shard: elements ``[local[d], local[d] + shape[d])`` of the local
    tensor along each dimension ``d`` are elements ``[offsets[d], offsets[d] + shape[d])``
    of the global tensor."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    local: tuple[int, ...]

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece of ``tensor`` (the local tensor), as a view."""
        for dim, (start, size) in enumerate(zip(self.local, self.shape, strict=True)):
            if (start, size) != (0, tensor.shape[dim]):
                tensor = tensor.narrow(dim, start, size)
        return tensor


def _is_strided(placement: Any) -> bool:
    return type(placement).__name__ == "_StridedShard"


def _cuts(placement: Any) -> bool:
    """``Shard`` or ``_StridedShard`` (which torch does not count as a ``Shard``)."""
    return bool(placement.is_shard()) or _is_strided(placement)


def _check(placements: Sequence[Any], path: str) -> None:
    for placement in placements:
        if placement.is_partial():
            raise UnsupportedStateError(
                f"{path}: a DTensor with a Partial placement holds a pending reduction, not a value; "
                "redistribute it to Shard or Replicate first"
            )
        if not (_cuts(placement) or placement.is_replicate()):
            raise UnsupportedStateError(
                f"{path}: DTensor placement {placement} is not supported (Shard, _StridedShard, Replicate)"
            )


def _one_dim(placement: Any) -> Any:
    """``placement`` acting on dimension 0 (of a one-dimensional index tensor)."""
    if _is_strided(placement):
        return type(placement)(0, split_factor=placement.split_factor)
    return type(placement)(0)


def _indices(
    size: int, dim: int, placements: Sequence[Any], mesh_shape: Sequence[int], coordinate: Sequence[int]
) -> list[int]:
    """The global indices along ``dim`` that this rank's local tensor holds, in order."""
    index = torch.arange(size)
    for mesh_dim, placement in enumerate(placements):
        if _cuts(placement) and placement.dim == dim:
            pieces, _ = _one_dim(placement)._split_tensor(index, mesh_shape[mesh_dim], with_padding=False)
            index = pieces[coordinate[mesh_dim]] if coordinate[mesh_dim] < len(pieces) else index[:0]
    return [int(i) for i in index.tolist()]


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """``indices`` as runs of consecutive values: (global start, length, local start)."""
    runs: list[tuple[int, int, int]] = []
    for position, value in enumerate(indices):
        if runs and runs[-1][0] + runs[-1][1] == value:
            start, length, local = runs[-1]
            runs[-1] = (start, length + 1, local)
        else:
            runs.append((value, 1, position))
    return runs


def local_boxes(global_shape: Sequence[int], mesh: Any, placements: Sequence[Any], path: str) -> list[Box]:
    """The boxes of the global tensor that this rank's local shard holds (one, unless a
    ``_StridedShard`` makes it hold several stretches of a dimension). An empty shard (past
    the end of an unevenly sharded dimension) is one empty box."""
    _check(placements, path)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedStateError(f"{path}: this rank is not in the DTensor's device mesh")
    shape = tuple(int(d) for d in global_shape)
    if not any(_is_strided(p) for p in placements):  # the common case: torch's own arithmetic
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
        return [Box(tuple(offsets), tuple(local_shape), (0,) * len(shape))]
    mesh_shape = tuple(mesh.shape)
    per_dim: list[list[tuple[int, int, int]]] = []
    sizes: list[int] = []
    for dim, size in enumerate(shape):
        indices = _indices(size, dim, placements, mesh_shape, coordinate)
        sizes.append(len(indices))
        per_dim.append(_runs(indices) or [(0, 0, 0)])
    if math.prod(sizes) == 0:
        return [Box(tuple(r[0][0] for r in per_dim), tuple(sizes), (0,) * len(shape))]
    return [
        Box(tuple(r[0] for r in combo), tuple(r[1] for r in combo), tuple(r[2] for r in combo))
        for combo in itertools.product(*per_dim)
    ]


def replica_of(mesh: Any, placements: Sequence[Any]) -> tuple[int, int]:
    """This rank's replica number among the ranks holding the same shard (the mesh
    dimensions with ``Replicate()``), and how many replicas there are."""
    coordinate = mesh.get_coordinate()
    replica, replicas = 0, 1
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            replica = replica * mesh.size(dim) + coordinate[dim]
            replicas *= mesh.size(dim)
    return replica, replicas


def mesh_id(mesh: Any) -> int:
    """A number naming a device mesh by its shape and its ranks (the same on every rank
    holding it): DTensors on two meshes (tied copies on two pipeline stages) are two
    copies, not two halves of one tiling."""
    from .checksums import crc32c_of

    ranks = mesh.mesh.to(torch.int64).contiguous()
    shape = ",".join(str(d) for d in ranks.shape).encode()
    return crc32c_of(ranks.numpy().tobytes(), crc32c_of(shape))
