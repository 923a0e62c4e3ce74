"""Safetensors with several ranks (gloo, two launches): a Hugging Face folder loads into
DTensors of any placement in place, each rank reading about its own shards' bytes, with
dtype conversion; a multi-rank save exported by every rank at once is one consolidated
folder; "latest" is one step and save for every rank even while a newer step commits; a
rank whose uploads fail, or that dies, fails the export everywhere, leaving nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.dist_launch import run_ranks

CHILD = Path(__file__).resolve().parent / "safetensors_child.py"
LAYOUTS = {
    "rows": [[1024, 2048], [2], ["S0"]],  # 8 MiB: two 4 MiB ranges, one a rank
    "cols": [[40, 64], [2], ["S1"]],
    "copy": [[16, 8], [2], ["R"]],
    "ints": [[30], [2], ["S0"], "int64"],
}


def _ok(results: list[dict[str, Any]], work: Path) -> list[dict[str, Any]]:
    for rank, result in enumerate(results):
        assert "ok" in result, f"rank {rank}: {result}\n" + (work / f"rank-{rank}.log").read_text()[-3000:]
    return [r["ok"] for r in results]


def _roots(tmp_path: Path) -> dict[str, str]:
    """``root`` holds step 1, ``next`` steps 1 and 2 of other values (saved by one process)."""
    import aiosnap
    import torch

    def state(value: float) -> dict[str, Any]:
        return {"model": {f"layer{i}": torch.full((256, 1024), value) for i in range(2)}}  # 1 MiB each

    for name, steps in {"root": [1], "next": [1, 2]}.items():
        with aiosnap.SyncCheckpointer({"storage": {"url": str(tmp_path / name)}, "ram_budget": "8MiB"}) as ckpt:
            for step in steps:
                ckpt.save(state(float(step)), step=step).wait()
    return {"root": str(tmp_path / "root"), "next": str(tmp_path / "next")}


def test_dtensor_imports_and_exports_by_every_rank(tmp_path: Path) -> None:
    """One launch: DTensor imports in place; an export by both ranks; an export of the
    latest step while a newer one commits; a rank whose uploads fail."""
    work = tmp_path / "job"
    results = _ok(
        run_ranks(
            "together", 2, work, timeout=55, child=CHILD, layouts=LAYOUTS, convert="rows", max_shard_size=8000,
            **_roots(tmp_path),
        ),
        work,
    )  # fmt: skip
    for rank, result in enumerate(r["import_and_export"] for r in results):
        assert all(result["equal"].values()), (rank, result["equal"])
        assert result["in_place"] and result["converted"], rank
        # the header (a 256 KiB first read), then its own half of "rows" (twice: as float32 and as bfloat16), and the
        # small tensors whole: never the other rank's half of the large one
        assert result["read_bytes"] < 2 * 4 * 1024**2 + 512 * 1024, result
    first = results[0]["import_and_export"]
    assert all(first["exported"].values()), first["exported"]
    assert first["files"] >= 2
    total = sum(r["import_and_export"]["export_read"] for r in results)
    assert all(0 < r["import_and_export"]["export_read"] < total for r in results)  # both ranks read, neither all

    latest = results[0]["latest"]
    assert latest["steps_now"] == ["000000000001", "000000000002"]  # step 2 did commit meanwhile
    assert latest["values"] == {"layer0": 1.0, "layer1": 1.0}  # and the export is step 1's, whole

    assert results[1]["failure"]["raised"] == "OSError"
    assert results[0]["failure"]["raised"] == "RankFailedError"
    assert results[0]["failure"]["left"] == []


def test_a_rank_that_dies_fails_the_export_and_leaves_nothing(tmp_path: Path) -> None:
    work = tmp_path / "job"
    results = run_ranks("killed_rank", 2, work, timeout=50, child=CHILD, root=_roots(tmp_path)["root"])
    assert "exit" in results[1], results  # killed: no result
    assert "ok" in results[0], f"{results[0]}\n" + (work / "rank-0.log").read_text()[-3000:]
    assert results[0]["ok"]["raised"] == "RankFailedError", results[0]
    assert results[0]["ok"]["left"] == [], results[0]  # uploads aborted, claim removed
