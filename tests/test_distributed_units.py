"""The pure parts of multi-rank checkpoints: shard tiling, writer assignment, rank parts as
untrusted input, the coordinator's merge, refusals that need no second process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from aiosnap import SyncCheckpointer, UnsupportedStateError
from aiosnap.distributed.assign import assign_writers
from aiosnap.errors import ManifestError, StateMismatchError
from aiosnap.format.classes import describe
from aiosnap.format.merge import merge_parts
from aiosnap.format.parts import RankPart, build_part
from aiosnap.format.spec import ChunkSpec, DistSpec, EntrySpec, PieceSpec, SaveSpec, ShardSpec
from aiosnap.format.tiling import check_tiling, overlap
from aiosnap.load.ranks import rank_view
from aiosnap.load.select import refuse_unavailable

SAVE_ID = "0123456789abcdef"


def test_tiling_accepts_grids_uneven_and_empty_shards() -> None:
    check_tiling([7, 3], [((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (2, 3)), ((6, 0), (1, 3))])
    check_tiling([6, 10], [((r, c), (3, 5)) for r in (0, 3) for c in (0, 5)])
    check_tiling([2], [((0,), (1,)), ((1,), (1,)), ((2,), (0,)), ((2,), (0,))])  # empty shards past the end
    check_tiling([], [((), ())])
    check_tiling([0, 4], [((0, 0), (0, 4))])


@pytest.mark.parametrize(
    ("shape", "boxes", "problem"),
    [
        ([8], [((0,), (4,)), ((5,), (3,))], "gap"),
        ([8], [((0,), (5,)), ((4,), (4,))], "overlapping"),
        ([8], [((0,), (4,)), ((0,), (4,)), ((4,), (4,))], "twice"),
        ([8], [((0,), (4,))], "not at its size"),
        ([8], [((4,), (8,))], "outside"),
        ([4, 4], [((0, 0), (2, 4)), ((2, 0), (2, 2))], "overlapping"),
        ([4, 4], [((0, 0), (2, 2)), ((2, 2), (2, 2)), ((0, 2), (2, 2))], "not a grid"),
        ([4], [((0, 0), (4, 1))], "dimension"),
    ],
)
def test_tiling_refuses_what_does_not_tile(shape: list[int], boxes: list[Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_tiling(shape, boxes)


def test_overlap_of_boxes() -> None:
    assert overlap(((0, 0), (4, 4)), ((2, 3), (4, 4))) == ((2, 3), (2, 1))
    assert overlap(((0,), (4,)), ((4,), (4,))) is None


def test_writers_balanced_deterministic_and_counting_what_ranks_write_anyway() -> None:
    sizes = [100, 1, 50, 50, None, 25, 25, 0]
    writers = assign_writers(sizes, [0, 0])
    assert writers == assign_writers(sizes, [0, 0])
    assert writers[4] is None
    per_rank = [sum(s or 0 for s, w in zip(sizes, writers, strict=True) if w == r) for r in (0, 1)]
    assert abs(per_rank[0] - per_rank[1]) <= 100
    assert assign_writers([10, 10], [1000, 0]) == [1, 1]  # rank 0 already writes a big shard


def _spec(rank: int, written: tuple[int, ...], world: int = 2) -> SaveSpec:
    """Two ranks: entry 0 replicated (8 floats), entry 1 sharded (rows 0-1 on rank 0, 2-3 on rank 1)."""
    folder = f"000000000001/{SAVE_ID}/rank-{rank}"
    pieces = []
    offset = 0
    for index, nbytes in ((i, (32 if i == 0 else 16)) for i in written):
        pieces.append(PieceSpec(index, nbytes, offset))
        offset += 64
    tree = {"t": "dict", "items": [["a", {"t": "tensor", "id": 0}], ["b", {"t": "dtensor", "id": 1}]]}
    one = describe([("a", "tensor", "float32", (8,), None), ("b", "sharded", "float32", (4, 2), 0)], tree)
    return SaveSpec(
        step=1,
        save_id=SAVE_ID,
        rank=rank,
        world_size=world,
        tree=tree,
        metadata={},
        entries=(
            EntrySpec("a", "tensor", "float32", (8,), (1,), "cpu", 32),
            EntrySpec("b", "sharded", "float32", (2, 2), (2, 1), "cpu", 16),
        ),
        chunks=(ChunkSpec(f"{folder}/0.bin", offset, tuple(pieces)),),
        distributed=DistSpec(
            0,
            5.0,
            2,
            written,
            (ShardSpec(1, (2 * rank, 0), (4, 2)),),
            (),
            0,
            one.class_digest,
            one.buckets,
            announced=(one.class_digest,) * world if rank == 0 else (),
        ),  # one class, one writer group
    )


def _crcs(spec: SaveSpec) -> dict[tuple[str, int], int]:
    return {(c.object_name, p.dst_offset): 7 for c in spec.chunks for p in c.pieces}


def test_parts_merge_into_one_manifest() -> None:
    specs = [_spec(0, (0, 1)), _spec(1, (1,))]
    parts = {s.rank: RankPart.from_json(build_part(s, _crcs(s)).to_json(), "part") for s in specs}
    manifest = merge_parts(specs[0], parts)
    assert manifest.format_version == 3 and manifest.world_size == 2
    sharded = manifest.entries[1]
    assert sharded.kind == "sharded" and sharded.shape == [4, 2]
    assert [s.offsets for s in sharded.shard_records()] == [[0, 0], [2, 0]]
    assert {o.rank for o in manifest.objects} == {0, 1}


def test_merge_refuses_parts_that_do_not_make_one_checkpoint() -> None:
    specs = [_spec(0, (0, 1)), _spec(1, (0, 1))]  # both wrote the replicated entry
    parts = {s.rank: build_part(s, _crcs(s)) for s in specs}
    with pytest.raises(ValueError, match="written twice"):
        merge_parts(specs[0], parts)
    specs = [_spec(0, (1,)), _spec(1, (1,))]  # nobody did
    with pytest.raises(ValueError, match="written by no rank"):
        merge_parts(specs[0], {s.rank: build_part(s, _crcs(s)) for s in specs})
    with pytest.raises(ValueError, match="parts of ranks"):
        merge_parts(specs[0], {0: build_part(specs[0], _crcs(specs[0]))})


def test_a_hostile_rank_part_is_refused_with_its_name() -> None:
    spec = _spec(1, (1,))
    document = json.loads(build_part(spec, _crcs(spec)).to_json())
    document.pop("crc32c")
    stolen = {**document, "objects": [{**document["objects"][0], "name": f"000000000001/{SAVE_ID}/rank-0/0.bin"}]}
    escaping = {**document, "objects": [{**document["objects"][0], "name": "../../etc/passwd"}]}
    wild = {**document, "written": [{**document["written"][0], "entry": 99}]}
    unchecked = {**document, "written": [{**document["written"][0],
                 "ranges": [{**document["written"][0]["ranges"][0], "crc32c": None}]}]}  # fmt: skip
    for forged, problem in ((stolen, "not in rank 1's folder"), (escaping, "unsafe"), (wild, "out of range"),
                            (unchecked, "without a crc32c")):  # fmt: skip
        body = json.dumps(forged).encode()
        data = body[:-1] + b',"crc32c":%d}' % crc32c.crc32c(body)
        with pytest.raises(ManifestError, match=f"part.json: invalid rank part: .*{problem}"):
            RankPart.from_json(data, "part.json")
    with pytest.raises(ManifestError, match="damaged"):
        RankPart.from_json(build_part(spec, _crcs(spec)).to_json().replace(b'"rank":1', b'"rank":0'), "part.json")


def test_rank_view_gives_each_rank_its_own_values() -> None:
    from aiosnap.format.manifest import EntryRecord, Manifest, RankLocalRecord

    def record(rank: int) -> RankLocalRecord:
        return RankLocalRecord(values=[rank * 10, {"t": "list", "items": [rank]}], entries=[])

    manifest = Manifest(
        format_version=3, step=1, save_id=SAVE_ID, created_at=0.0, world_size=2, objects=[],
        entries=[EntryRecord(path="e", kind="tensor", dtype="float32", shape=[0], stride=[1], device="cpu",
                             nbytes=0, ranges=[])],
        tree={"t": "dict", "items": [["x", {"t": "rank_local", "slot": 0}], ["y", {"t": "rank_local", "slot": 1}]]},
        metadata={}, rank_local=[record(0), record(1)],
    )  # fmt: skip
    view = rank_view(manifest, 1, 2, skip_rank_local=False)
    assert view.tree["items"] == [["x", 10], ["y", {"t": "list", "items": [1]}]]
    skipped = rank_view(manifest, 0, 3, skip_rank_local=True)
    assert skipped.tree["items"] == [["x", {"t": "skipped"}], ["y", {"t": "skipped"}]]
    elsewhere = rank_view(manifest, 0, 3, skip_rank_local=False)  # refused only where a load needs them
    assert [value["t"] for _, value in elsewhere.tree["items"]] == ["unavailable", "unavailable"]
    with pytest.raises(StateMismatchError, match="2 ranks"):
        refuse_unavailable(elsewhere.tree)
    with pytest.raises(ValueError, match="rank-local values of 1 ranks"):
        Manifest.model_validate({**manifest.model_dump(), "rank_local": [record(0).model_dump()]})
    with pytest.raises(ValueError, match="no multi-rank parts"):
        Manifest.model_validate({**manifest.model_dump(), "format_version": 2})


def test_single_rank_rank_local_values_round_trip_and_refusals(tmp_path: Path) -> None:
    with SyncCheckpointer({"storage": {"url": str(tmp_path / "root")}, "events": {"log": False}}) as ckpt:
        ckpt.save({"w": torch.ones(3), "rng": {"seed": torch.arange(4)}}, step=1, rank_local=["rng"]).wait()
        loaded = ckpt.load()
        assert torch.equal(loaded["rng"]["seed"], torch.arange(4)) and torch.equal(loaded["w"], torch.ones(3))
        with pytest.raises(ValueError, match="rank_local must be"):
            ckpt.save({"w": torch.ones(3)}, step=2, rank_local=[""])
    from aiosnap.trainer.plan import make_plan

    with pytest.raises(UnsupportedStateError, match="rank_local values need a folder"):
        make_plan({"w": torch.ones(2)}, step=1, chunk_bytes=4096, single_file=True, rank_local=["w"])


def test_dtensors_are_refused_where_they_cannot_be_stored(tmp_path: Path) -> None:
    import torch.distributed as dist
    from aiosnap.trainer.plan import make_plan
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        with pytest.raises(UnsupportedStateError, match="rng/x: a DTensor cannot be saved here"):
            make_plan({"rng": {"x": sharded}}, step=1, chunk_bytes=4096, rank_local=["rng"])
        with pytest.raises(UnsupportedStateError, match="w: a DTensor cannot be saved here"):
            make_plan({"w": sharded}, step=1, chunk_bytes=4096, single_file=True)
        from torch.distributed.tensor import DTensor

        partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])
        with pytest.raises(UnsupportedStateError, match="p: a DTensor with a Partial placement"):
            make_plan({"p": partial}, step=1, chunk_bytes=4096)
    finally:
        dist.destroy_process_group()


def test_reshard_reads_ranges_that_split_elements(tmp_path: Path) -> None:
    """A manifest (another writer's, or forged with valid checksums) may split a tensor's
    bytes anywhere: a partial read of it still gives the right elements."""
    import asyncio

    from aiosnap.catalog.steps import read_manifest
    from aiosnap.core.checksums import crc32c_of
    from aiosnap.load.reshard import ShardTarget, overlaps, read_into_targets
    from aiosnap.storage.local import LocalStorage
    from tests.fuzzing import sign_manifest

    root = tmp_path / "root"
    with SyncCheckpointer({"storage": {"url": str(root)}, "events": {"log": False}}) as ckpt:
        ckpt.save({"w": torch.tensor([10.0, 11.0, 12.0, 13.0])}, step=1).wait()
    path = next(root.glob("*/manifest.json"))
    doc = json.loads(path.read_bytes())
    (only,) = doc["entries"][0]["ranges"]
    data = (root / only["object"]).read_bytes()[only["offset"] : only["offset"] + 16]
    doc["entries"][0]["ranges"] = [
        {"object": only["object"], "offset": only["offset"] + a, "nbytes": b - a, "crc32c": crc32c_of(data[a:b])}
        for a, b in ((0, 2), (2, 10), (10, 16))
    ]
    path.write_bytes(sign_manifest(doc))

    async def element(index: int) -> float:
        storage = LocalStorage(str(root))
        manifest = await read_manifest(storage, 1)
        dest = torch.zeros(1)
        pieces = overlaps(manifest, {0: ShardTarget(dest, (index,), (1,), dest)})
        await read_into_targets(storage, "test", pieces, asyncio.Semaphore(2))
        return float(dest[0])

    assert [asyncio.run(element(i)) for i in range(4)] == [10.0, 11.0, 12.0, 13.0]
