"""Safetensors with several ranks (gloo, one launch per case group): a Hugging Face folder
loads into DTensors of any placement in place, each rank reading about its own shards'
bytes, with dtype conversion; a multi-rank save exported by every rank at once is one
consolidated folder; a rank whose uploads fail fails the export everywhere, leaving nothing."""

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


def test_import_into_dtensors_and_export_from_every_rank(tmp_path: Path) -> None:
    work = tmp_path / "job"
    results = _ok(
        run_ranks(
            "import_and_export", 2, work, timeout=55, child=CHILD, layouts=LAYOUTS, convert="rows", max_shard_size=8000
        ),
        work,
    )
    for rank, result in enumerate(results):
        assert all(result["equal"].values()), (rank, result["equal"])
        assert result["in_place"] and result["converted"], rank
        # the header (a 256 KiB first read), then its own half of "rows" (twice: as float32 and as bfloat16), and the
        # small tensors whole: never the other rank's half of the large one
        assert result["read_bytes"] < 2 * 4 * 1024**2 + 512 * 1024, result
    assert all(results[0]["exported"].values()), results[0]["exported"]
    assert results[0]["files"] >= 2
    total = sum(r["export_read"] for r in results)
    assert all(0 < r["export_read"] < total for r in results)  # both ranks read, neither all of it


def test_a_rank_that_fails_fails_the_export_everywhere(tmp_path: Path) -> None:
    work = tmp_path / "job"
    results = _ok(run_ranks("export_failure", 2, work, timeout=50, child=CHILD, layouts=LAYOUTS), work)
    assert results[1]["raised"] == "OSError"
    assert results[0]["raised"] == "RankFailedError"
    assert results[0]["left"] == []
