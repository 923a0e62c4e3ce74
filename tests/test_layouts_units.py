"""Ranks that hold different keys, and DTensor layouts, without a process group: the
placement math against torch's own layout rules, who writes a key held by several ranks,
the union of the ranks' trees, and the coordinator's merge of real parts (honest, forged,
fuzzed) written by ranks simulated in this process (:mod:`simulated_ranks`)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from aiosnap import AiosnapError, CorruptCheckpointError, RanksDisagreeError, SyncCheckpointer
from aiosnap.config import DistributedConfig
from aiosnap.core.placements import local_boxes
from aiosnap.format.parts import part_name
from aiosnap.format.union import TreeUnion
from aiosnap.storage.local import LocalStorage
from aiosnap.transfer.rank_commit import gather_manifest
from tests.fuzzing import mutate_document
from tests.simulated_ranks import SAVE_ID, commit, part_document, plan_ranks, save_as_ranks, write_ranks
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

CONFIG = {"events": {"log": False}}


class _Mesh:
    """The parts of a DeviceMesh that placement math reads: its shape, this rank's coordinate."""

    def __init__(self, shape: tuple[int, ...], coordinate: tuple[int, ...]) -> None:
        self.shape, self._coordinate = shape, list(coordinate)

    def get_coordinate(self) -> list[int]:
        return self._coordinate

    def size(self, dim: int) -> int:
        return self.shape[dim]

    def _is_current_rank_part_of_mesh(self) -> bool:
        return True

    def _sym_get_coordinate(self, dim: int) -> int:
        return self._coordinate[dim]


def _torch_local(full: torch.Tensor, mesh: tuple[int, ...], coordinate: tuple[int, ...], placements: list[Any]) -> Any:
    """The local shard as torch lays the data out (what ``distribute_tensor`` does: each
    sharding placement's own split, in mesh order)."""
    local = full
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard() or isinstance(placement, _StridedShard):
            pieces, _ = placement._split_tensor(local, mesh[mesh_dim], with_padding=False)
            index = coordinate[mesh_dim]
            local = pieces[index] if index < len(pieces) else local.narrow(placement.dim, 0, 0)
    return local


LAYOUTS = [
    ((8, 3), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP2 over colwise TP
    ((11, 5), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # ... uneven
    ((7, 10), (2, 2), [Shard(0), Shard(1)]),  # FSDP2 over rowwise TP
    ((9, 4), (2, 2), [Shard(0), Shard(0)]),  # two mesh dims cut one tensor dim
    ((6, 9), (2, 3), [_StridedShard(1, split_factor=3), Shard(1)]),
    ((7, 10, 4), (2, 2, 2), [Shard(1), _StridedShard(0, split_factor=2), Shard(0)]),  # a 3-D mesh
    ((8, 6), (2, 2, 2), [Replicate(), _StridedShard(0, split_factor=2), Shard(0)]),  # HSDP over TP
    ((8, 3), (2, 2), [Shard(0), _StridedShard(0, split_factor=2)]),  # several stretches per rank
    ((5,), (4,), [_StridedShard(0, split_factor=2)]),  # ... and empty shards
    ((3, 2), (4,), [Shard(0)]),  # fewer rows than ranks
]


@pytest.mark.parametrize(("shape", "mesh", "placements"), LAYOUTS)
def test_local_boxes_hold_what_torch_puts_in_each_local_shard(
    shape: tuple[int, ...], mesh: tuple[int, ...], placements: list[Any]
) -> None:
    from aiosnap.format.tiling import check_tiling

    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    boxes = []
    for coordinate in itertools.product(*(range(m) for m in mesh)):
        local = _torch_local(full, mesh, coordinate, placements)
        found = local_boxes(shape, _Mesh(mesh, coordinate), placements, "w")
        assert sum(b.view(local).numel() for b in found) == local.numel()
        for box in found:
            expected = full
            for dim, (offset, size) in enumerate(zip(box.offsets, box.shape, strict=True)):
                expected = expected.narrow(dim, offset, size)
            assert torch.equal(box.view(local), expected), (coordinate, box)
            replicated = any(p.is_replicate() and coordinate[d] for d, p in enumerate(placements))
            if not replicated:
                boxes.append((box.offsets, box.shape))
    check_tiling(list(shape), boxes)  # the ranks' boxes (one replica) tile the tensor exactly


def test_partial_placements_are_refused_by_name() -> None:
    from torch.distributed.tensor import Partial

    with pytest.raises(AiosnapError, match="layer.w: a DTensor with a Partial placement"):
        local_boxes((4,), _Mesh((2,), (0,)), [Partial()], "layer.w")


def _writers(manifest: Any, path: str) -> set[int]:
    entry = next(e for e in manifest.entries if e.path == path)
    ranges = entry.ranges or [r for shard in entry.shards for r in shard[2]]
    return {int(getattr(r, "object", r[0] if isinstance(r, tuple) else "").split("/")[2][5:]) for r in ranges}


def _load(root: Path, **kwargs: Any) -> Any:
    with SyncCheckpointer({"storage": {"url": str(root)}, **CONFIG}) as ckpt:
        return ckpt.load(**kwargs)


def test_pipeline_stages_save_the_union_and_a_tied_weight_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    embed = torch.randn(16, 4)
    layers = [torch.randn(4, 4) for _ in range(4)]
    stage0 = {"model": {"embed.weight": embed, "layers.0.w": layers[0], "layers.1.w": layers[1]}, "step": 9}
    stage1 = {"model": {"embed.weight": embed.clone(), "layers.2.w": layers[2], "layers.3.w": layers[3]}, "step": 9}
    manifest = save_as_ranks(tmp_path, [stage0, stage1])
    paths = [e.path for e in manifest.entries]
    assert sorted(paths) == sorted({f"model/{k}" for s in (stage0, stage1) for k in s["model"]})  # each once
    assert _writers(manifest, "model/embed.weight") == {0}  # both stages wrote it: the lowest rank's copy kept
    assert _writers(manifest, "model/layers.3.w") == {1}
    loaded = _load(tmp_path)
    assert loaded["step"] == 9 and list(loaded["model"]) == [*stage0["model"], "layers.2.w", "layers.3.w"]
    for name, value in {**stage1["model"], **stage0["model"]}.items():
        assert torch.equal(loaded["model"][name], value), name
    stage = {"model": {"layers.2.w": torch.zeros(4, 4), "embed.weight": torch.zeros(16, 4)}}
    with SyncCheckpointer({"storage": {"url": str(tmp_path)}, **CONFIG}) as ckpt:
        ckpt.load(stage)  # another split: a stage takes its own keys
    assert torch.equal(stage["model"]["layers.2.w"], layers[2]) and torch.equal(stage["model"]["embed.weight"], embed)


def test_a_weight_tied_under_another_name_is_stored_once(tmp_path: Path) -> None:
    """Rank 0 holds the embedding at two keys (one tensor, tied); the last stage holds its own
    copy at the output head's key: the union names rank 0's entry at both keys."""
    embed = torch.arange(12.0).reshape(3, 4)
    first = {"embed": embed, "head": embed, "a": torch.ones(2)}
    last = {"head": embed.clone(), "b": torch.zeros(2)}
    manifest = save_as_ranks(tmp_path, [first, last])
    assert sorted(e.path for e in manifest.entries) == ["a", "b", "embed"]
    loaded = _load(tmp_path)
    assert torch.equal(loaded["head"], embed) and torch.equal(loaded["embed"], embed) and set(loaded) == {
        "embed", "head", "a", "b",
    }  # fmt: skip


def test_plain_values_held_by_several_ranks_are_the_lowest_ranks(tmp_path: Path) -> None:
    from fractions import Fraction

    states = [
        {"lr": 0.1, "sched": {"epoch": 3, "seen": [1, 2]}, "w": torch.ones(3), "obj": 5},
        {
            "lr": 0.2,
            "sched": {"epoch": 3, "seen": [1, 2, 3]},
            "only_here": "x",
            "w": torch.ones(3),
            "obj": Fraction(1, 3),
        },
        {"lr": 0.3, "sched": {"epoch": 4}, "w": torch.ones(3), "extra": torch.full((2,), 7.0), "pick": Fraction(2, 3)},
        {"lr": 0.4, "w": torch.ones(3), "pick": Fraction(3, 4)},
    ]
    manifest = save_as_ranks(tmp_path, states)
    loaded = _load(tmp_path, allow_pickle=True)
    assert loaded["lr"] == 0.1 and loaded["sched"] == {"epoch": 3, "seen": [1, 2]} and loaded["only_here"] == "x"
    assert torch.equal(loaded["extra"], torch.full((2,), 7.0))
    assert loaded["obj"] == 5 and loaded["pick"] == Fraction(2, 3)  # pickled objects too: the lowest rank's
    assert [e.path for e in manifest.entries if e.kind == "pickle"] == ["pick"]  # rank 1's "obj" left out


def test_a_key_only_one_rank_holds_costs_the_others_nothing(tmp_path: Path) -> None:
    """Four data-parallel ranks; rank 2 holds one key more. Only the entries of that key's
    bucket are written twice (by rank 2, and by one rank of the others); every other entry is
    written once, spread over the four ranks."""
    model = {f"layers.{i}.{kind}": torch.full((64,), float(i)) for i in range(8) for kind in ("w", "b", "norm")}
    states = [{"model": dict(model), "step": 1} for _ in range(4)]
    states[2]["probe"] = torch.arange(5.0)
    plans = plan_ranks(states)
    written = [sum(plan.entries[i].nbytes for i in plan.spec.distributed.written) for plan in plans]  # type: ignore[union-attr]
    total = sum(t.nbytes for t in model.values()) + 20
    assert total <= sum(written) < total * 1.5  # not a second copy of the model
    assert all(w > 0 for w in written)
    manifest = commit(tmp_path, plans, write_ranks(tmp_path, plans))
    assert _writers(manifest, "probe") == {2}
    assert torch.equal(_load(tmp_path)["probe"], torch.arange(5.0))


def test_replicas_of_each_stage_split_its_entries(tmp_path: Path) -> None:
    """Pipeline stages with data-parallel replicas (ranks 0 and 1 stage 0, 2 and 3 stage 1):
    each stage's entries are written once, by its two replicas in turn."""
    stages = [{f"layers.{s * 4 + i}.w": torch.full((128,), float(s * 4 + i)) for i in range(4)} for s in (0, 1)]
    states = [{"model": stages[rank // 2]} for rank in range(4)]
    plans = plan_ranks(states)
    for plan in plans:
        assert plan.spec.distributed is not None and len(plan.spec.distributed.written) == 2
    manifest = commit(tmp_path, plans, write_ranks(tmp_path, plans))
    assert {r for e in manifest.entries for r in _writers(manifest, e.path)} == {0, 1, 2, 3}
    assert len(manifest.entries) == 8


@pytest.mark.parametrize(
    ("second", "named"),
    [
        (
            {"model": {"a": torch.zeros(4), "b": torch.zeros(5)}},
            "'model/b' as float32 (5,) where rank 0 holds float32 (3,)",
        ),
        ({"model": {"a": torch.zeros(4), "b": torch.zeros(3, dtype=torch.int64)}}, "int64 (3,)"),
        ({"model": {"a": torch.zeros(4), "b": 3}}, "'model/b': rank 1 holds a plain value where rank 0 holds a tensor"),
    ],
)
def test_ranks_holding_one_key_in_two_layouts_all_raise(tmp_path: Path, second: dict[str, Any], named: str) -> None:
    first = {"model": {"a": torch.zeros(4), "b": torch.zeros(3)}}
    with pytest.raises(RanksDisagreeError, match=named.replace("(", r"\(").replace(")", r"\)")):
        save_as_ranks(tmp_path, [first, second])


def test_the_union_of_trees_merges_dicts_lists_and_statefuls() -> None:
    union = TreeUnion(lambda a, b: None)
    union.add(0, {"t": "dict", "items": [["a", 1], ["s", {"t": "stateful", "v": {"t": "dict", "items": [["x", 1]]}}]]})
    union.add(1, {"t": "dict", "items": [["s", {"t": "stateful", "v": {"t": "dict", "items": [["y", 2]]}}], ["b", 2]]})
    union.add(2, {"t": "dict", "items": [["a", 5], ["l", {"t": "list", "items": [{"t": "tensor", "id": 0}]}]]})
    union.add(3, {"t": "dict", "items": [["l", {"t": "list", "items": [{"t": "tensor", "id": 0}]}]]})
    stateful = {"t": "stateful", "v": {"t": "dict", "items": [["x", 1], ["y", 2]]}}
    listed = {"t": "list", "items": [{"t": "tensor", "id": 0}]}
    assert union.tree == {"t": "dict", "items": [["a", 1], ["s", stateful], ["b", 2], ["l", listed]]}
    with pytest.raises(RanksDisagreeError, match="'l': rank 4 holds a list of 2 item"):
        union.add(4, {"t": "dict", "items": [["l", {"t": "list", "items": [1, 2]}]]})


def _resign(doc: dict[str, Any]) -> bytes:
    body = json.dumps(doc).encode()
    return body[:-1] + b',"crc32c":%d}' % crc32c.crc32c(body)


def _gather(root: Path, plans: list[Any], own: Any) -> Any:
    async def run() -> Any:
        storage = LocalStorage(str(root))
        try:
            return await gather_manifest(storage, plans[0].spec, own, DistributedConfig())
        finally:
            await storage.close()

    return asyncio.run(run())


def _stages() -> list[dict[str, Any]]:
    shared = torch.arange(6.0)
    last = {"shared": shared, "layers.1.w": torch.ones(3, 2), "layers.1.b": torch.zeros(3, 2)}
    return [
        {"model": {"shared": shared, "layers.0.w": torch.ones(3, 2)}, "step": 2},
        {"model": last, "step": 2},
        {"model": dict(last), "step": 2},  # a replica of rank 1: they write one layer each
    ]


def _forge(root: Path, rank: int, change: Any) -> None:
    doc = part_document(root, rank)
    change(doc)
    (root / part_name(1, SAVE_ID, rank)).write_bytes(_resign(doc))


FORGERIES = {
    "a key nobody wrote": (2, lambda d: d["written"].clear(), "written by no rank"),
    "a key its group wrote already": (
        2, lambda d: d.update(written=d["written"] + [{**d["written"][0], "entry": 3 - d["written"][0]["entry"]}]),
        "written twice",
    ),
    "a table it does not hold": (2, lambda d: d.update(table_of=0), "not that of its class"),
    "a leader that ships no table": (1, lambda d: d.update(table=None, tree=None), "ships its table"),
    "a tree naming a missing entry": (
        1, lambda d: d["tree"]["items"].append(["x", {"t": "tensor", "id": 99}]), "names no entry",
    ),
    "a leader's tree leaving out a key of its table": (1, lambda d: _drop_key(d, "layers.1.b"), "no node of the tree"),
    "a leader's table and tree both leaving out a key": (
        1, lambda d: _drop_key(d, "layers.1.b", table=True), "not of the class it announced",
    ),
    "a part claiming another class": (2, lambda d: d.update(class_digest="0" * 32), "claims a class other"),
    "a part claiming other buckets": (
        2, lambda d: d.update(buckets=[b + 1 if b else 0 for b in d["buckets"]]), "does not hold the table",
    ),
    "a checksum left out": (2, lambda d: d["checksums"].clear(), "ships no checksum of"),
    "a checksum of a value it wrote": (
        2, lambda d: d["checksums"].append({"entry": d["written"][0]["entry"], "crc32c": 1}), "twice, or written",
    ),
    "a dict with one key twice": (
        1, lambda d: d["tree"]["items"].append(d["tree"]["items"][-1]), "the key 'step' twice",
    ),
}  # fmt: skip


def _drop_key(doc: dict[str, Any], name: str, table: bool = False) -> None:
    """Take ``model/<name>`` out of a leader's tree (and, with ``table``, out of its table,
    the other entries renumbered): what a forged or buggy leader could ship."""
    model = next(v for k, v in doc["tree"]["items"] if k == "model")
    dropped = next(v["id"] for k, v in model["items"] if k == name)
    model["items"] = [[k, v] for k, v in model["items"] if k != name]
    if table:
        del doc["table"][dropped]
        doc["main_entries"] -= 1
        for _, v in model["items"]:
            v["id"] -= v["id"] > dropped
        for field in ("written", "checksums"):
            doc[field] = [r for r in doc[field] if r["entry"] != dropped]
            for record in doc[field]:
                record["entry"] -= record["entry"] > dropped


@pytest.mark.parametrize("case", sorted(FORGERIES))
def test_forged_parts_are_refused(tmp_path: Path, case: str) -> None:
    rank, change, problem = FORGERIES[case]
    plans = plan_ranks(_stages())
    own = write_ranks(tmp_path, plans)
    _forge(tmp_path, rank, change)
    with pytest.raises(CorruptCheckpointError, match=problem):
        _gather(tmp_path, plans, own)


def test_parts_forging_overlapping_shards_are_refused() -> None:
    from aiosnap.format.merge import merge_parts
    from aiosnap.format.parts import build_part
    from tests.test_distributed_units import _crcs, _spec

    specs = [_spec(0, (0, 1)), _spec(1, (1,))]
    parts = {s.rank: build_part(s, _crcs(s)) for s in specs}
    overlapping = parts[1].model_copy(
        update={"written": [parts[1].written[0].model_copy(update={"offsets": [1, 0]})]}
    )  # rows 1-2 where rank 0 wrote rows 0-1
    with pytest.raises(ValueError, match="overlapping|gap"):
        merge_parts(specs[0], {0: parts[0], 1: overlapping})


def test_fuzzed_parts_fail_cleanly(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Forged parts of ranks holding different keys (checksums recomputed): the merge
    commits a manifest a reader accepts, or raises an AiosnapError; never another error."""
    plans = plan_ranks(_stages())
    own = write_ranks(tmp_path, plans)
    honest = {rank: part_document(tmp_path, rank) for rank in (1, 2)}
    rng = random.Random(21)
    outcomes: dict[str, int] = {}
    for case in range(max(8, int(request.config.getoption("--fuzz-cases")) // 4)):
        rank = 1 + case % 2
        (tmp_path / part_name(1, SAVE_ID, rank)).write_bytes(_resign(mutate_document(honest[rank], rng)))
        try:
            manifest = _gather(tmp_path, plans, own)
            manifest.from_json(manifest.to_json(), "merged")
            outcomes["merged"] = outcomes.get("merged", 0) + 1
        except AiosnapError as exc:
            outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
        (tmp_path / part_name(1, SAVE_ID, rank)).write_bytes(_resign(honest[rank]))
    assert outcomes.get("merged", 0) < sum(outcomes.values())
    print(f"\nfuzzed parts: {dict(sorted(outcomes.items()))}")


@pytest.mark.parametrize(
    ("recorded", "raised"),
    [("RanksDisagreeError", RanksDisagreeError), ("CorruptCheckpointError", CorruptCheckpointError),
     ("ManifestError", CorruptCheckpointError), ("OSError", AiosnapError)],
)  # fmt: skip
def test_every_rank_raises_the_merges_verdict_with_its_type(tmp_path: Path, recorded: str, raised: type) -> None:
    """The coordinator's merge fails (ranks disagree, a part is forged): it records why in the
    save's ``abort`` verdict, and every other rank raises the same type at ``wait()``."""
    from aiosnap.config import DistributedConfig
    from aiosnap.errors import RankFailedError
    from aiosnap.format.markers import Verdict, verdict_name
    from aiosnap.transfer.rank_wait import wait_for_commit

    plans = plan_ranks(_stages())
    spec = plans[1].spec
    verdict = Verdict(verdict="abort", save_id=SAVE_ID, rank=0, error=recorded,
                      message="step 1: 'model/b': rank 1 holds float32 (5,)")  # fmt: skip
    (tmp_path / verdict_name(1, SAVE_ID)).parent.mkdir(parents=True)
    (tmp_path / verdict_name(1, SAVE_ID)).write_bytes(verdict.to_json())

    async def wait() -> None:
        storage = LocalStorage(str(tmp_path))
        try:
            await wait_for_commit(storage, spec, DistributedConfig(heartbeat_interval=0.05, heartbeat_timeout=0.5))
        finally:
            await storage.close()

    with pytest.raises(raised, match="rank 1 holds float32") as caught:
        asyncio.run(wait())
    assert isinstance(caught.value, RankFailedError) == (recorded == "OSError")
