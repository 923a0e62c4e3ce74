"""Multi-rank checkpoints on torch.distributed (gloo, real processes; see dist_child.py).

Each test runs 1, 2 or 4 ranks as separate processes on free ports, each job under a
deadline after which every rank is killed (:mod:`dist_launch`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import SyncCheckpointer
from aiosnap.errors import StateMismatchError
from dist_child import arange
from dist_launch import ok, run_ranks

pytestmark = pytest.mark.timeout(90)

LAYOUTS_4 = {
    "rows": [[8, 6], [4], ["S0"]],
    "cols": [[5, 8], [4], ["S1"]],
    "uneven": [[7, 3], [4], ["S0"]],
    "tiny": [[2], [4], ["S0"]],  # fewer rows than ranks: empty shards
    "hsdp": [[6, 4], [2, 2], ["R", "S0"]],
    "grid": [[6, 10], [2, 2], ["S0", "S1"]],
    "replicated": [[3, 3], [4], ["R"]],
}
LAYOUTS_2 = {
    "rows": [[8, 6], [2], ["S1"]],
    "cols": [[5, 8], [2], ["S0"]],
    "uneven": [[7, 3], [2], ["R"]],
    "tiny": [[2], [2], ["S0"]],
    "hsdp": [[6, 4], [2], ["S1"]],
    "grid": [[6, 10], [2], ["S0"]],
    "replicated": [[3, 3], [2], ["S0"]],
}


def expected_full(layouts: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {name: arange(shape, base=1000.0 * i) for i, (name, (shape, _, _)) in enumerate(sorted(layouts.items()))}


def manifest(root: Path) -> dict[str, Any]:
    found = sorted(root.glob("*/manifest.json"))
    return json.loads(found[-1].read_text())


def test_replicated_model_optimizer_and_per_rank_rng_round_trip(tmp_path: Path) -> None:
    root = tmp_path / "root"
    results = ok(run_ranks("ddp_roundtrip", 2, tmp_path / "job", root=str(root)), tmp_path / "job")
    for rank, result in enumerate(results):
        assert result["committed"] == 7
        assert result["same_model"] and result["same_optim"]
        assert result["position"] == 10 * rank  # rank-local values go back to their own rank
        assert result["rng_restored"]
    doc = manifest(root)
    assert doc["world_size"] == 2 and len(doc["rank_local"]) == 2
    stored = sum(e["nbytes"] for e in doc["entries"])
    written = {r: sum(o["nbytes"] for o in doc["objects"] if o["rank"] == r) for r in (0, 1)}
    # every replicated entry once, by one rank; the two ranks' shares balanced
    writers = [{r["object"].split("/")[2] for r in e["ranges"]} for e in doc["entries"] if e["nbytes"]]
    assert all(len(w) == 1 for w in writers)
    assert stored <= sum(written.values()) < stored + 64 * len(doc["entries"]) + 2 * 8192
    largest = max(e["nbytes"] for e in doc["entries"])
    assert abs(results[0]["nbytes"] - results[1]["nbytes"]) <= largest


@pytest.fixture(scope="module")
def saved_by_4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("saved4")
    ok(run_ranks("save_dtensors", 4, work / "job", root=str(work / "root"), layouts=LAYOUTS_4), work / "job")
    return work / "root"


def test_sharded_checkpoint_loads_as_full_tensors_in_one_process(saved_by_4: Path) -> None:
    doc = manifest(saved_by_4)
    kinds = {e["path"]: e["kind"] for e in doc["entries"]}
    assert {kinds[f"dt/{n}"] for n in LAYOUTS_4} == {"sharded"} and kinds["plain"] == "tensor"
    hsdp = next(e for e in doc["entries"] if e["path"] == "dt/hsdp")
    assert len(hsdp["shards"]) == 2  # two replicas of each shard: stored once
    with SyncCheckpointer(str(saved_by_4)) as ckpt:
        loaded = ckpt.load()
    for name, full in expected_full(LAYOUTS_4).items():
        assert torch.equal(loaded["dt"][name], full), name
    assert torch.equal(loaded["plain"], arange([5, 3], base=-50.0))


@pytest.mark.parametrize(("world", "layouts"), [(2, LAYOUTS_2), (1, {k: [s, [1], ["S0"]] for k, (s, _, _) in LAYOUTS_4.items()})])
def test_reshard_4_to_fewer_ranks(saved_by_4: Path, tmp_path: Path, world: int, layouts: dict[str, Any]) -> None:
    results = ok(
        run_ranks("load_dtensors", world, tmp_path, root=str(saved_by_4), layouts=layouts),
        tmp_path,
    )
    for result in results:
        assert all(result["equal"].values()), result["equal"]
        assert result["plain"] and result["in_place"]


def test_reshard_2_to_4_reads_only_overlapping_bytes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ok(run_ranks("save_dtensors", 2, tmp_path / "save", root=str(root), layouts=LAYOUTS_2), tmp_path / "save")
    results = ok(
        run_ranks("load_dtensors", 4, tmp_path / "load", root=str(root), layouts=LAYOUTS_4),
        tmp_path / "load",
    )
    for result in results:
        assert all(result["equal"].values()), result["equal"]
        assert result["in_place"]
    total = sum(e["nbytes"] for e in manifest(root)["entries"])
    # each rank reads what its shards need (whole saved ranges: 1 MiB chunks hold several
    # entries, so a range may carry more than the overlap), far less than everything each
    assert max(r["read_bytes"] for r in results) < total


def test_rank_local_values_need_the_same_world_size(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ok(run_ranks("ddp_roundtrip", 2, tmp_path / "job", root=str(root)), tmp_path / "job")
    with SyncCheckpointer({"storage": {"url": str(root)}}) as ckpt:
        with pytest.raises(StateMismatchError, match="rank-local values .* 2 ranks.*skip_rank_local"):
            ckpt.load()
        loaded = ckpt.load(skip_rank_local=True)
        assert "rng" not in loaded and "loader" not in loaded and loaded["epoch"] == 3
        assert set(loaded["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        target = {"epoch": 0, "loader": {"position": -5}}
        ckpt.load(target, skip_rank_local=True)
        assert target == {"epoch": 3, "loader": {"position": -5}}


def test_fsdp2_resumed_training_matches_uninterrupted(tmp_path: Path) -> None:
    results = ok(run_ranks("fsdp_resume", 2, tmp_path / "job", root=str(tmp_path / "root")), tmp_path / "job")
    for result in results:
        assert result["resumed"] == result["uninterrupted"]
    assert results[0]["uninterrupted"] != results[1]["uninterrupted"]  # ranks had their own batches
