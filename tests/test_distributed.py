"""Multi-rank checkpoints on torch.distributed (gloo, real processes; see dist_child.py).

Each test runs 1, 2 or 4 ranks as separate processes on free ports, each job under a
deadline after which every rank is killed (:mod:`dist_launch`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import aiosnap
import pytest
import torch
from aiosnap import AiosnapError, CorruptCheckpointError, SyncCheckpointer
from aiosnap.errors import StateMismatchError
from aiosnap.load import fetch
from tests.conftest import assert_same
from tests.fuzzing import mutate_document, mutated_text, sign_manifest

from dist_child import arange, expected_of
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
    "strided": [[8, 6], [2, 2], ["SS0:2", "S0"]],  # FSDP2 over column-wise TP
    "stretches": [[8, 6], [2, 2], ["S1", "SS0:2"]],  # each rank holds two stretches of rows
    "mesh3d": [[8, 6], [2, 1, 2], ["R", "SS0:2", "S0"]],  # HSDP over TP on a 3-D mesh
}
LAYOUTS_2 = {
    "rows": [[8, 6], [2], ["S1"]],
    "cols": [[5, 8], [2], ["S0"]],
    "uneven": [[7, 3], [2], ["R"]],
    "tiny": [[2], [2], ["S0"]],
    "hsdp": [[6, 4], [2], ["S1"]],
    "grid": [[6, 10], [2], ["S0"]],
    "replicated": [[3, 3], [2], ["S0"]],
    "strided": [[8, 6], [2], ["S1"]],
    "stretches": [[8, 6], [2], ["SS0:2"]],
    "mesh3d": [[8, 6], [2], ["R"]],
}


def expected_full(layouts: dict[str, Any]) -> dict[str, torch.Tensor]:
    return expected_of(layouts)


def manifest(root: Path) -> dict[str, Any]:
    found = sorted(root.glob("*/manifest.json"))
    return json.loads(found[-1].read_text())


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_replicated_model_optimizer_and_per_rank_rng_round_trip(tmp_path: Path, executor: str) -> None:
    root = tmp_path / "root"
    results = ok(run_ranks("ddp_roundtrip", 2, tmp_path / "job", root=str(root), executor=executor), tmp_path / "job")
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


LAYOUTS_1 = {name: [shape, [1], ["S0"]] for name, (shape, _, _) in LAYOUTS_4.items()}


@pytest.mark.parametrize(("world", "layouts"), [(2, LAYOUTS_2), (1, LAYOUTS_1)])
def test_reshard_4_to_fewer_ranks(saved_by_4: Path, tmp_path: Path, world: int, layouts: dict[str, Any]) -> None:
    results = ok(
        run_ranks("load_dtensors", world, tmp_path, root=str(saved_by_4), layouts=layouts),
        tmp_path,
    )
    for result in results:
        assert all(result["equal"].values()), result["equal"]
        assert result["plain"] and result["in_place"]


DTYPES_2 = {
    "bf16": [[7, 5], [2], ["S0"], "bfloat16"],
    "ints": [[6, 9], [2], ["S1"], "int64"],
    "flags": [[5, 3], [2], ["S0"], "bool"],
    "scalar": [[], [2], ["R"], "float64"],
    "halfs": [[3, 4], [2], ["R"], "float16"],
}
DTYPES_4 = {
    "bf16": [[7, 5], [2, 2], ["S1", "S0"], "bfloat16"],
    "ints": [[6, 9], [4], ["S0"], "int64"],
    "flags": [[5, 3], [4], ["S1"], "bool"],
    "scalar": [[], [4], ["R"], "float64"],
    "halfs": [[3, 4], [4], ["S1"], "float16"],
}


def test_reshard_2_to_4_reads_only_overlapping_bytes(tmp_path: Path) -> None:
    """Also other dtypes (bfloat16, int64, bool, float16) and 0-d tensors, to 4 ranks and to
    full tensors in one process."""
    root = tmp_path / "root"
    saved, loaded = {**LAYOUTS_2, **DTYPES_2}, {**LAYOUTS_4, **DTYPES_4}
    ok(run_ranks("save_dtensors", 2, tmp_path / "save", root=str(root), layouts=saved), tmp_path / "save")
    results = ok(run_ranks("load_dtensors", 4, tmp_path / "load", root=str(root), layouts=loaded), tmp_path / "load")
    for result in results:
        assert all(result["equal"].values()), result["equal"]
        assert result["in_place"]
    with SyncCheckpointer(str(root)) as ckpt:
        full = ckpt.load()
    for name, expected in expected_full(saved).items():
        assert full["dt"][name].dtype == expected.dtype and torch.equal(full["dt"][name], expected), name
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
        for refused in ({"loader": {"position": 0}}, {"epoch": 0, "rng": aiosnap.RNGState()}):
            with pytest.raises(StateMismatchError, match="rank-local values .* 2 ranks"):
                ckpt.load(refused)
        with pytest.raises(StateMismatchError, match="rank-local values .* 2 ranks"):
            ckpt.load(paths=["loader"])
        # a partial load of keys that are not rank-local needs none of them (before: refused too)
        selected = ckpt.load(paths=["epoch", "model/*"])
        assert selected["epoch"] == 3 and set(selected) == {"epoch", "model"}
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        plain = {"epoch": 0, "model": fresh}
        assert ckpt.load(plain) is plain and plain["epoch"] == 3
        assert_same(dict(fresh.state_dict()), dict(selected["model"]))
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


FAULT_TIMEOUTS = {"commit_timeout": 4.0, "agree_timeout": 4.0}


@pytest.mark.parametrize("how", ["error", "kill"])
def test_a_rank_failing_mid_save_commits_nothing(tmp_path: Path, how: str) -> None:
    root = tmp_path / "root"
    results = run_ranks("fail_or_vanish", 2, tmp_path / "job", root=str(root), victim=1, how=how, **FAULT_TIMEOUTS)
    coordinator = results[0]["ok"]
    if how == "error":
        victim = results[1]["ok"]
        assert victim["outcome"].startswith("OSError") and "No space left" in victim["outcome"]
        # the coordinator hears of it at once, not after its commit_timeout
        assert coordinator["outcome"].startswith("RankFailedError") and "OSError" in coordinator["outcome"]
        assert coordinator["elapsed"] < FAULT_TIMEOUTS["commit_timeout"]
    else:
        assert results[1] == {"exit": 9}
        assert coordinator["outcome"].startswith("RankTimeoutError") and "rank(s) [1]" in coordinator["outcome"]
        assert coordinator["elapsed"] < FAULT_TIMEOUTS["commit_timeout"] + 10
    assert coordinator["steps"] == [1]  # the previous checkpoint stays the latest
    with SyncCheckpointer(str(root)) as ckpt:
        assert ckpt.steps() == [1]
        assert torch.equal(ckpt.load()["w"], arange([256, 64], base=1.0))
    assert not (root / "000000000002" / "manifest.json").exists()


def test_a_rank_that_skips_a_save_is_named_not_waited_for(tmp_path: Path) -> None:
    results = run_ranks(
        "fail_or_vanish", 2, tmp_path / "job", root=str(tmp_path / "root"), victim=1, how="skip", **FAULT_TIMEOUTS
    )
    coordinator = results[0]["ok"]
    assert coordinator["outcome"].startswith("RankTimeoutError"), coordinator
    assert "save(step=2)" in coordinator["outcome"] and "1" in coordinator["outcome"]
    assert coordinator["elapsed"] < FAULT_TIMEOUTS["agree_timeout"] + 10
    assert coordinator["steps"] == [1]


@pytest.mark.parametrize("how", ["state", "earlier"])
def test_a_rank_that_cannot_start_a_save_stops_the_others_at_once(tmp_path: Path, how: str) -> None:
    results = ok(
        run_ranks("early_failure", 2, tmp_path / "job", root=str(tmp_path / "root"), how=how), tmp_path / "job"
    )
    expected = "UnsupportedStateError" if how == "state" else "OSError"
    assert results[1]["outcome"].startswith(expected), results[1]
    assert results[0]["outcome"].startswith("RankFailedError"), results[0]
    assert "rank(s) [1]" in results[0]["outcome"]
    assert results[0]["elapsed"] < 10  # not the agree_timeout (30 s)
    assert results[0]["steps"] == [1]


def test_a_late_cancel_of_the_coordinators_save_leaves_its_commit_whole(tmp_path: Path) -> None:
    root = tmp_path / "root"
    results = ok(run_ranks("cancel_while_committing", 2, tmp_path / "job", root=str(root)), tmp_path / "job")
    # before the fix: rank 0's cancel wrote "aborted", rank 1 removed its data, then rank 0's
    # manifest landed: step 2 committed without rank 1's bytes
    assert results[1]["save"] == "committed", results[1]
    assert results[0]["steps"] == results[1]["steps"] == [1, 2]
    with SyncCheckpointer(str(root)) as ckpt:
        loaded = ckpt.load(step=2)
    assert torch.equal(loaded["v"], arange([256, 64]))
    assert not list(root.glob("000000000002/*/aborted"))


def test_ranks_with_different_replicated_entries_are_refused_by_path(tmp_path: Path) -> None:
    results = ok(run_ranks("disagree", 2, tmp_path / "job", root=str(tmp_path / "root")), tmp_path / "job")
    for result in results:
        assert result["outcome"].startswith("RanksDisagreeError"), result
        assert "model/b" in result["outcome"] and "(3,)" in result["outcome"] and "(5,)" in result["outcome"]
        assert result["steps"] == []


def test_ranks_calling_save_and_load_together_both_raise(tmp_path: Path) -> None:
    job = tmp_path / "job"
    results = ok(run_ranks("mismatched_calls", 2, job, root=str(tmp_path / "root"), how="save_load"), job)
    for result in results:  # before: gloo aborted the loading process (collectives of two sizes)
        assert result["outcome"].startswith("RanksDisagreeError"), result
        assert "save() by rank(s) [0]" in result["outcome"] and "load() by rank(s) [1]" in result["outcome"]
        assert result["steps"] == [1]


def test_ranks_declaring_different_rank_local_paths_are_refused(tmp_path: Path) -> None:
    job = tmp_path / "job"
    results = ok(run_ranks("mismatched_calls", 2, job, root=str(tmp_path / "root"), how="rank_local"), job)
    for result in results:  # before: saved, and rank 1 got its own "b" back as "a"
        assert result["outcome"].startswith("RanksDisagreeError"), result
        assert "'b: rank-local value 0'" in result["outcome"] and "'a: rank-local value 0'" in result["outcome"]
        assert result["steps"] == [1]


def test_events_name_the_group_aiosnap_used(tmp_path: Path) -> None:
    results = ok(
        run_ranks("events_in_subgroup", 4, tmp_path / "job", root=str(tmp_path / "root"), members=[1, 3]),
        tmp_path / "job",
    )
    assert [r["member"] for r in results] == [False, True, False, True]
    # ranks 1 and 3 of the world are ranks 0 and 1 of the group; aiosnap's own group is gloo, of 2
    assert results[1]["seen"] == [[0, 2, "gloo", 2]]
    assert results[3]["seen"] == [[1, 2, "gloo", 2]]


def test_sharded_save_and_reshard_on_the_s3_server(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    s3 = {"endpoint_url": s3_endpoint, "addressing_style": "path", "retry_deadline": 20, "request_timeout": 10}
    url = f"s3://{s3_bucket}/run"
    ok(run_ranks("save_dtensors", 4, tmp_path / "save", root=url, s3=s3, layouts=LAYOUTS_4), tmp_path / "save")
    results = ok(
        run_ranks("load_dtensors", 2, tmp_path / "load", root=url, s3=s3, layouts=LAYOUTS_2), tmp_path / "load"
    )
    for result in results:
        assert all(result["equal"].values()) and result["plain"] and result["in_place"], result
    with SyncCheckpointer({"storage": {"url": url}, "s3": s3}) as ckpt:
        assert ckpt.steps() == [1]
        full = ckpt.load()
    for name, expected in expected_full(LAYOUTS_4).items():
        assert torch.equal(full["dt"][name], expected), name


def test_fuzzed_multi_rank_manifests_fail_cleanly(
    saved_by_4: Path, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Damaged (bytes or fields) multi-rank manifests load bit-exact or raise a
    CorruptCheckpointError; forged ones (checksum recomputed) raise an AiosnapError: never
    another exception, never an allocation larger than what is stored."""
    root = tmp_path / "root"
    shutil.copytree(saved_by_4, root)
    path = next(root.glob("*/manifest.json"))
    document = json.loads(path.read_bytes())
    stored = sum(p.stat().st_size for p in root.rglob("*.bin"))
    largest = 0
    real_whole_target = fetch.whole_target

    def watched(entry: Any) -> Any:
        nonlocal largest
        target = real_whole_target(entry)
        largest = max(largest, target.dest.numel() * target.dest.element_size())
        return target

    monkeypatch.setattr(fetch, "whole_target", watched)
    rng = random.Random(11)
    outcomes: dict[str, int] = {}
    cases = max(1, int(request.config.getoption("--fuzz-cases")) // 4)
    with SyncCheckpointer({"storage": {"url": str(root)}, "events": {"log": False}}) as ckpt:
        expected = ckpt.load()
        for case in range(cases):
            forged = case % 2 == 1
            path.write_bytes(sign_manifest(mutate_document(document, rng)) if forged else mutated_text(document, rng))
            try:
                result = ckpt.load()
            except AiosnapError as exc:
                if not forged and not isinstance(exc, CorruptCheckpointError):
                    raise AssertionError(f"case {case}: damage reported as {exc!r}") from exc
                outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
                continue
            outcomes["loaded"] = outcomes.get("loaded", 0) + 1
            if not forged:
                assert_same(result, expected)
    assert largest <= stored, f"a load allocated {largest} bytes; only {stored} are stored"
    assert outcomes.get("loaded", 0) < cases
    print(f"\nmulti-rank manifest fuzz: {cases} cases: {dict(sorted(outcomes.items()))}")


def test_cli_info_and_verify_cover_shards_and_every_ranks_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from aiosnap.cli import main

    root = tmp_path / "root"
    ok(run_ranks("ddp_roundtrip", 2, tmp_path / "job", root=str(root)), tmp_path / "job")
    capsys.readouterr()
    assert main(["info", str(root), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["world_size"] == 2 and info["top_level_bytes"]["rng"] > 2 * 5000  # both ranks' RNG states
    assert main(["verify", str(root)]) == 0
    capsys.readouterr()
    doc = manifest(root)
    victim = doc["rank_local"][1]["entries"][0]["ranges"][0]  # rank 1's own RNG state
    path = root / victim["object"]
    data = bytearray(path.read_bytes())
    data[victim["offset"]] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["verify", str(root)]) != 0
    assert "rng/torch: checksum mismatch" in capsys.readouterr().err


def test_the_distributed_example_runs_under_torchrun_twice_and_resumes(tmp_path: Path) -> None:
    import subprocess
    import sys

    example = Path(__file__).resolve().parent.parent / "examples" / "distributed_train.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(example),
               "--root", str(tmp_path / "root"), "--steps", "9", "--every", "3"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOSNAP_")}
    # three saves a run: the restart comes after the first (halfway is a save, not step 4.5)
    for steps in ("steps 0-9, resumed at step 3", "steps 9-18, resumed at step 12"):  # run 2 goes on from run 1
        run = subprocess.run(command, capture_output=True, text=True, timeout=80, env=env, check=False)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert run.stdout.count(f"{steps}; losses equal to an uninterrupted run: True") == 2, run.stdout
