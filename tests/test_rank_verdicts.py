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


def _expected(step: int) -> dict[str, torch.Tensor]:
    from dist_verdicts import _state

    return _state(step, 0)


def _all_load(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["loads"] and all(result["loads"].values()), (rank, result["loads"])


def test_a_slow_coordinator_and_quick_retention_leave_one_verdict(tmp_path: Path) -> None:
    root = tmp_path / "root"
    results = ok(
        run_ranks(
            "slow_coordinator_and_retention", 2, tmp_path / "job", timeout=100, root=str(root),
            commit_timeout=3.0, coordinator_delay=9.5, retention_delay=TIMERS["heartbeat_timeout"] + 3, timers=TIMERS,
        ),
        tmp_path / "job",
    )  # fmt: skip
    for rank, result in enumerate(results):
        # before: rank 1 waited commit_timeout + 5 s after its part for steps 1 (removed by
        # the coordinator's retention before it looked) and 10 (the coordinator still
        # uploading), raised RankTimeoutError, and the steps committed anyway
        # step 21: before, rank 1 took the coordinator, still removing step 11 (retention)
        # before its save of step 21 could begin, for stopped, and gave step 21 up
        for step in ("1", "2", "3", "4", "10", "11", "20", "21"):
            assert result[step][0] == "committed", (rank, step, result[step])
        assert result["steps"] == [21]
    _all_load(results)


@pytest.mark.parametrize(("victim", "how"), [(1, "stop"), (0, "kill")])
def test_a_rank_killed_or_wedged_after_save_is_named_within_seconds(tmp_path: Path, victim: int, how: str) -> None:
    root = tmp_path / "root"
    results = run_ranks(
        "vanish_after_save", 2, tmp_path / "job", root=str(root), victim=victim, how=how, commit_timeout=60.0,
        wait=40, timers=TIMERS, hard_exit=True,
    )  # fmt: skip
    assert results[victim] == {"exit": -9 if how == "stop" else 9}
    survivor = ok([results[1 - victim]], tmp_path / "job")[0]
    outcome, seconds = survivor["2"]
    # before: the survivor heard nothing until commit_timeout (60 s here, 600 s by default)
    assert outcome.startswith(("RankTimeoutError", "RankFailedError")), outcome
    assert f"rank(s) [{victim}]" in outcome or f"rank {victim}" in outcome, outcome
    assert "heartbeat" in outcome, outcome
    assert seconds < NAMED_WITHIN, f"named after {seconds:.1f} s"
    print(f"\nrank {victim} {how} after save(): rank {1 - victim} named it after {seconds:.2f} s")
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
    # step 6: close(timeout=1) on the follower whose helper wedged after its part, the
    # coordinator slow: close is bounded (timeout + abort grace 2 s + 1 s look), and says the
    # save may still be committed; it is (before: close waited for the coordinator, 40 s in
    # the review, raised "did not commit", and the handle then said committed)
    closed, seconds = follower["close"]
    assert closed.startswith("TimeoutError") and "may still be committed" in closed, closed
    assert seconds < 1 + 2 + 1 + 2.5, f"close(timeout=1) took {seconds:.1f} s"
    assert follower["6"][0].startswith("RankTimeoutError") and "may still be committed" in follower["6"][0]
    assert coordinator["6"][0] == "committed", coordinator["6"]
    with SyncCheckpointer(str(root)) as ckpt:
        loaded = ckpt.load(step=6, skip_rank_local=True)
    assert torch.equal(loaded["w"], _expected(6)["w"]) and torch.equal(loaded["v"], _expected(6)["v"])


@pytest.fixture(scope="module")
def local_faults(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One launch of ranks for two scenarios on local disk (dist_verdicts.local_faults): ranks
    given one spool.dir, then a load racing another job's re-save of step 5 (version A is the
    latest when the ranks start; version B lands between rank 0's read and rank 1's); then gc
    and a deletion behind the coordinator's back during saves."""
    work = tmp_path_factory.mktemp("local_faults")
    root = work / "root"
    a, b = torch.arange(64, dtype=torch.float32), torch.arange(64, dtype=torch.float32) + 1000
    with SyncCheckpointer({"storage": {"url": str(root)}, "events": {"log": False}}) as ckpt:
        ckpt.save({"w": a}, step=5).wait(30)
        attempt_a = next(p for p in (root / "000000000005").iterdir() if p.is_dir())
        shutil.copytree(attempt_a, work / "attempt-a")
        manifest_a = (root / "000000000005" / "manifest.json").read_bytes()
        ckpt.save({"w": b}, step=5).wait(30)  # a re-save: replaces the manifest, removes attempt A
    (work / "next.json").write_bytes((root / "000000000005" / "manifest.json").read_bytes())
    shutil.copytree(work / "attempt-a", attempt_a)
    (root / "000000000005" / "manifest.json").write_bytes(manifest_a)  # version A is the latest again
    return ok(
        run_ranks(
            "local_faults", 2, work / "job", timeout=100, root=str(root), gc_root=str(work / "gc-root"),
            agree_timeout=20.0, next_manifest=str(work / "next.json"), commit_timeout=30.0, timers=TIMERS,
            stall_root=str(work / "stall-root"),
        ),
        work / "job",
    )  # fmt: skip


def test_gc_leaves_a_live_save_alone_and_a_commit_checks_its_objects(local_faults: list[dict[str, Any]]) -> None:
    results = [result["gc"] for result in local_faults]
    coordinator, follower = results
    # before: gc --grace 0 removed the live attempt, which then committed and did not load
    assert follower["gc_removed"] == [], follower["gc_removed"]
    assert coordinator["1"][0] == "committed" and follower["1"][0] == "committed"
    # an object deleted behind the coordinator's back: nothing is committed, every rank says why
    deleted = follower["deleted"]
    for result in results:
        assert result["2"][0].startswith("RankFailedError") and deleted in result["2"][0], result["2"]
        assert result["steps"] == [1]
    # a part that cannot be written is told at once (before: only when its heartbeat ran out)
    assert follower["3"][0].startswith("OSError"), follower["3"]
    assert coordinator["3"][0].startswith("RankFailedError") and "OSError" in coordinator["3"][0], coordinator["3"]
    assert coordinator["3"][1] < TIMERS["heartbeat_timeout"], coordinator["3"]
    _all_load(results)


def test_ranks_sharing_a_spool_fail_at_once_and_a_load_agrees_on_the_save_id(
    local_faults: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(result["load"] for result in local_faults):
        # before: one rank took the lock and went on; the other raised; the next save or
        # load then hung for agree_timeout
        outcome, seconds = result["shared_spool"]
        assert outcome.startswith("SpoolBusyError") and "each rank needs its own" in outcome, (rank, outcome)
        assert "[0, 1]" in outcome and seconds < 15, (rank, outcome, seconds)
        # before: rank 0 loaded version A (0.0), rank 1 version B (1000.0)
        assert result["load"] == 1000.0, (rank, result["load"])


def test_a_coordinator_stalled_after_its_claim_and_a_failed_lookup_leave_one_verdict(
    local_faults: list[dict[str, Any]],
) -> None:
    results = [result["stall"] for result in local_faults]
    coordinator, follower = results
    # before: the follower took the stalled coordinator (claim landed, heartbeat silent for
    # heartbeat_timeout) for undecided and raised RankTimeoutError; the coordinator committed
    for rank, result in enumerate(results):
        assert result["1"][0] == "committed" and result["2"][0] == "committed", (rank, result["2"])
        assert result["steps"] == [1, 2]
    assert follower["2"][1] > TIMERS["heartbeat_timeout"], "the stall outlasted the heartbeat timeout"
    # rank 0's lookup of the latest step failed: it raises its error, rank 1 hears at once
    # (before: rank 1 waited agree_timeout, 20 s, for an agreement rank 0 never joined)
    assert coordinator["lookup"][0].startswith("OSError"), coordinator["lookup"]
    assert follower["lookup"][0].startswith("RankFailedError") and "rank 0" in follower["lookup"][0]
    assert follower["lookup"][1] < 10, follower["lookup"]
    _all_load(results)


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


# --- the parts, one process: heartbeats, the verdict, gc, untrusted markers -------------------------------------


def _spec(root: Path, rank: int = 0, step: int = 3) -> Any:
    from aiosnap.format.spec import DistSpec, SaveSpec

    return SaveSpec(
        step=step, save_id="00000000000000a1", rank=rank, world_size=2, tree={"t": "dict", "items": []},
        metadata={}, entries=(), chunks=(), distributed=DistSpec(0, 60.0, 0, (), (), ()),
    )  # fmt: skip


QUICK = {"heartbeat_interval": 0.05, "heartbeat_timeout": 0.5}


def _files(folder: Path, pattern: str) -> list[Path]:
    return [p for p in folder.rglob(pattern) if p.is_file()]


async def test_a_heartbeat_keeps_its_rank_alive_and_its_end_is_seen(tmp_path: Path) -> None:
    import asyncio
    import time

    from aiosnap.config import DistributedConfig
    from aiosnap.storage.local import LocalStorage
    from aiosnap.transfer.heartbeat import Heartbeat, PeerWatch

    storage, timers = LocalStorage(tmp_path), DistributedConfig(**QUICK)
    beat = Heartbeat(storage, _spec(tmp_path, rank=1), timers)
    watch = PeerWatch(storage, _spec(tmp_path, rank=0), timers)
    beat.start()
    deadline = time.monotonic() + 2.0  # four timeouts: a live rank is never taken for stopped
    while time.monotonic() < deadline:
        assert await watch.stopped([1]) in (None, [])
        await asyncio.sleep(0.02)
    assert watch.phase(1) == "uploading"
    await beat.stop()
    assert not _files(tmp_path, "*.alive"), "the heartbeat object goes with its rank"
    started = time.monotonic()
    while not await watch.stopped([1]):
        assert time.monotonic() - started < 10
        await asyncio.sleep(0.02)
    # counted from the last beat the watch saw (a loaded machine may have seen it a little before stop())
    assert QUICK["heartbeat_timeout"] / 2 <= time.monotonic() - started < 5
    # a rank that never started is named too, counting from the first look
    fresh = PeerWatch(storage, _spec(tmp_path, rank=0), timers)
    started = time.monotonic()
    while not await fresh.stopped([1]):
        assert time.monotonic() - started < 10
        await asyncio.sleep(0.02)
    assert time.monotonic() - started >= QUICK["heartbeat_timeout"]


@pytest.mark.parametrize("where", ["local", "s3"])
async def test_one_verdict_wins_of_a_commit_claim_and_an_abort(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    import asyncio

    from aiosnap.storage.local import LocalStorage
    from aiosnap.transfer.verdict import claim_verdict, overrule_commit, read_verdict

    if where == "s3":
        from aiosnap.storage.registry import storage_from_url
        from tests.conftest import s3_config

        endpoint, bucket = request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket")
        config = s3_config(endpoint, bucket)
        storage = storage_from_url(config.storage.url, config)
    else:
        storage = LocalStorage(tmp_path)
    try:
        for round_ in range(6):
            coordinator, follower = _spec(tmp_path, 0, step=round_), _spec(tmp_path, 1, step=round_)
            claims = [claim_verdict(storage, coordinator, "commit"), claim_verdict(storage, follower, "abort")]
            if round_ % 2:
                claims.reverse()
            first, second = await asyncio.gather(*claims)
            assert first == second, "both claimers see the same verdict"
            assert await read_verdict(storage, coordinator) == first
        # only the coordinator replaces its own commit claim (its manifest was refused)
        assert (await claim_verdict(storage, _spec(tmp_path, 0, step=99), "commit")).verdict == "commit"
        await overrule_commit(storage, _spec(tmp_path, 0, step=99), FileExistsError("another writer"))
        found = await read_verdict(storage, _spec(tmp_path, 1, step=99))
        assert found is not None and found.verdict == "abort" and "another writer" in found.reason
    finally:
        await storage.close()


async def test_gc_leaves_live_attempts_alone_whatever_the_grace(tmp_path: Path) -> None:
    import asyncio
    import os
    import time

    from aiosnap.catalog.garbage import collect_garbage
    from aiosnap.config import DistributedConfig
    from aiosnap.format.markers import heartbeat_document, heartbeat_name, verdict_name
    from aiosnap.storage.local import LocalStorage
    from aiosnap.transfer.heartbeat import Heartbeat

    storage = LocalStorage(tmp_path)
    live, dead, decided = _spec(tmp_path, step=1), _spec(tmp_path, step=2), _spec(tmp_path, step=3)
    for spec in (live, dead, decided):
        await storage.write(f"{spec.step:012d}/{spec.save_id}/rank-0/0.bin", b"x" * 100)
    beat = Heartbeat(storage, live, DistributedConfig(**QUICK))
    beat.start()
    # a rank that died: its last heartbeat, with a lease of 0.2 s, left behind
    await storage.write(heartbeat_name(dead.step, dead.save_id, 0), heartbeat_document(0, 7, "uploading", 1, 0.1, 0.2))
    await storage.write(verdict_name(decided.step, decided.save_id), b"{}")  # a verdict the ranks may still read
    old = time.time() - 3600
    for path in _files(tmp_path, "*"):
        if path.name != "verdict":
            os.utime(path, (old, old))
    await asyncio.sleep(0.3)  # the dead one's lease runs out
    beat_file = tmp_path / heartbeat_name(live.step, live.save_id, 0)
    while beat_file.stat().st_mtime < old + 60:  # noqa: ASYNC110 - the live rank beats again (late when loaded)
        await asyncio.sleep(0.02)
    report = await collect_garbage(storage, keep_last=5, grace_s=0)
    await beat.stop()
    assert report.kept_live == [f"{1:012d}/{live.save_id}", f"{3:012d}/{decided.save_id}"], report
    assert report.removed_incomplete == [f"{2:012d}/{dead.save_id}"], report
    assert (tmp_path / f"{1:012d}" / live.save_id / "rank-0" / "0.bin").exists()


def test_markers_read_back_are_untrusted_input(request: pytest.FixtureRequest) -> None:
    import random

    from aiosnap.format.markers import Verdict, heartbeat_document, heartbeat_lease, heartbeat_phase
    from tests.fuzzing import mutate_bytes, mutated_text

    rng = random.Random(20)
    heartbeat = json.loads(heartbeat_document(3, 1, "gathering", 99, 2.0, 20.0))
    verdict = json.loads(Verdict(verdict="abort", save_id="00000000000000a1", rank=1, error="E", message="m").to_json())
    assert heartbeat_lease(json.dumps(heartbeat).encode()) == 20.0 and heartbeat_phase(json.dumps(heartbeat).encode())
    cases = max(200, int(request.config.getoption("--fuzz-cases")) // 4)
    for _ in range(cases):
        for data in (mutated_text(heartbeat, rng), mutate_bytes(json.dumps(heartbeat).encode(), rng)):
            lease = heartbeat_lease(data)
            assert lease is None or 0 < lease <= 86400
            assert heartbeat_phase(data) in (None, "uploading", "gathering")
        for data in (mutated_text(verdict, rng), mutate_bytes(json.dumps(verdict).encode(), rng), b"x" * 9000):
            found = Verdict.from_json(data)
            assert found is None or found.verdict in ("commit", "abort")
