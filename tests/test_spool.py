"""Local-disk spool: save() returns at disk speed, budgets hold, crashes lose nothing captured."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import ChecksumMismatchError, Config, SpoolBusyError, SyncCheckpointer
from aiosnap.core import durable
from aiosnap.storage.local import LocalStorage
from tests.conftest import FaultyStorage, rot_after_writing, s3_config
from tests.spool_child import state as child_state

MiB = 1024 * 1024
pytestmark = pytest.mark.both_executors

REPO = Path(__file__).parent.parent


def _spool_config(base: Config, spool_dir: Path, **spool: Any) -> Config:
    validated = type(base.spool).model_validate({**base.spool.model_dump(), "dir": str(spool_dir), **spool})
    return base.model_copy(update={"spool": validated})


def _local(root: Path, spool_dir: Path, ram: str = "4MiB", **spool: Any) -> Config:
    base = Config(storage={"url": str(root)}, ram_budget=ram, upload={"chunk_size": "1MiB", "concurrency": 2})
    return _spool_config(base, spool_dir, **spool)


def _spool_files(spool_dir: Path) -> list[Path]:
    return [p for p in spool_dir.rglob("*") if p.is_file() and p.name != "LOCK"]


def _chunk_files(spool_dir: Path) -> list[Path]:
    """What the disk budget counts: spooled chunks (each save's small journal comes on top)."""
    return [p for p in _spool_files(spool_dir) if p.suffix == ".bin"]


def test_overflow_returns_long_before_a_throttled_upload(
    s3_endpoint: str, s3_bucket: str, proxy: Any, tmp_path: Path
) -> None:
    proxy.set_rate(8e6)  # 8 MB/s target
    base = s3_config(proxy.url, s3_bucket).model_copy(update={"ram_budget": 4 * MiB})
    config = _spool_config(base, tmp_path / "spool", mode="overflow")
    state = {"w": torch.randn(4_000_000)}  # 16 MB: 4x the RAM budget
    with SyncCheckpointer(config) as ckpt:
        result = ckpt.save(state, step=1).wait(120)
        proxy.clear()
        restored = ckpt.load()
    print(f"blocked {result.blocked_s:.2f} s, durable {result.durable_s:.2f} s, spooled {result.spooled_chunks}")
    assert result.spooled_chunks > 0
    assert result.blocked_s < result.durable_s / 2
    assert result.ram_high_water <= 4 * MiB
    assert torch.equal(restored["w"], state["w"])
    assert _spool_files(tmp_path / "spool") == [], "spool files are deleted once committed"


def test_without_spool_the_same_save_blocks_for_the_upload(s3_endpoint: str, s3_bucket: str, proxy: Any) -> None:
    proxy.set_rate(8e6)
    config = s3_config(proxy.url, s3_bucket).model_copy(update={"ram_budget": 4 * MiB})
    with SyncCheckpointer(config) as ckpt:
        result = ckpt.save({"w": torch.randn(4_000_000)}, step=1).wait(120)
    assert result.spooled_chunks == 0
    assert result.blocked_s > result.durable_s / 2


@pytest.mark.thread_only  # wraps a storage in the trainer's process
def test_disk_budget_is_respected_on_disk(tmp_path: Path) -> None:
    slow = FaultyStorage(LocalStorage(tmp_path / "c"))
    slow.delay = 0.02
    spool_dir = tmp_path / "spool"
    config = _local(tmp_path / "c", spool_dir, mode="always", budget="3MiB")
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):  # a file vanished while summing
                peak = max(peak, sum(p.stat().st_size for p in _chunk_files(spool_dir)))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    state = {"w": torch.randn(3_000_000)}  # 12 MB through a 3 MiB spool
    try:
        with SyncCheckpointer(config, storage=slow) as ckpt:
            result = ckpt.save(state, step=1).wait(60)
            assert ckpt._engine.spool is not None
            assert ckpt._engine.spool.budget.high_water <= 3 * MiB
            assert torch.equal(ckpt.load()["w"], state["w"])
    finally:
        stop.set()
        watcher.join()
    assert result.spooled_chunks == 12
    assert 0 < peak <= 3 * MiB


def test_disk_full_falls_back_to_ram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_write = durable.write_file
    written = 0

    def fill_up(path: Path, data: memoryview | bytes, *, sync: bool = True) -> None:
        nonlocal written
        if written >= 2 * MiB:  # the spool disk is full after two chunks
            with open(path, "wb") as f:
                f.write(bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        written += len(data)
        real_write(path, data, sync=sync)

    monkeypatch.setattr(durable, "write_file", fill_up)
    config = _local(tmp_path / "c", tmp_path / "spool", mode="always")
    state = {"w": torch.randn(2_000_000)}  # 8 chunks of 1 MiB
    with SyncCheckpointer(config) as ckpt:
        result = ckpt.save(state, step=1).wait(60)
        assert torch.equal(ckpt.load()["w"], state["w"])
    assert result.spooled_chunks == 2
    assert result.spool_fallback is not None and "No space left" in result.spool_fallback
    assert "waits for RAM instead" in caplog.text
    assert _spool_files(tmp_path / "spool") == []


def test_unwritable_spool_dir_means_no_spool_not_a_failure(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = _local(tmp_path / "c", blocker / "spool", mode="always")
    with SyncCheckpointer(config) as ckpt:
        result = ckpt.save({"w": torch.randn(2_000_000)}, step=1).wait(60)
    assert result.spooled_chunks == 0
    assert "not usable" in caplog.text


def test_two_checkpointers_never_share_a_spool(tmp_path: Path) -> None:
    config = _local(tmp_path / "c", tmp_path / "spool")
    first = SyncCheckpointer(config)
    with pytest.raises(SpoolBusyError, match="in use"):
        SyncCheckpointer(config)
    first.close()
    SyncCheckpointer(config).close()


def test_corrupt_spool_chunk_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rot_after_writing(monkeypatch, "1.bin")  # the disk flips a byte of the second chunk after the write
    config = _local(tmp_path / "c", tmp_path / "spool", mode="always")
    ckpt = SyncCheckpointer(config)
    with pytest.raises(ChecksumMismatchError, match="spool file .*1.bin is corrupt"):
        ckpt.save({"w": torch.randn(500_000)}, step=1).wait(30)  # 2 chunks, both spooled
    assert ckpt.steps() == []
    ckpt.close()  # the failure was reported at wait(): not raised again
    assert _spool_files(tmp_path / "spool") == []


def test_crash_of_a_save_to_another_root_resumes_there(
    s3_endpoint: str, s3_bucket: str, proxy: Any, tmp_path: Path
) -> None:
    proxy.set_rate(2e6)
    base = s3_config(proxy.url, s3_bucket).model_copy(update={"ram_budget": 8 * MiB})
    config = _spool_config(base, tmp_path / "spool", mode="always")
    other = f"s3://{s3_bucket}/lightning/last.ckpt"  # what the Lightning plugin saves through at()
    _crash_child(config, 4, dict(os.environ), root=other)
    proxy.clear()
    manual = _spool_config(config, tmp_path / "spool", resume=False)
    heard: list[tuple[int, int]] = []
    with SyncCheckpointer(manual) as ckpt:
        assert ckpt.resume_report.resumed == []  # resume: false leaves it to resume_spool()
        report = ckpt.resume_spool()
        assert report.resumed == [] and len(report.skipped) == 1  # not this root's save
        view = ckpt.at(other, keep_last=1)
        report = view.resume_spool(progress=lambda nbytes, total: heard.append((nbytes, total)))
        assert report.resumed == [4] and report.skipped == []
        assert heard and sum(n for n, _ in heard) == heard[0][1] > 0  # every spooled byte, once
        assert ckpt.steps() == []  # not the main root
        assert view.steps() == [4]
        assert torch.equal(view.load()["w"], child_state()["w"])
    assert _spool_files(tmp_path / "spool") == []


def _crash_child(config: Config, step: int, env: dict[str, str], root: str | None = None) -> None:
    """Start a child that saves, wait until save() returned, SIGKILL it mid-upload."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.spool_child", config.model_dump_json(), str(step), *([root] if root else [])],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if line.startswith("HELPER"):
            line = child.stdout.readline()
        assert line.strip() == "CAPTURED", line
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        if child.stdout is not None:
            child.stdout.close()


def test_crash_after_capture_is_resumed_and_committed(
    s3_endpoint: str, s3_bucket: str, proxy: Any, tmp_path: Path
) -> None:
    proxy.set_rate(2e6)  # 16 MB at 2 MB/s: the child is killed long before it finishes
    base = s3_config(proxy.url, s3_bucket).model_copy(update={"ram_budget": 8 * MiB})
    config = _spool_config(base, tmp_path / "spool", mode="always")
    _crash_child(config, 7, dict(os.environ))
    assert (tmp_path / "spool").exists()
    proxy.clear()
    with SyncCheckpointer(config) as ckpt:
        assert ckpt.resume_report.resumed == [7]
        restored = ckpt.load()
    expected = child_state()
    assert torch.equal(restored["w"], expected["w"])
    assert torch.equal(restored["b"], expected["b"])
    assert _spool_files(tmp_path / "spool") == []


def test_cli_resume_commits_what_a_crash_left(s3_endpoint: str, s3_bucket: str, proxy: Any, tmp_path: Path) -> None:
    proxy.set_rate(2e6)
    base = s3_config(proxy.url, s3_bucket).model_copy(update={"ram_budget": 8 * MiB})
    config = _spool_config(base, tmp_path / "spool", mode="always")
    _crash_child(config, 3, dict(os.environ))
    proxy.clear()
    config_file = tmp_path / "job.yaml"
    document = json.loads(config.model_dump_json())
    document["s3"] = {k: v for k, v in document["s3"].items() if v is not None}
    config_file.write_text(json.dumps(document))  # JSON is YAML
    out = subprocess.run([sys.executable, "-m", "aiosnap", "resume", "--config", str(config_file), "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["resumed"] == [3]
    assert report["committed_steps"] == [3]


def test_half_captured_crash_is_discarded_and_the_previous_step_stays(
    s3_endpoint: str, s3_bucket: str, proxy: Any, tmp_path: Path
) -> None:
    base = s3_config(proxy.url, s3_bucket).model_copy(update={"ram_budget": 8 * MiB})
    config = _spool_config(base, tmp_path / "spool", mode="overflow")
    with SyncCheckpointer(config) as ckpt:
        ckpt.save({"w": torch.zeros(10)}, step=1).wait(60)
    proxy.set_rate(1e6)  # chunks held in RAM cannot land before the kill
    _crash_child(config, 2, dict(os.environ))
    proxy.clear()
    with SyncCheckpointer(config) as ckpt:
        assert ckpt.resume_report.resumed == []
        assert len(ckpt.resume_report.discarded) == 1
        assert "only in RAM" in ckpt.resume_report.discarded[0][1]
        assert ckpt.steps() == [1]
        assert torch.equal(ckpt.load()["w"], torch.zeros(10))
    assert _spool_files(tmp_path / "spool") == []


def test_a_constructor_that_fails_releases_the_spool_lock_and_the_events_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psutil

    events_file = tmp_path / "events.jsonl"
    config = _local(tmp_path / "c", tmp_path / "spool").model_copy(
        update={"loop": "uvloop", "events": type(Config().events)(jsonl=events_file)}
    )
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `loop: uvloop` without uvloop installed
    with pytest.raises(ImportError, match="uvloop"):
        SyncCheckpointer(config)
    open_paths = {f.path for f in psutil.Process().open_files()}
    assert str(events_file) not in open_paths, "the JSON-lines file was closed"
    SyncCheckpointer(config.model_copy(update={"loop": "asyncio"})).close()  # the spool lock was released


def _crash_before_commit(config: Config, state: dict[str, Any], step: int, **save: Any) -> None:
    """What a trainer killed after capture, with its commit not yet written, leaves: the
    spool and the root as they are then (the manifest write is held; the rest lands)."""
    root, spool_dir = Path(config.storage.url), Path(str(config.spool.dir))
    store = FaultyStorage(LocalStorage(root))
    store.hold_when = lambda name: name.endswith("manifest.json")
    ckpt = SyncCheckpointer(config, storage=store)
    try:
        ckpt.save(state, step=step, **save)  # returns once captured: the journal says so
        deadline = time.monotonic() + 10
        while True:
            journals = list(spool_dir.glob("*/journal.jsonl"))
            text = journals[0].read_text() if journals else ""
            if '"captured"' in text and text.count('"landed"') == text.count('"spooled"'):
                break
            assert time.monotonic() < deadline, f"no complete journal in {spool_dir}: {text[:200]!r}"
            time.sleep(0.01)
        kept = {folder: folder.with_name(folder.name + "-at-crash") for folder in (root, spool_dir)}
        for folder, copy in kept.items():
            copy.mkdir()
            if folder.exists():  # a save without tensor bytes has written nothing to the root
                shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("LOCK"), dirs_exist_ok=True)
    finally:
        with pytest.raises(TimeoutError):
            ckpt.close(timeout=0.1)
    for folder, copy in kept.items():
        shutil.rmtree(folder, ignore_errors=True)
        copy.rename(folder)


def _deepest_accepted(wrap: Any, state: dict[str, Any] | None = None, key: str = "cfg", **save: Any) -> Any:
    """The most levels of ``wrap`` around a leaf at ``state[key]`` that the planner takes."""
    from aiosnap.errors import UnsupportedStateError
    from aiosnap.trainer.plan import make_plan

    def nested(levels: int) -> Any:
        value: Any = 1
        for _ in range(levels):
            value = wrap(value)
        return value

    low, high = 1, 512  # accepted, refused
    while high - low > 1:
        mid = (low + high) // 2
        try:
            make_plan({**(state or {}), key: nested(mid)}, step=1, chunk_bytes=1 << 20, **save)
            low = mid
        except UnsupportedStateError:
            high = mid
    return nested(low)


@pytest.mark.thread_only  # wraps a storage in the trainer's process
@pytest.mark.parametrize("kind", ["no_tensor_bytes", "rank_local", "one_rank_dtensor", "deep"])
def test_a_crash_after_capture_loses_no_state_in_always_mode(tmp_path: Path, kind: str) -> None:
    """``spool.mode: always`` lost a save with no tensor bytes (no journal was started), and
    discarded a one-process save in the multi-rank format (``rank_local=``, DTensors of a
    one-device mesh) as "cannot be trusted" on resume; so it did deeply nested states that
    commit without a crash (the journal's spec went through pydantic's JSON parser, which
    stops at 200 levels, of the record's own nesting and the tree's)."""
    import torch.distributed as dist

    config = _local(tmp_path / "root", tmp_path / "spool", mode="always", resume=True)
    save: dict[str, Any] = {}
    state: dict[str, Any] = {"step": 7, "lr": 0.5, "name": "run", "empty": torch.empty(0)}
    if kind == "rank_local":
        state = {"w": torch.randn(3000), "rng": torch.get_rng_state(), "step": 7}
        save = {"rank_local": ["rng"]}
    elif kind == "deep":  # as deep as save() takes, whatever its bound: a rank-local value is a tree
        save = {"rank_local": ["rng"]}  # of its own, in the spec's distributed part, further down the journal
        state = {"cfg": _deepest_accepted(lambda v: {"k": v}), "w": torch.randn(3000), "rng": 2}
        state["rng"] = _deepest_accepted(lambda v: [v], state, "rng", **save)
    elif kind == "one_rank_dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        state = {"w": distribute_tensor(torch.randn(64, 4), mesh, [Shard(0)]), "step": 7}
    try:
        _crash_before_commit(config, state, 5, **save)
        with SyncCheckpointer(config) as ckpt:  # the next start resumes the spool
            assert ckpt.resume_report.resumed == [5], ckpt.resume_report
            restored = ckpt.load()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    expected = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    assert list(restored) == list(expected)
    for key, value in expected.items():
        assert torch.equal(restored[key], value) if isinstance(value, torch.Tensor) else restored[key] == value


def test_a_spill_waits_for_no_fsync_until_capture_ends_and_everything_is_durable_before_captured(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25: the spill's chunk files are written with their writeback started, not each
    fsynced in turn, and the records of spilled chunks are not fsynced one by one: before the
    journal's ``captured`` record (without which a crash discards the save) every chunk file,
    and their folder, is fsynced, and that record's fsync makes the earlier records durable.
    The same durability when save() returns, with no fsync in the spill's chain."""
    spool_dir = tmp_path / "spool"
    synced: list[tuple[str, str]] = []  # (path, the journal's last record kind when it is the journal)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(str(spool_dir)):
            last = ""
            if path.endswith(".jsonl"):  # lines "<crc32c> <JSON>"
                last = json.loads(Path(path).read_text().splitlines()[-1].split(" ", 1)[1])["kind"]
            synced.append((path, last))

    monkeypatch.setattr(os, "fsync", fsync)
    state = {"w": torch.randn(3 * MiB)}  # 12 MiB: three times the RAM budget
    with SyncCheckpointer(_local(root, spool_dir, mode="overflow")) as ckpt:
        handle = ckpt.save(state, step=1)
        journals = list(spool_dir.rglob("journal.jsonl"))
        assert len(journals) == 1, "spilled"
        folder = journals[0].parent
        on_disk = sorted(p.name for p in folder.glob("*.bin"))
        captured_at = next(i for i, (path, last) in enumerate(synced) if last == "captured")
        before = synced[:captured_at]
        chunk_fsyncs = sorted(Path(p).name for p, _ in before if p.endswith(".bin"))
        spilled = handle.wait(60).spooled_chunks
    assert spilled >= 4 and len(chunk_fsyncs) == spilled, "every spilled chunk fsynced before 'captured'"
    assert set(on_disk) <= set(chunk_fsyncs)
    assert (str(folder), "") in before, "their folder too: the names survive"
    assert (str(spool_dir), "") in before, "the spool folder too: the save's folder's own name survives"
    assert [p for p, _ in synced].count(str(spool_dir)) == 1, "once a save"
    assert all(last != "spooled" for _, last in synced), "no fsync for a spooled record on its own"
    with SyncCheckpointer(_local(root, tmp_path / "spool2")) as again:
        assert torch.equal(again.load()["w"], state["w"])


def test_a_preemption_while_the_spill_is_fsynced_journals_captured_once_after_the_fsyncs(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal's ``captured`` record is written once, after every file spilled during
    capture is fsynced, also when a preemption asks for it meanwhile (its keep_resumable
    waits for the attempt under way): it appended ``captured`` at once, while the files were
    still being fsynced, and a second ``captured`` followed (review of issue 25)."""
    spool_dir = tmp_path / "spool"
    real_fsync_file = durable.fsync_file
    early: list[bytes] = []

    def journals() -> list[Path]:
        return list(spool_dir.rglob("journal.jsonl"))

    def fsync_file(path: Any) -> None:  # the worker thread of the spill's fsyncs
        if not early:
            early.append(b"")
            (job,) = ckpt._engine._jobs.values()
            session = job.spooling.session
            ckpt._loop.loop.call_soon_threadsafe(ckpt._engine.preempted)
            deadline = time.monotonic() + 10
            while not session._resumable:  # the preemption reached this save
                assert time.monotonic() < deadline
                time.sleep(0.01)
            window = time.monotonic() + 0.5  # it would journal 'captured' within ms
            while time.monotonic() < window and not early[0]:
                early[0] = b"".join(p.read_bytes() for p in journals() if b'"captured"' in p.read_bytes())
                time.sleep(0.02)
        real_fsync_file(path)

    monkeypatch.setattr(durable, "fsync_file", fsync_file)
    config = _local(root, spool_dir, mode="always", resume=False)
    state = {"w": torch.randn(3 * MiB)}  # 12 MiB: twelve chunks, every one spilled
    with SyncCheckpointer(config) as ckpt:
        handle = ckpt.save(state, step=1)
        assert early, "the spill's fsyncs ran before captured"
        assert early[0] == b"", "'captured' was journalled while the spilled files were still being fsynced"
        (journal,) = journals()
        kinds = [json.loads(line.split(" ", 1)[1])["kind"] for line in journal.read_text().splitlines()]
        assert kinds.count("captured") == 1, kinds
        assert handle.wait(30).step == 1
        assert torch.equal(ckpt.load()["w"], state["w"])


def test_a_failed_fsync_of_a_spilled_chunk_is_named_as_such(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A chunk file's writeback error now shows at the fsync before ``captured``, not at the
    spill (the spill waits for no fsync, issue 25): the save goes on from its spool files
    without a ``captured`` record (a crash discards it, as the warning says), and the
    warning names the chunk file's fsync, not the journal (review of issue 25)."""
    spool_dir = tmp_path / "spool"
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/2.bin"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    state = {"w": torch.randn(3 * MiB)}
    with caplog.at_level("WARNING", logger="aiosnap"), SyncCheckpointer(_local(root, spool_dir, mode="always")) as ckpt:
        handle = ckpt.save(state, step=1)
        (journal,) = spool_dir.rglob("journal.jsonl")
        assert b'"captured"' not in journal.read_bytes()
        assert handle.wait(30).step == 1
        assert torch.equal(ckpt.load()["w"], state["w"])
    warned = [r.getMessage() for r in caplog.records if "step 1" in r.getMessage()]
    assert any("cannot fsync the spilled chunk file 2.bin" in m and "Input/output error" in m for m in warned), warned
    assert not any("cannot write the spool journal" in m for m in warned), warned
