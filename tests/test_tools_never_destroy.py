"""The maintenance tools and the lifecycle never destroy data (issue: gc, download, resume,
URLs, fork, events, secrets). Each test reproduces one case an operator met."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Config, ConfigError, ForkedProcessError, SyncCheckpointer
from aiosnap.catalog.garbage import collect_garbage
from aiosnap.cli import main
from aiosnap.core.events import Event, JsonlHandler, LoggingHandler
from aiosnap.core.names import step_dir
from aiosnap.storage.local import LocalStorage
from aiosnap.storage.registry import storage_from_url
from aiosnap.transfer.copy import copy_step
from tests.conftest import FaultyStorage

Crashed = tuple[Path, Path, Config, dict[str, Any]]


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _age(path: Path, seconds: float) -> None:
    old = time.time() - seconds
    for item in [path, *path.rglob("*")]:
        os.utime(item, (old, old), follow_symlinks=False)


def _fill(root: Path, steps: tuple[int, ...], keep_last: int | None = None) -> None:
    config = Config(storage={"url": str(root)}, retention={"keep_last": keep_last}, events={"log": False})
    with SyncCheckpointer(config) as ckpt:
        for step in steps:
            ckpt.save({"w": torch.full((1000,), float(step))}, step=step).wait()


# 1. gc before a spool resume: resume verifies every landed object; nothing is lost beyond the crashed save


def test_gc_then_resume_keeps_the_good_step(crashed_spool: Crashed, capsys: pytest.CaptureFixture[str]) -> None:
    spool_template, root_template, config, _ = crashed_spool
    root, spool_dir = Path(config.storage.url), Path(str(config.spool.dir))
    for folder, template in ((spool_dir, spool_template), (root, root_template)):
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(template, folder)
    _fill(root, (2,))  # an older good step
    _age(root / step_dir(4), 7200)  # the crashed save's folder is past the grace period
    code, out, _ = _cli(capsys, "gc", str(root), "--keep-last", "1", "--json")
    assert code == 0 and json.loads(out)["removed_incomplete"], out
    config_file = root.parent / "job.yaml"
    config_file.write_text(config.model_dump_json(exclude_none=True))
    code, out, err = _cli(capsys, "resume", "--config", str(config_file), "--json")
    report = json.loads(out)
    assert code == 0 and report["resumed"] == [] and "gone from storage" in report["discarded"][0][1], err
    assert report["committed_steps"] == [2], "no commit over missing objects, no retention"
    with SyncCheckpointer(str(root)) as ckpt:
        assert torch.equal(ckpt.load()["w"], torch.full((1000,), 2.0))


# 2. download never removes what it did not write; overlapping roots are refused


def test_a_failed_download_keeps_what_dest_already_had(tmp_path: Path) -> None:
    source, dest = tmp_path / "src", tmp_path / "dest"
    _fill(source, (5, 7))
    shutil.copytree(source, dest)  # DEST holds good copies of 5 and 7
    shutil.rmtree(dest / step_dir(7))
    data = next((source / step_dir(7)).rglob("*.bin"))
    data.write_bytes(b"\x00" * data.stat().st_size)  # the source went bad meanwhile
    good_before = sorted(p.relative_to(dest) for p in dest.rglob("*") if p.is_file())

    async def download() -> None:
        src, dst = LocalStorage(source), LocalStorage(dest)
        from aiosnap.catalog.steps import read_manifest

        with pytest.raises(Exception, match="checksum mismatch"):
            await copy_step(src, dst, await read_manifest(src, 7))

    asyncio.run(download())
    assert sorted(p.relative_to(dest) for p in dest.rglob("*") if p.is_file()) == good_before
    with SyncCheckpointer(str(dest)) as ckpt:
        assert ckpt.steps() == [5] and torch.equal(ckpt.load()["w"], torch.full((1000,), 5.0))


def test_download_into_the_same_or_an_overlapping_root_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    _fill(root, (3,))
    before = sorted(p for p in root.rglob("*") if p.is_file())
    for dest in (f"file://{root}", str(root / "inside"), str(tmp_path)):
        code, _, err = _cli(capsys, "download", str(root), dest)
        assert code == 1 and "overlap" in err, dest
    assert sorted(p for p in root.rglob("*") if p.is_file()) == before


def test_download_again_is_a_no_op_and_another_save_is_not_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, dest = tmp_path / "src", tmp_path / "dest"
    _fill(source, (4,))
    assert _cli(capsys, "download", str(source), str(dest))[0] == 0
    code, out, _ = _cli(capsys, "download", str(source), str(dest), "--json")
    assert code == 0 and json.loads(out)["copied"] is False
    shutil.rmtree(source)
    _fill(source, (4,))  # step 4 saved again elsewhere: another save id
    code, _, err = _cli(capsys, "download", str(source), str(dest))
    assert code == 1 and "already holds step 4 from another save" in err


# 3. URLs: '#' and '?' never silently cut a root; %20 is decoded


def test_url_special_characters(tmp_path: Path) -> None:
    for url in (f"file://{tmp_path}/exp#3", f"file://{tmp_path}/exp?x=1", "s3://bucket/run#4"):
        with pytest.raises(ConfigError, match=r"'\?' or '#'"):
            storage_from_url(url)
    assert storage_from_url(f"{tmp_path}/exp#3").url == f"{tmp_path}/exp#3"  # a plain path is literal
    assert storage_from_url(f"{tmp_path}/exp#4").url != storage_from_url(f"{tmp_path}/exp#3").url
    assert storage_from_url(f"file://{tmp_path}/my%20ckpts").url == f"{tmp_path}/my ckpts"


# 4. only aiosnap's exact step folders are steps; nothing else in a root is deleted


def test_foreign_files_are_neither_steps_nor_garbage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    _fill(root, (1, 2))
    for name in ("2024/photos/img.jpg", "7/notes.txt", "0300/x.bin", f"{step_dir(2)}/notes.txt"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("mine")
    (root / "2").mkdir()
    (root / "²").mkdir()
    _age(root, 7200)
    with SyncCheckpointer(str(root)) as ckpt:
        assert ckpt.steps() == [1, 2]
    code, out, _ = _cli(capsys, "ls", str(root), "--all", "--json")
    assert code == 0 and [d["step"] for d in json.loads(out)] == [1, 2]
    code, out, _ = _cli(capsys, "gc", str(root), "--keep-last", "2", "--grace", "1s", "--json")
    assert code == 0 and json.loads(out)["deleted_steps"] == [] and json.loads(out)["removed_incomplete"] == []
    for name in ("2024/photos/img.jpg", "7/notes.txt", "0300/x.bin", f"{step_dir(2)}/notes.txt", "2", "²"):
        assert (root / name).exists(), name


# 5. gc acting on a stale listing never deletes a new attempt of the same step


def test_gc_never_deletes_an_attempt_that_appeared_after_its_listing(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _fill(root, (1,))
    crashed = root / step_dir(50) / "deadbeef00000000" / "rank-0"
    crashed.mkdir(parents=True)
    (crashed / "0.bin").write_bytes(b"x" * 100)
    _age(root / step_dir(50), 7200)

    class RacingStore(FaultyStorage):
        async def delete_prefix(self, prefix: str) -> None:
            if prefix.startswith(step_dir(50)) and not (root / step_dir(50) / "manifest.json").exists():
                # a restarted job re-saves step 50 right between gc's listing and its delete
                await asyncio.to_thread(_fill, root, (50,))
            await super().delete_prefix(prefix)

    report = asyncio.run(collect_garbage(RacingStore(LocalStorage(root)), keep_last=5, grace_s=3600))
    assert report.removed_incomplete == [f"{step_dir(50)}/deadbeef00000000"]
    with SyncCheckpointer(str(root)) as ckpt:
        assert ckpt.steps() == [1, 50]
        assert torch.equal(ckpt.load()["w"], torch.full((1000,), 50.0)), "the new attempt is whole"


# 6. S3 keys with '//' or '..' inside a step


def test_s3_odd_keys_inside_a_step_are_left_alone(s3_endpoint: str, s3_bucket: str, s3_client: Any) -> None:
    from tests.conftest import s3_config

    config = s3_config(s3_endpoint, s3_bucket)
    with SyncCheckpointer(config) as ckpt:
        for step in (5, 6):
            ckpt.save({"w": torch.full((10,), float(step))}, step=step).wait()
    for key in ("run/000000000006//stray.txt", "run/000000000006/../x", "run/000000000006/a/../b"):
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=b"mine")

    async def gc_run() -> Any:
        storage = storage_from_url(f"s3://{s3_bucket}/run", config)
        try:
            return await collect_garbage(storage, keep_last=1, grace_s=0)
        finally:
            await storage.close()

    report = asyncio.run(gc_run())
    assert report.deleted_steps == [5]
    keys = {o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="run/")["Contents"]}
    assert {"run/000000000006//stray.txt", "run/000000000006/../x", "run/000000000006/a/../b"} <= keys
    with SyncCheckpointer(config) as ckpt:
        assert ckpt.steps() == [6] and torch.equal(ckpt.load()["w"], torch.full((10,), 6.0))


# 8. after os.fork(): a clear error, never a hang


def test_a_checkpointer_used_after_fork_raises_in_the_child(small_config: Config) -> None:
    ckpt = SyncCheckpointer(small_config)
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads: the point of this test
        pid = os.fork()
    if pid == 0:  # the child: report what save() and close() did, then leave at once
        try:
            try:
                ckpt.save({"x": torch.ones(1)}, step=1)
                outcome = "saved"
            except ForkedProcessError:
                outcome = "refused"
            ckpt.close()
            os.write(write, outcome.encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        assert time.monotonic() < deadline, "the child hung"
        time.sleep(0.05)
    assert os.read(read, 100) == b"refused"
    os.close(read)
    ckpt.save({"x": torch.ones(1)}, step=1).wait()  # the parent's checkpointer is unharmed
    ckpt.close()


# 9, 10. failure events with any exception type; a blocked handler never hangs close()


class SdkError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def test_failure_events_reach_both_built_in_handlers(
    small_config: Config, faulty: FaultyStorage, tmp_path: Path
) -> None:
    faulty.fail_when = lambda name: name.endswith(".bin")
    faulty.error = SdkError(503, "slow down")
    events_file = tmp_path / "events.jsonl"
    config = small_config.model_copy(update={"events": type(small_config.events)(jsonl=events_file)})
    with SyncCheckpointer(config, storage=faulty) as ckpt:
        for step in (1, 2):
            with pytest.raises(SdkError):
                ckpt.save({"x": torch.ones(3)}, step=step).wait()
    kinds = [json.loads(line)["kind"] for line in events_file.read_text().splitlines()]
    assert kinds.count("exception") == 2
    LoggingHandler()(Event("exception", "save", None, 1, "u", 0, 1, None, None, exception=SdkError(1, "x")))


def test_a_blocked_event_handler_does_not_hang_close(
    small_config: Config, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from aiosnap.core import events

    monkeypatch.setattr(events, "CLOSE_TIMEOUT_S", 0.5)
    stuck = threading.Event()
    ckpt = SyncCheckpointer(small_config, event_handlers=[lambda event: stuck.wait()])
    ckpt.save({"x": torch.ones(3)}, step=1).wait()
    started = time.monotonic()
    ckpt.close()
    assert time.monotonic() - started < 5 and "still blocked" in caplog.text
    stuck.set()


def test_a_torn_jsonl_line_is_ended_before_the_next_event(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"kind": "start"}\n{"kind": "en')  # a crash mid-line
    handler = JsonlHandler(path)
    handler(Event("end", "save", None, 1, "u", 0, 1, None, None))
    handler.close()
    lines = path.read_text().splitlines()
    assert lines[1] == '{"kind": "en' and json.loads(lines[2])["kind"] == "end"


# 11. ls and gc on a root that training is writing


def test_ls_and_gc_dry_run_on_a_live_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    config = Config(storage={"url": str(root)}, retention={"keep_last": 2}, upload={"chunk_size": "64KiB"},
                    events={"log": False})  # fmt: skip
    stop = threading.Event()

    def train() -> None:
        with SyncCheckpointer(config) as ckpt:
            step = 0
            while not stop.is_set():
                step += 1
                ckpt.save({"w": torch.randn(20_000)}, step=step).wait()

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        deadline = time.monotonic() + 30
        while not list(root.glob("*/manifest.json")):  # the root exists once the first step committed
            assert time.monotonic() < deadline
            time.sleep(0.01)
        failures = 0
        for _ in range(100):
            failures += _cli(capsys, "ls", str(root), "--json")[0] != 0
            failures += _cli(capsys, "gc", str(root), "-k", "1", "--dry-run", "--json")[0] != 0
    finally:
        stop.set()
        trainer.join(60)
    assert failures == 0


# 12. a symlinked step folder (moved to another disk)


def test_a_symlinked_step_folder_works_everywhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, other_disk = tmp_path / "ckpt", tmp_path / "other-disk"
    _fill(root, (1, 2, 3))
    other_disk.mkdir()
    shutil.move(root / step_dir(2), other_disk / step_dir(2))
    (root / step_dir(2)).symlink_to(other_disk / step_dir(2))
    with SyncCheckpointer(str(root)) as ckpt:
        assert ckpt.steps() == [1, 2, 3]
        assert torch.equal(ckpt.load(step=2)["w"], torch.full((1000,), 2.0))
    assert _cli(capsys, "ls", str(root))[0] == 0
    assert _cli(capsys, "verify", str(root), "--step", "2")[0] == 0
    code, out, _ = _cli(capsys, "gc", str(root), "-k", "1", "--json")
    assert code == 0 and json.loads(out)["deleted_steps"] == [1, 2]
    assert not (root / step_dir(2)).exists() and not any(other_disk.rglob("*.bin"))


# 13. a grace period that is not a duration


def test_nan_or_negative_grace_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    _fill(root, (1,))
    for grace in ("nan", "-5", "-1h", "inf"):
        assert _cli(capsys, "gc", str(root), "-k", "1", "--grace", grace)[0] == 2, grace
    for grace_s in (math.nan, -1.0):
        with pytest.raises(ValueError, match="grace"):
            asyncio.run(collect_garbage(LocalStorage(root), keep_last=1, grace_s=grace_s))


# 14. CLI errors: one bad manifest, version checks, --json errors, missing or odd roots


def test_cli_errors_on_odd_roots_and_manifests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    _fill(root, (1, 2))
    manifest = root / step_dir(2) / "manifest.json"
    doc = json.loads(manifest.read_bytes())
    doc["format_version"] = 6
    manifest.write_text(json.dumps(doc))  # written by a newer aiosnap
    code, out, _ = _cli(capsys, "ls", str(root), "--json")
    listed = json.loads(out)
    assert code == 0 and [(d["step"], d["state"]) for d in listed] == [(1, "committed"), (2, "unreadable")]
    assert "format version 6" in listed[1]["problem"]

    missing = tmp_path / "typo"
    code, out, err = _cli(capsys, "ls", str(missing), "--json")
    assert code == 1 and "no such checkpoint root" in err and json.loads(out)["type"] == "FileNotFoundError"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert _cli(capsys, "ls", str(a_file))[0] == 1
    (tmp_path / "empty").mkdir()
    code, _, err = _cli(capsys, "ls", str(tmp_path / "empty"))
    assert code == 1 and "no checkpoints" in err
    code, out, _ = _cli(capsys, "info", str(missing), "--json")
    assert code == 1 and "error" in json.loads(out)


# 16. smaller: no hard links, unclosed checkpointers, resumed commits emit events


def test_commit_without_hard_links(small_config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from aiosnap.core import durable

    def no_links(source: object, target: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted (vfat)")

    monkeypatch.setattr(durable.os, "link", no_links)
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save({"x": torch.ones(3)}, step=1).wait()
        assert ckpt.steps() == [1]
    monkeypatch.setattr(durable, "_rename_noreplace", lambda source, target: False)  # nor renameat2
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save({"x": torch.ones(3) * 2}, step=2).wait()
        assert torch.equal(ckpt.load()["x"], torch.ones(3) * 2)


def test_unclosed_checkpointers_are_closed_when_collected(small_config: Config) -> None:
    gc.collect()
    threads_before = threading.active_count()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(20):
            ckpt = SyncCheckpointer(small_config)
            ckpt.save({"x": torch.ones(3)}, step=step).wait()
            del ckpt
        gc.collect()  # each is closed on a thread of its own: never inside the collection
        deadline = time.monotonic() + 10
        while threading.active_count() > threads_before + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert sum(issubclass(w.category, ResourceWarning) for w in caught) == 20
    assert threading.active_count() <= threads_before + 1


def test_resumed_commits_emit_events(crashed_spool: Crashed) -> None:
    spool_template, root_template, config, _ = crashed_spool
    for folder, template in ((Path(str(config.spool.dir)), spool_template), (Path(config.storage.url), root_template)):
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(template, folder)
    seen: list[Event] = []
    config = config.model_copy(update={"spool": config.spool.model_copy(update={"resume": True})})
    with SyncCheckpointer(config, event_handlers=[seen.append]) as ckpt:
        assert ckpt.resume_report.resumed == [4]
        ckpt.flush_events()
    assert [(e.op, e.kind, e.step) for e in seen] == [("resume", "start", 4), ("resume", "end", 4)]


# -- found by review


def test_a_script_that_exits_without_close_still_commits(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = tmp_path / "ckpt"
    script = (
        "import torch, aiosnap\n"
        f"ckpt = aiosnap.SyncCheckpointer({str(root)!r})\n"
        "ckpt.save({'w': torch.full((4_000_000,), 7.0)}, step=7)\n"
        "print('returned', flush=True)\n"  # ... and the script ends: no wait(), no close()
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0 and "returned" in run.stdout, run.stderr
    assert "not closed" in run.stderr  # said, not silent
    with SyncCheckpointer(str(root)) as ckpt:
        assert ckpt.steps() == [7] and torch.equal(ckpt.load()["w"], torch.full((4_000_000,), 7.0))


def test_an_unclosed_checkpointer_collected_on_its_loop_thread_finishes_its_save(
    small_config: Config, faulty: FaultyStorage
) -> None:
    gc.collect()
    threads_before = threading.active_count()
    faulty.delay = 0.2
    ckpt = SyncCheckpointer(small_config, storage=faulty)
    view = ckpt.at(str(Path(faulty.url) / "other"))  # owner <-> view: a reference cycle
    handle = view.save({"x": torch.ones(3)}, step=3)
    loop = ckpt._loop.loop
    del ckpt, view
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        loop.call_soon_threadsafe(gc.collect)  # the cyclic collector runs on the loop thread
        assert handle.wait(30).step == 3
        deadline = time.monotonic() + 10
        while threading.active_count() > threads_before and time.monotonic() < deadline:
            time.sleep(0.05)
    assert threading.active_count() <= threads_before


def test_a_download_that_fails_never_deletes_a_copy_committed_meanwhile(tmp_path: Path) -> None:
    from aiosnap.catalog.steps import read_manifest

    source, dest = tmp_path / "src", tmp_path / "dest"
    _fill(source, (5,))

    class BreaksAfterTheOtherCopy(LocalStorage):
        async def read_into(self, name: str, offset: int, dest_view: memoryview) -> int:
            await copy_step(LocalStorage(source), LocalStorage(dest), manifest)  # run A commits meanwhile
            raise ConnectionResetError("source connection reset (injected)")

    async def both() -> None:
        nonlocal manifest
        manifest = await read_manifest(LocalStorage(source), 5)
        with pytest.raises(ConnectionResetError):
            await copy_step(BreaksAfterTheOtherCopy(source), LocalStorage(dest), manifest)  # run B

    manifest: Any = None
    asyncio.run(both())
    with SyncCheckpointer(str(dest)) as ckpt:
        assert torch.equal(ckpt.load()["w"], torch.full((1000,), 5.0)), "run A's copy is whole"


def test_download_refuses_a_dest_whose_manifest_is_unreadable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, dest = tmp_path / "src", tmp_path / "dest"
    _fill(source, (5,))
    shutil.copytree(source, dest)
    (dest / step_dir(5) / "manifest.json").write_text("{torn")
    before = sorted(p.name for p in dest.rglob("*.bin"))
    code, _, err = _cli(capsys, "download", str(source), str(dest))
    assert code == 1 and "cannot be read" in err
    assert sorted(p.name for p in dest.rglob("*.bin")) == before


def test_retention_never_counts_an_unreadable_step_as_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    _fill(root, (1, 2, 3))
    (root / step_dir(3) / "manifest.json").write_text("{torn")
    code, out, _ = _cli(capsys, "gc", str(root), "--keep-last", "1", "--json")
    report = json.loads(out)
    assert code == 0 and report["deleted_steps"] == [1] and report["kept_unreadable"] == [3]
    with SyncCheckpointer(Config(storage={"url": str(root)}, retention={"keep_last": 1})) as ckpt:
        assert torch.equal(ckpt.load(step=2)["w"], torch.full((1000,), 2.0)), "the last loadable step stays"
        ckpt.save({"w": torch.zeros(3)}, step=4).wait()
        assert 3 in ckpt.steps(), "an unreadable step is never deleted by retention either"


def test_yaml_errors_never_show_the_offending_line(tmp_path: Path) -> None:
    from aiosnap import load_config

    secret = "TOPSECRETvalue123"
    for text in (
        f"s3:\n  secret_access_key: {secret}\n  secret_access_key: {secret}\n",
        f"s3:\n  secret_access_key: `{secret}\n",
        f's3:\n  secret_access_key: "{secret}\\q"\n',
        "upload: {[1, 2]: 3}\n",
    ):
        path = tmp_path / "job.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert secret not in str(info.value) and "\n" not in str(info.value), str(info.value)
    path.write_text("base: &b {concurrency: 2}\nupload:\n  <<: *b\n  concurrency: 3\n")  # merge keys still work
    with pytest.raises(ConfigError, match="base"):  # ('base' itself is no setting)
        load_config(path)


def test_a_forked_child_never_waits_for_the_parents_save(small_config: Config, faulty: FaultyStorage) -> None:
    faulty.hold()
    ckpt = SyncCheckpointer(small_config, storage=faulty)
    handle = ckpt.save({"x": torch.ones(1)}, step=1)
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        try:
            outcomes = []
            for call in (handle.wait, ckpt.flush_events):
                try:
                    call()
                    outcomes.append("returned")
                except ForkedProcessError:
                    outcomes.append("refused")
            os.write(write, ",".join(outcomes).encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        assert time.monotonic() < deadline, "the child hung"
        time.sleep(0.05)
    assert os.read(read, 100) == b"refused,refused"
    os.close(read)
    faulty.release(ckpt._loop.loop)
    handle.wait(10)
    ckpt.close()


def test_the_cli_without_s3_credentials_is_one_line(s3_endpoint: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    config_file = tmp_path / "s3.yaml"
    config_file.write_text(json.dumps({"s3": {"endpoint_url": s3_endpoint, "addressing_style": "path"}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true")  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "aiosnap", "ls", "s3://bucket/run", "--config", str(config_file), "--json"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "credentials" in run.stderr.lower()
    assert json.loads(run.stdout)["type"] == "StorageError"


def test_a_url_naming_no_folder_is_refused() -> None:
    for url in ("", "file://", "file://localhost", "file:///"):
        with pytest.raises(ConfigError, match="names no folder|empty"):
            storage_from_url(url)


def test_a_collection_inside_a_thread_pool_lock_never_waits_for_a_forgotten_checkpointer(
    small_config: Config, faulty: FaultyStorage
) -> None:
    """A garbage collection runs inside whatever allocation triggered it: here, on a thread
    holding the thread pools' shutdown lock (as another checkpointer's loop thread does in
    ``submit``). Closing the forgotten checkpointer right there would wait for its loop,
    whose next ``to_thread`` needs that lock: a deadlock (seen at interpreter exit)."""
    import concurrent.futures.thread as pool_module

    gc.collect()
    faulty.delay = 0.3
    ckpt = SyncCheckpointer(small_config, storage=faulty)
    view = ckpt.at(str(Path(faulty.url) / "other"))  # owner <-> view: only the cyclic collector frees them
    handle = view.save({"x": torch.ones(3)}, step=3)
    del ckpt, view
    returned = threading.Event()

    def collect_holding_the_lock() -> None:
        with pool_module._global_shutdown_lock:
            gc.collect()
        returned.set()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        threading.Thread(target=collect_holding_the_lock, daemon=True).start()
        assert returned.wait(10), "the collection waited for the forgotten checkpointer's saves"
        assert handle.wait(30).step == 3
        deadline = time.monotonic() + 10
        while any(t.name == "aiosnap-close" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)


def test_a_checkpointer_dropped_without_close_is_closed_at_once(small_config: Config, tmp_path: Path) -> None:
    """Dropped by its last reference (no garbage collection involved), it is closed on the
    spot, as before the collector's closings moved to threads: its spool lock is free for
    the next checkpointer at once, and its ResourceWarning is raised where it was dropped."""
    config = small_config.model_copy(
        update={"spool": small_config.spool.model_copy(update={"dir": str(tmp_path / "spool"), "mode": "always"})}
    )

    def forget() -> None:
        ckpt = SyncCheckpointer(config)
        ckpt.save({"x": torch.ones(100_000)}, step=1)  # not waited for, not closed

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forget()
        assert any(issubclass(w.category, ResourceWarning) for w in caught)
    with SyncCheckpointer(config) as again:  # the spool lock is free
        assert again.steps() == [1]
