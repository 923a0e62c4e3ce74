"""Cutting DCP's write items into tiles that fit a staging slab.

DCP plans one write item per tensor chunk (a whole tensor, or a DTensor's local shard),
however large. aiosnap's writer stages each item in a slab of its RAM budget, so in
``prepare_local_plan`` it cuts larger items into *tiles*: boxes of the chunk, each one a
chunk of its own in the checkpoint's metadata (DCP's format holds any number of chunks per
tensor; torch's readers and aiosnap's read them alike). The cut depends only on the
tensor's global size, so that every rank cuts alike and the tiles of all chunks together
form a grid (what an aiosnap manifest checks): the first dimension ``k`` whose trailing
slices fit the target is cut at global multiples of a block of rows, the dimensions before
it into single indices, the later ones not at all. Pure code (plans are data).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

__all__ = ["Tile", "tile_boxes", "tile_plan"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Tile:
    """A tile's source: the planner's own item, and the tile's box relative to its chunk."""

    item: WriteItem
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def tile_boxes(
    size: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], itemsize: int, target: int
) -> list[Box]:
    """The tiles (global offsets, sizes) of the chunk at ``offsets`` of ``sizes`` in a
    tensor of global ``size``: the chunk itself when the whole tensor fits ``target`` bytes."""
    if math.prod(size) * itemsize <= target or math.prod(sizes) == 0 or not size:
        return [(offsets, sizes)]
    k = next(d for d in range(len(size)) if math.prod(size[d + 1 :]) * itemsize <= target)
    block = max(1, target // (math.prod(size[k + 1 :]) * itemsize))
    start, stop = offsets[k], offsets[k] + sizes[k]
    cuts = sorted({start, stop, *range((start // block + 1) * block, stop, block)})
    spans = list(itertools.pairwise(cuts))
    before = [range(offsets[d], offsets[d] + sizes[d]) for d in range(k)]
    boxes: list[Box] = []
    for head in itertools.product(*before):
        for a, b in spans:
            boxes.append(((*head, a, *offsets[k + 1 :]), (*(1,) * k, b - a, *sizes[k + 1 :])))
    return boxes


def tile_plan(plan: SavePlan, target: int) -> tuple[SavePlan, dict[MetadataIndex, Tile]]:
    """``plan`` with its tensor items cut into tiles of at most ``target`` bytes, and the
    source of every item of the new plan that is a tile of a larger one."""
    items: list[WriteItem] = []
    tiles: dict[MetadataIndex, Tile] = {}
    for item in plan.items:
        data = item.tensor_data
        if item.type == WriteItemType.BYTE_IO or data is None:
            items.append(item)
            continue
        itemsize = data.properties.dtype.itemsize
        chunk_offsets, chunk_sizes = tuple(data.chunk.offsets), tuple(data.chunk.sizes)
        boxes = tile_boxes(tuple(data.size), chunk_offsets, chunk_sizes, itemsize, target)
        if len(boxes) == 1:
            items.append(item)
            continue
        for offsets, sizes in boxes:
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            tile = dataclasses.replace(
                item,
                type=WriteItemType.SHARD,  # one of several chunks of its tensor
                index=MetadataIndex(item.index.fqn, offsets),
                tensor_data=dataclasses.replace(data, chunk=chunk),
            )
            items.append(tile)
            relative = tuple(o - c for o, c in zip(offsets, chunk_offsets, strict=True))
            tiles[tile.index] = Tile(item, relative, sizes)
    return dataclasses.replace(plan, items=items), tiles
