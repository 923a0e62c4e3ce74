"""A multi-rank save of plain states, every rank simulated in this one process.

Each "rank" plans its save with aiosnap's own planner and ownership rules (the agreement
fed with every rank's proposal, as the all-gather would), copies its chunks' bytes, writes
its data objects and its part to a real local store; then the coordinator's own commit code
(:func:`aiosnap.transfer.rank_commit.gather_manifest`) merges the parts and commits the
manifest. No process group: the union, ownership and merge rules on real bytes, in
milliseconds. (DTensors need a real mesh: they are tested on gloo, ``test_layouts.py``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from aiosnap.config import DistributedConfig
from aiosnap.core.checksums import crc32c_of
from aiosnap.core.tensorio import copy_range_into
from aiosnap.distributed.group import SaveProposal
from aiosnap.distributed.ownership import decide, holdings
from aiosnap.format.manifest import Checksums, Manifest
from aiosnap.format.parts import build_part, part_name
from aiosnap.storage.local import LocalStorage
from aiosnap.trainer.chunks import SavePlan
from aiosnap.trainer.plan import Agreement, Flattened, make_plan
from aiosnap.transfer.commit import commit_manifest
from aiosnap.transfer.rank_commit import gather_manifest

SAVE_ID = "0123456789abcdef"
CHUNK = 4096


class _Stop(Exception):
    pass


def _flattened(state: dict[str, Any], rank: int, world: int, rank_local: list[str]) -> Flattened:
    seen: list[Flattened] = []

    def capture(flat: Flattened) -> Agreement:
        seen.append(flat)
        raise _Stop

    with contextlib.suppress(_Stop):
        make_plan(
            state,
            step=1,
            chunk_bytes=CHUNK,
            rank=rank,
            world_size=world,
            rank_local=rank_local,
            agree=capture,
            pickle_values=True,
        )
    return seen[0]


def plan_ranks(states: list[dict[str, Any]], rank_local: list[str] | None = None) -> list[SavePlan]:
    """Every rank's plan, as the agreement would make them."""
    world, patterns = len(states), rank_local or []
    found = []
    for rank, state in enumerate(states):
        flat = _flattened(state, rank, world, patterns)
        held = holdings(flat)
        found.append(SaveProposal(1, SAVE_ID, held.class_digest, held.preload, held.local_digest, held.buckets))

    def agree(rank: int) -> Callable[[Flattened], Agreement]:
        return lambda flat: decide(flat, rank, holdings(flat), found, 0, 5.0)

    return [
        make_plan(
            state,
            step=1,
            chunk_bytes=CHUNK,
            rank=r,
            world_size=world,
            rank_local=patterns,
            agree=agree(r),
            pickle_values=True,
        )
        for r, state in enumerate(states)
    ]


async def _write_objects(storage: LocalStorage, plan: SavePlan) -> Checksums:
    crcs: Checksums = {}
    for chunk in plan.chunks:
        slab = torch.zeros(chunk.nbytes, dtype=torch.uint8)
        for piece in chunk.pieces:
            copy_range_into(slab, piece.dst_offset, plan.entries[piece.entry].tensor, piece.src_offset, piece.nbytes)
            data = slab.numpy().tobytes()[piece.dst_offset : piece.dst_offset + piece.nbytes]
            crcs[(chunk.object_name, piece.dst_offset)] = crc32c_of(data)
        await storage.write(chunk.object_name, slab.numpy().tobytes())
    return crcs


def write_ranks(root: Path, plans: list[SavePlan]) -> Checksums:
    """Every rank's data objects, and the parts of ranks 1..N-1; rank 0's checksums."""

    async def run() -> Checksums:
        storage = LocalStorage(str(root))
        own: Checksums = {}
        for plan in plans:
            crcs = await _write_objects(storage, plan)
            if plan.spec.rank == 0:
                own = crcs
            else:
                await storage.write(part_name(1, plan.save_id, plan.spec.rank), build_part(plan.spec, crcs).to_json())
        await storage.close()
        return own

    return asyncio.run(run())


def commit(root: Path, plans: list[SavePlan], own: Checksums) -> Manifest:
    """The coordinator's merge of the parts in storage, committed."""

    async def run() -> Manifest:
        storage = LocalStorage(str(root))
        try:
            manifest = await gather_manifest(storage, plans[0].spec, own, DistributedConfig())
            await commit_manifest(storage, manifest, replace=False)
            return manifest
        finally:
            await storage.close()

    return asyncio.run(run())


def save_as_ranks(root: Path, states: list[dict[str, Any]], rank_local: list[str] | None = None) -> Manifest:
    """Save ``states`` (rank ``r``'s is ``states[r]``) as one multi-rank step 1."""
    plans = plan_ranks(states, rank_local)
    return commit(root, plans, write_ranks(root, plans))


def part_document(root: Path, rank: int) -> dict[str, Any]:
    path = root / part_name(1, SAVE_ID, rank)
    if not path.exists():
        path = next(root.glob(f"000000000001/*/rank-{rank}.part.json"))
    doc: dict[str, Any] = json.loads(path.read_bytes())
    doc.pop("crc32c")
    return doc
