"""The multi-rank commit protocol at thousands of ranks, simulated: ``aiosnap bench
distributed --simulate`` prints a table (and JSON).

No processes: one program makes every rank's save plan, in one of two layouts: ``sharded``
(``--tensors`` row-sharded tensors, one shard per rank each, and ``--replicated`` replicated
entries assigned to writers as a real save does) or ``pipeline`` (each rank ``--tensors``
entries of its own, distinct keys, and an embedding the first and last rank both hold: each
rank its own class, so each part ships its table and tree); writes the parts of ranks
1..N-1 to storage as those ranks would, then measures what the coordinator (rank 0) does to
commit: gather and check every part, merge, write the step's manifest. Per layout, job size
and storage (local disk; the S3 test server, moto, started here): the coordinator's commit
time, its peak Python memory (tracemalloc, in a second pass), its storage requests by kind,
the requests a non-coordinator makes to learn of the commit, and the reshard planning of
one rank of a job half the size (read and validate the manifest; ``sharded``: find the
stored shards its DTensors overlap; ``pipeline``: the entries of the two stages it holds).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import tempfile
import time
import tracemalloc
import uuid
from collections import Counter
from typing import Any, ClassVar

import torch

from ..catalog.steps import read_manifest
from ..config import DistributedConfig
from ..distributed.assign import assign_writers
from ..format.buckets import bucket_of
from ..format.classes import describe
from ..format.spec import ChunkSpec, DistSpec, EntrySpec, PieceSpec, SaveSpec, ShardSpec
from ..load.reshard import ShardTarget, overlaps
from ..storage.base import Storage
from ..transfer.commit import commit_manifest
from ..transfer.rank_commit import deliver_part, gather_manifest
from ..transfer.rank_wait import wait_for_commit

__all__ = ["main"]

ROWS = 4
COLUMNS = 256
SAVE_ID = "5eed5eed5eed5eed"


class Counting:
    """Counts a storage's requests by kind (LIST, GET, PUT, HEAD); delegates everything."""

    KINDS: ClassVar[dict[str, str]] = {
        "list_children": "LIST", "read": "GET", "write": "PUT", "write_marker": "PUT", "exists": "HEAD",
        "size": "HEAD",
    }  # fmt: skip

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.counts: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        kind = self.KINDS.get(name)
        if kind is None:
            return value

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[kind] += 1
            return await value(*args, **kwargs)

        return counted


def rank_spec(rank: int, world: int, tensors: int, replicated: list[int], writers: list[int | None]) -> SaveSpec:
    """Rank ``rank``'s plan: a shard of each sharded tensor, the replicated entries it writes."""
    entries: list[EntrySpec] = []
    shards: list[ShardSpec] = []
    for index in range(tensors):
        entries.append(EntrySpec(f"model/layer{index}.weight", "sharded", "float32", (ROWS, COLUMNS),
                                 (COLUMNS, 1), "cpu", ROWS * COLUMNS * 4))  # fmt: skip
        shards.append(ShardSpec(index, (rank * ROWS, 0), (world * ROWS, COLUMNS)))
    for offset, nbytes in enumerate(replicated):
        entries.append(EntrySpec(f"model/norm{offset}", "tensor", "float32", (nbytes // 4,), (1,), "cpu", nbytes))
    written = tuple(i for i in range(len(entries)) if i < tensors or writers[i] == rank)
    pieces, position = [], 0
    for index in written:
        pieces.append(PieceSpec(index, entries[index].nbytes, position))
        position += -(-entries[index].nbytes // 64) * 64
    tree = {"t": "dict", "items": [["model", {"t": "dict", "items": [
        [e.path.split("/", 1)[1], {"t": "dtensor" if i < tensors else "tensor", "id": i}] for i, e in enumerate(entries)
    ]}]]}  # fmt: skip
    rows = [(e.path, e.kind, e.dtype, (world * ROWS, COLUMNS) if i < tensors else e.shape, 0 if i < tensors else None)
            for i, e in enumerate(entries)]  # fmt: skip
    one = describe(rows, tree)  # one class: every rank holds the same table
    return SaveSpec(
        step=1, save_id=SAVE_ID, rank=rank, world_size=world, tree=tree, metadata={}, entries=tuple(entries),
        chunks=(ChunkSpec(f"000000000001/{SAVE_ID}/rank-{rank}/0.bin", position, tuple(pieces)),),
        distributed=DistSpec(0, 3600.0, len(entries), written, tuple(shards), (), 0, one.class_digest, one.buckets,
                             announced=(one.class_digest,) * world if rank == 0 else ()),
    )  # fmt: skip


def _pipeline_stage(rank: int, world: int, tensors: int) -> tuple[list[str], Any, Any]:
    """A pipeline-style rank's paths, tree and its table's description."""
    paths = [f"model/layers.{rank * tensors + i}.weight" for i in range(tensors)]
    if rank in (0, world - 1):
        paths.append("model/embed.weight")
    layers = [[p.split("/", 1)[1], {"t": "tensor", "id": i}] for i, p in enumerate(paths)]
    tree = {"t": "dict", "items": [["model", {"t": "dict", "items": layers}], ["step", 1]]}
    return paths, tree, describe([(p, "tensor", "float32", (ROWS, COLUMNS), None) for p in paths], tree)


@functools.lru_cache(maxsize=4)
def _pipeline_classes(world: int, tensors: int) -> tuple[str, ...]:
    return tuple(_pipeline_stage(rank, world, tensors)[2].class_digest for rank in range(world))


def pipeline_spec(rank: int, world: int, tensors: int) -> SaveSpec:
    """Rank ``rank``'s plan in a pipeline-style job: ``tensors`` entries of its own (its
    layers: distinct keys per rank), an embedding the first and last rank both hold, the
    step; its own class (its part ships its table and tree), its own writer groups. The
    embedding is written by the first rank when the two hold the same entries in its bucket
    (one writer group; the last rank then ships its crc32c), else by both."""
    paths, tree, mine = _pipeline_stage(rank, world, tensors)
    nbytes = ROWS * COLUMNS * 4
    entries = tuple(EntrySpec(p, "tensor", "float32", (ROWS, COLUMNS), (COLUMNS, 1), "cpu", nbytes) for p in paths)
    written, checksums = list(range(len(entries))), []
    if rank == world - 1 and rank > 0:
        bucket = bucket_of("model/embed.weight")
        if _pipeline_stage(0, world, tensors)[2].buckets[bucket] == mine.buckets[bucket]:
            written.remove(len(paths) - 1)
            checksums.append((len(paths) - 1, 0))
    pieces = tuple(PieceSpec(i, nbytes, n * nbytes) for n, i in enumerate(written))
    return SaveSpec(
        step=1, save_id=SAVE_ID, rank=rank, world_size=world, tree=tree, metadata={}, entries=entries,
        chunks=(ChunkSpec(f"000000000001/{SAVE_ID}/rank-{rank}/0.bin", len(written) * nbytes, pieces),),
        distributed=DistSpec(0, 3600.0, len(entries), tuple(written), (), (), rank, mine.class_digest, mine.buckets,
                             tuple(checksums), _pipeline_classes(world, tensors) if rank == 0 else ()),
    )  # fmt: skip


def _crcs(spec: SaveSpec) -> dict[tuple[str, int], int]:
    return {(c.object_name, p.dst_offset): 0 for c in spec.chunks for p in c.pieces}


async def _measure(storage: Storage, world: int, spec_of: Any, reshard: Any) -> dict[str, Any]:
    """The commit of a job of ``world`` ranks whose plans ``spec_of(rank)`` gives; then
    ``reshard(manifest)`` plans one rank's load of it in a job of half the size."""
    started = time.perf_counter()
    limit = asyncio.Semaphore(64)

    async def deliver(rank: int) -> None:
        spec = spec_of(rank)
        async with limit:
            await deliver_part(storage, spec, _crcs(spec))

    await asyncio.gather(*(deliver(rank) for rank in range(1, world)))
    setup_s = time.perf_counter() - started
    coordinator = spec_of(0)
    counting = Counting(storage)
    started = time.perf_counter()
    timers = DistributedConfig()
    manifest = await gather_manifest(counting, coordinator, _crcs(coordinator), timers)  # type: ignore[arg-type]
    manifest_bytes = await commit_manifest(counting, manifest, replace=False)  # type: ignore[arg-type]
    commit_s = time.perf_counter() - started
    requests = dict(counting.counts)
    tracemalloc.start()
    again = await gather_manifest(storage, coordinator, _crcs(coordinator), timers)
    again.to_json()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    follower = Counting(storage)
    await wait_for_commit(follower, spec_of(1), timers)  # type: ignore[arg-type]
    started = time.perf_counter()
    loaded = await read_manifest(storage, 1)
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    planned = reshard(loaded)
    plan_s = time.perf_counter() - started
    return {
        "ranks": world,
        "parts_written_s": round(setup_s, 2),
        "commit_s": round(commit_s, 3),
        "commit_peak_mib": round(peak / 2**20, 1),
        "manifest_mib": round(manifest_bytes / 2**20, 2),
        "requests": requests,
        "follower_requests": dict(follower.counts),
        "reshard_read_manifest_s": round(read_s, 3),
        "reshard_plan_s": round(plan_s, 4),
        "reshard_reads": planned,
    }


def _sharded(world: int, tensors: int, replicated_count: int) -> tuple[Any, Any]:
    """Every rank a shard of each sharded tensor; replicated entries balanced over all."""
    replicated = [4096 * (1 + i % 4) for i in range(replicated_count)]
    sizes: list[int | None] = [None] * tensors + list(replicated)
    writers = assign_writers(sizes, [tensors * ROWS * COLUMNS * 4] * world)
    half = max(1, world // 2)
    rows = world * ROWS // half  # a rank of the half-size job holds two stored shards' rows

    def reshard(loaded: Any) -> int:
        middle = half // 2
        targets = {
            index: ShardTarget(torch.empty(0), (middle * rows, 0), (rows, COLUMNS), torch.empty(0))
            for index in range(tensors)
        }
        return len(overlaps(loaded, targets))

    return (lambda rank: rank_spec(rank, world, tensors, replicated, writers)), reshard


def _pipeline(world: int, tensors: int) -> tuple[Any, Any]:
    """Every rank its own layers; a rank of the half-size job holds two ranks' layers."""
    from ..load.apply import plan_read
    from ..load.inplace import target_tree

    def reshard(loaded: Any) -> int:
        middle = max(1, world // 2) // 2
        keys = [f"layers.{r * tensors + i}.weight" for r in (2 * middle, 2 * middle + 1) for i in range(tensors)]
        state = {"model": {k: torch.empty(ROWS, COLUMNS) for k in keys}}
        plan = plan_read(loaded, state, target_tree(state), None, False)
        return len(plan.only or ())

    return (lambda rank: pipeline_spec(rank, world, tensors)), reshard


def _storages(kind: str) -> Any:
    import contextlib

    @contextlib.contextmanager
    def local() -> Any:
        from ..storage.local import LocalStorage

        folder = tempfile.mkdtemp(prefix="aiosnap-sim-")
        try:
            yield lambda: LocalStorage(os.path.join(folder, uuid.uuid4().hex[:8]))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @contextlib.contextmanager
    def s3() -> Any:
        from ..config import Config
        from ..storage.s3 import S3Storage
        from .s3 import _create_bucket, _endpoint

        with _endpoint(None, None) as url:
            bucket = f"aiosnap-sim-{uuid.uuid4().hex[:8]}"
            asyncio.run(_create_bucket(url, bucket))
            config = Config(s3={"endpoint_url": url, "addressing_style": "path"})
            yield lambda: S3Storage(bucket, uuid.uuid4().hex[:8], config.s3)

    return local() if kind == "local" else s3()


async def _one(make: Any, layout: str, world: int, tensors: int, replicated: int) -> dict[str, Any]:
    storage = make()
    spec_of, reshard = _sharded(world, tensors, replicated) if layout == "sharded" else _pipeline(world, tensors)
    try:
        return {"layout": layout, **await _measure(storage, world, spec_of, reshard)}
    finally:
        await storage.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="aiosnap bench distributed --simulate", description=__doc__)
    parser.add_argument("--ranks", default="128,1024,8192", help="simulated job sizes")
    parser.add_argument("--tensors", type=int, default=16, help="sharded tensors (one shard per rank each)")
    parser.add_argument("--replicated", type=int, default=64, help="replicated entries")
    parser.add_argument("--storage", default="local,s3", help="local, s3 or both")
    parser.add_argument(
        "--layouts", default="sharded,pipeline",
        help="sharded (every rank a shard of each tensor), pipeline (every rank its own keys), or both",
    )  # fmt: skip
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"tensors": args.tensors, "replicated": args.replicated}
    for kind in args.storage.split(","):
        rows = []
        with _storages(kind) as make:
            for layout in args.layouts.split(","):
                for world in (int(w) for w in args.ranks.split(",")):
                    rows.append(asyncio.run(_one(make, layout, world, args.tensors, args.replicated)))
        report[kind] = rows
        _table(kind, rows)
    print(json.dumps(report, indent=2))
    return report


def _table(kind: str, rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{kind}: layout | ranks | commit s | peak MiB | manifest MiB | LIST GET PUT HEAD | follower | read s "
        "| plan s"
    )
    for row in rows:
        r = row["requests"]
        follower = sum(row["follower_requests"].values())
        print(
            f"{row['layout']:>8} | {row['ranks']:>6} | {row['commit_s']:>8} | {row['commit_peak_mib']:>8} | "
            f"{row['manifest_mib']:>12} | "
            f"{r.get('LIST', 0)} {r.get('GET', 0)} {r.get('PUT', 0)} {r.get('HEAD', 0)} | {follower} | "
            f"{row['reshard_read_manifest_s']:>15} | {row['reshard_plan_s']}"
        )
    per_rank = [row["commit_s"] / row["ranks"] for row in rows]
    print(f"commit seconds per rank: {', '.join(f'{p * 1e3:.2f} ms' for p in per_rank)} (linear when these agree)")
