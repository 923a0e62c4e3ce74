"""One verdict per multi-rank save, told to every rank at once (real gloo ranks, upload
helpers and storage; scenarios in dist_verdicts.py).

Every way a rank, its upload helper or the coordinator can fail leaves a marker the others
read; a rank that stops is named within its heartbeat timeout, not at commit_timeout; gc
leaves a live attempt alone; the ranks of one load agree on the save id.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import SyncCheckpointer

from dist_launch import ok, run_ranks

pytestmark = pytest.mark.timeout(120)

TIMERS = {"heartbeat_interval": 0.25, "heartbeat_timeout": 3.0}
"""Short heartbeats so that these tests detect stopped ranks quickly (defaults: 2 s, 20 s)."""
NAMED_WITHIN = TIMERS["heartbeat_timeout"] + 6.0
"""A stopped rank is named by then (its heartbeat timeout, plus slack for a loaded machine)."""


def _all_load(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["loads"] and all(result["loads"].values()), (rank, result["loads"])


def test_a_slow_coordinator_and_quick_retention_leave_one_verdict(tmp_path: Path) -> None:
    root = tmp_path / "root"
    results = ok(
        run_ranks(
            "slow_coordinator_and_retention", 2, tmp_path / "job", timeout=100, root=str(root),
            commit_timeout=3.0, coordinator_delay=9.5, timers=TIMERS,
        ),
        tmp_path / "job",
    )  # fmt: skip
    for rank, result in enumerate(results):
        # before: rank 1 waited commit_timeout + 5 s after its part for steps 1 (removed by
        # the coordinator's retention before it looked) and 10 (the coordinator still
        # uploading), raised RankTimeoutError, and the steps committed anyway
        for step in ("1", "2", "3", "4", "10", "11"):
            assert result[step][0] == "committed", (rank, step, result[step])
        assert result["steps"] == [11]
    _all_load(results)


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_after_save_is_named_within_seconds(tmp_path: Path, victim: int) -> None:
    root = tmp_path / "root"
    results = run_ranks(
        "vanish_after_save", 2, tmp_path / "job", root=str(root), victim=victim, commit_timeout=60.0,
        wait=40, timers=TIMERS, hard_exit=True,
    )  # fmt: skip
    assert results[victim] == {"exit": 9}
    survivor = ok([results[1 - victim]], tmp_path / "job")[0]
    outcome, seconds = survivor["2"]
    # before: the survivor heard nothing until commit_timeout (60 s here, 600 s by default)
    assert outcome.startswith(("RankTimeoutError", "RankFailedError")), outcome
    assert f"rank(s) [{victim}]" in outcome or f"rank {victim}" in outcome, outcome
    assert "heartbeat" in outcome, outcome
    assert seconds < NAMED_WITHIN, f"named after {seconds:.1f} s"
    print(f"\nrank {victim} killed after save(): rank {1 - victim} named it after {seconds:.2f} s")
    assert survivor["steps"] == [1]
    with SyncCheckpointer(str(root)) as ckpt:
        assert ckpt.steps() == [1]
    # the killed rank's spool holds its captured part; a resume says why it is not committed
    spool = {"dir": str(tmp_path / "job" / f"spool-{victim}"), "mode": "always"}
    with SyncCheckpointer({"storage": {"url": str(root)}, "spool": spool, "events": {"log": False}}) as ckpt:
        [(_, why)] = ckpt.resume_report.discarded
        assert ckpt.steps() == [1]
    # before: "its journal cannot be trusted: ... a multi-rank save is committed by its coordinator"
    assert "cannot be trusted" not in why and f"rank {victim} of 2" in why, why


def test_an_upload_helper_dying_is_told_to_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "root"
    results = ok(
        run_ranks(
            "helper_deaths", 2, tmp_path / "job", timeout=110, root=str(root), commit_timeout=30.0, timers=TIMERS
        ),
        tmp_path / "job",
    )
    coordinator, follower = results
    # step 2: the follower's helper died before its part: it says so, the coordinator at once
    assert follower["2"][0].startswith("UploadProcessError"), follower["2"]
    assert coordinator["2"][0].startswith("RankFailedError") and "rank(s) [1]" in coordinator["2"][0]
    assert coordinator["2"][1] < NAMED_WITHIN, coordinator["2"]
    # step 3: the follower's helper died after its part landed: the step commits on both
    # (before: the follower reported UploadProcessError for a committed step)
    assert coordinator["3"][0] == "committed" and follower["3"][0] == "committed", (coordinator["3"], follower["3"])
    # step 4: the coordinator's helper died: the follower is told at once (before: it
    # waited commit_timeout + 5 s)
    assert coordinator["4"][0].startswith("UploadProcessError"), coordinator["4"]
    assert follower["4"][0].startswith("RankFailedError") and "rank 0" in follower["4"][0], follower["4"]
    assert follower["4"][1] < NAMED_WITHIN, follower["4"]
    assert coordinator["5"][0] == "committed" and follower["5"][0] == "committed"
    for result in results:
        assert result["steps"] == [1, 3, 5]
    _all_load(results)


def test_gc_leaves_a_live_save_alone_and_a_commit_checks_its_objects(tmp_path: Path) -> None:
    root = tmp_path / "root"
    results = ok(
        run_ranks("gc_during_save", 2, tmp_path / "job", root=str(root), commit_timeout=30.0, timers=TIMERS),
        tmp_path / "job",
    )
    coordinator, follower = results
    # before: gc --grace 0 removed the live attempt, which then committed and did not load
    assert follower["gc_removed"] == [], follower["gc_removed"]
    assert coordinator["1"][0] == "committed" and follower["1"][0] == "committed"
    # an object deleted behind the coordinator's back: nothing is committed, every rank says why
    deleted = follower["deleted"]
    for result in results:
        assert result["2"][0].startswith("RankFailedError") and deleted in result["2"][0], result["2"]
        assert result["steps"] == [1]
    _all_load(results)


def test_ranks_sharing_a_spool_fail_at_once_and_a_load_agrees_on_the_save_id(tmp_path: Path) -> None:
    root = tmp_path / "root"
    a, b = torch.arange(64, dtype=torch.float32), torch.arange(64, dtype=torch.float32) + 1000
    with SyncCheckpointer({"storage": {"url": str(root)}, "events": {"log": False}}) as ckpt:
        ckpt.save({"w": a}, step=5).wait(30)
        attempt_a = next(p for p in (root / "000000000005").iterdir() if p.is_dir())
        shutil.copytree(attempt_a, tmp_path / "attempt-a")
        manifest_a = (root / "000000000005" / "manifest.json").read_bytes()
        ckpt.save({"w": b}, step=5).wait(30)  # a re-save: replaces the manifest, removes attempt A
    (tmp_path / "next.json").write_bytes((root / "000000000005" / "manifest.json").read_bytes())
    shutil.copytree(tmp_path / "attempt-a", attempt_a)
    (root / "000000000005" / "manifest.json").write_bytes(manifest_a)  # version A is the latest again
    results = ok(
        run_ranks(
            "shared_spool_and_load_agreement", 2, tmp_path / "job", root=str(root), agree_timeout=20.0,
            next_manifest=str(tmp_path / "next.json"),
        ),
        tmp_path / "job",
    )  # fmt: skip
    for rank, result in enumerate(results):
        # before: one rank took the lock and went on; the other raised; the next save or
        # load then hung for agree_timeout
        outcome, seconds = result["shared_spool"]
        assert outcome.startswith("SpoolBusyError") and "each rank needs its own" in outcome, (rank, outcome)
        assert "[0, 1]" in outcome and seconds < 15, (rank, outcome, seconds)
        # before: rank 0 loaded version A (0.0), rank 1 version B (1000.0)
        assert result["load"] == 1000.0, (rank, result["load"])


def test_on_s3_the_losing_writer_tells_its_followers_at_once(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    s3 = {"endpoint_url": s3_endpoint, "addressing_style": "path", "retry_deadline": 20, "request_timeout": 10}
    with SyncCheckpointer({"storage": {"url": f"s3://{s3_bucket}/other"}, "s3": s3}) as other:
        other.save({"x": torch.ones(4)}, step=2).wait(30)
        (tmp_path / "competing.json").write_bytes(other.manifest(2).to_json())
    url = f"s3://{s3_bucket}/run"
    results = ok(
        run_ranks(
            "s3_losing_writer", 2, tmp_path / "job", root=url, s3=s3, commit_timeout=20.0, timers=TIMERS,
            competing=str(tmp_path / "competing.json"),
        ),
        tmp_path / "job",
    )  # fmt: skip
    coordinator, follower = results
    assert coordinator["1"][0] == "committed" and follower["1"][0] == "committed"
    assert coordinator["2"][0].startswith("FileExistsError"), coordinator["2"]
    # before: the follower waited commit_timeout + 5 s (on local disk it failed at once)
    assert follower["2"][0].startswith("RankFailedError"), follower["2"]
    assert follower["2"][1] < 10, follower["2"]
    for result in results:
        assert result["steps"] == [1, 2]
    _all_load(results)
    with SyncCheckpointer({"storage": {"url": url}, "s3": s3}) as ckpt:
        assert (
            json.loads(ckpt.manifest(2).to_json())["save_id"]
            == json.loads((tmp_path / "competing.json").read_bytes())["save_id"]
        )
