"""Saves you can watch: ``handle.progress()``, the line per save on stderr, the warning for a
state larger than the RAM budget, the live display and the ``aiosnap resume`` bar."""

from __future__ import annotations

import asyncio
import io
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Config, SyncCheckpointer
from aiosnap.cli import bytes_bar
from aiosnap.core.console import LiveDisplay
from aiosnap.core.progress import ProgressBoard, ProgressTracker, SaveProgress, report_sent
from aiosnap.interop.singlefile import ArchiveStorage
from aiosnap.storage.local import LocalStorage
from rich.console import Console
from rich.progress import TransferSpeedColumn
from tests.conftest import FaultyStorage, s3_config

MiB = 1024 * 1024

pytestmark = pytest.mark.both_executors


def _watch(handle: Any, timeout: float = 60) -> list[SaveProgress]:
    """Every distinct snapshot of ``handle.progress()`` until the save is over."""
    seen = [handle.progress()]
    deadline = time.monotonic() + timeout
    while not seen[-1].done:
        assert time.monotonic() < deadline, seen[-1]
        now = handle.progress()
        if (now.stage, now.uploaded_bytes) != (seen[-1].stage, seen[-1].uploaded_bytes):
            seen.append(now)
        time.sleep(0.002)
    return seen


def test_progress_follows_an_s3_upload_part_by_part(s3_endpoint: str, s3_bucket: str, proxy: Any) -> None:
    """The upload process reports too: bytes show as each 5 MiB part lands, not when a
    whole 12 MiB chunk has, and the rate is the link's, never a multiple of it."""
    cap = 24 * MiB
    proxy.set_rate(cap)
    base = s3_config(proxy.url, s3_bucket, part_concurrency=1, max_requests=1)
    config = base.model_copy(update={"upload": base.upload.model_copy(update={"concurrency": 1})})
    state = {"w": torch.randn(6 * MiB)}  # 24 MiB: two chunks of 12 MiB, three parts each
    chunk = config.upload.chunk_size
    with SyncCheckpointer(config) as ckpt:
        handle = ckpt.save(state, step=1)
        seen = _watch(handle)
        result = handle.wait()
    first, last = seen[0], seen[-1]
    assert first.captured_bytes == first.staged_bytes == first.total_bytes == result.nbytes
    assert first.spooled_bytes == 0 and first.stage in ("uploading", "committing")
    uploaded = [p.uploaded_bytes for p in seen]
    assert uploaded == sorted(uploaded)
    assert any(0 < n < result.nbytes and n % chunk for n in uploaded), uploaded  # within a chunk
    assert [p.stage for p in seen if p.stage != "uploading"][-2:] == ["committing", "committed"]
    assert last.done and last.uploaded_bytes == result.nbytes and last.fraction == 1.0
    assert last.upload_rate is not None and 0 < last.upload_rate <= cap * 1.3, last
    assert "step 1 committed: 24.0 of 24.0 MiB uploaded" in last.describe()


def test_a_line_per_save_on_stderr_and_a_failed_save_shows_failed(
    root: Path, faulty: FaultyStorage, capfd: pytest.CaptureFixture[str]
) -> None:
    config = Config(storage={"url": str(root)}, ram_budget="8MiB", events={"log": False})
    with SyncCheckpointer(config, storage=faulty) as ckpt:
        ckpt.save({"w": torch.randn(MiB // 2)}, step=1).wait()  # 2 MiB
        faulty.fail_when = lambda name: name.endswith(".bin")
        faulty.error = OSError(28, "No space left on device")
        failed = ckpt.save({"w": torch.randn(10)}, step=2)
        with pytest.raises(OSError, match="No space"):
            failed.wait()
        assert failed.progress().stage == "failed" and failed.progress().done
        ckpt.flush_events()
    lines = capfd.readouterr().err.splitlines()
    committed = [line for line in lines if " committed: " in line]
    assert len(committed) == 1
    assert committed[0].startswith("aiosnap: step 1 committed: 2 MiB in ")
    assert committed[0].endswith(f"/s) to {faulty.url}")
    assert any(line.startswith("aiosnap: step 2 failed: OSError: [Errno 28] No space left") for line in lines), lines


@pytest.mark.thread_only
def test_a_failed_save_is_one_line_on_stderr_with_the_default_settings(
    root: Path, faulty: FaultyStorage, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logging not set up (as in a plain script: pytest's own handlers cut off here): the
    failure is said once, by the line per save, not again through Python's last resort;
    an error message of whitespace only still gives its line."""
    monkeypatch.setattr(logging.getLogger("aiosnap.events"), "propagate", False)
    faulty.fail_when = lambda name: name.endswith(".bin")
    faulty.error = OSError(28, "No space left on device")
    with SyncCheckpointer(Config(storage={"url": str(root)}, ram_budget="8MiB"), storage=faulty) as ckpt:
        with pytest.raises(OSError, match="No space"):
            ckpt.save({"w": torch.randn(10)}, step=1).wait()
        faulty.error = RuntimeError(" \n ")
        with pytest.raises(RuntimeError):
            ckpt.save({"w": torch.randn(10)}, step=2).wait()
        ckpt.flush_events()
    lines = capfd.readouterr().err.splitlines()
    assert [line for line in lines if "step 1" in line] == [
        f"aiosnap: step 1 failed: OSError: [Errno 28] No space left on device ({faulty.url}; "
        "the latest committed step is unchanged)"
    ], lines
    assert [line for line in lines if "step 2" in line] == [
        f"aiosnap: step 2 failed: RuntimeError:  ({faulty.url}; the latest committed step is unchanged)"
    ], lines
    assert not [line for line in lines if "handler" in line], lines


class _HalfThenFails(LocalStorage):
    """Local storage whose write of chunk 0 sends half of it, then fails once the test has
    seen that half (``seen``)."""

    seen = threading.Event()

    async def write(self, name: str, data: Any, *, if_absent: bool = False) -> None:
        if name.endswith("/0.bin"):
            report_sent(memoryview(data).nbytes // 2)
            await asyncio.to_thread(self.seen.wait, 30)
            raise OSError(5, "I/O error")
        await super().write(name, data, if_absent=if_absent)


@pytest.mark.thread_only
def test_byte_counts_only_grow_and_count_the_states_bytes(root: Path, tmp_path: Path) -> None:
    """Odd-sized tensors (padding between them in a data object; a single file's zip
    headers): captured and uploaded reach the state's bytes exactly, never more; and a
    chunk half sent when its save fails keeps its half counted."""
    state = {f"t{i}": torch.randn(1000 + 7 * i) for i in range(40)}
    state["big"] = torch.randn(300_001)
    config = Config(
        storage={"url": str(root)}, ram_budget="4MiB", upload={"chunk_size": "256KiB", "concurrency": 1},
        events={"log": False, "stderr": False},
    )  # fmt: skip
    with SyncCheckpointer(config) as ckpt:
        single = ckpt.at(str(tmp_path / "one.ckpt"), storage=ArchiveStorage(str(tmp_path / "one.ckpt")))
        for where in (ckpt, single):
            handle = where.save(state, step=1)
            seen = _watch(handle)
            result = handle.wait()
            assert all(p.captured_bytes <= p.total_bytes and p.uploaded_bytes <= p.total_bytes for p in seen), seen
            last = seen[-1]
            assert last.captured_bytes == last.staged_bytes == last.uploaded_bytes == last.total_bytes == result.nbytes
    storage = _HalfThenFails(str(tmp_path / "failing"))
    _HalfThenFails.seen.clear()
    config = config.model_copy(update={"storage": config.storage.model_copy(update={"url": storage.url})})
    with SyncCheckpointer(config, storage=storage) as ckpt:
        handle = ckpt.save({"w": torch.randn(2 * 65536)}, step=1)  # two chunks of 256 KiB
        deadline = time.monotonic() + 30
        while handle.progress().uploaded_bytes < 128 * 1024:
            assert time.monotonic() < deadline, handle.progress()
            time.sleep(0.002)
        most = handle.progress().uploaded_bytes
        _HalfThenFails.seen.set()
        with pytest.raises(OSError, match="I/O error"):
            handle.wait()
    assert handle.progress().stage == "failed" and handle.progress().uploaded_bytes >= most


@pytest.mark.thread_only
def test_the_line_per_save_can_be_turned_off(root: Path, capfd: pytest.CaptureFixture[str]) -> None:
    config = Config(storage={"url": str(root)}, events={"log": False, "stderr": False})
    with SyncCheckpointer(config) as ckpt:
        ckpt.save({"w": torch.randn(10)}, step=1).wait()
    assert "aiosnap" not in capfd.readouterr().err


@pytest.mark.thread_only
def test_a_state_larger_than_the_budget_without_spool_is_said_once(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = {"w": torch.randn(MiB)}  # 4 MiB against a 1 MiB budget
    config = Config(storage={"url": str(root)}, ram_budget="1MiB", upload={"chunk_size": "256KiB"})
    with caplog.at_level(logging.WARNING, logger="aiosnap"), SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=1).wait()
        ckpt.save(state, step=2).wait()
    said = [r.getMessage() for r in caplog.records if "larger than the RAM budget" in r.getMessage()]
    assert len(said) == 1 and "no spool is configured" in said[0] and "step 1 (4.0 MiB)" in said[0], said
    caplog.clear()
    spooled = config.model_copy(update={"spool": config.spool.model_copy(update={"dir": str(tmp_path / "spool")})})
    with caplog.at_level(logging.WARNING, logger="aiosnap"), SyncCheckpointer(spooled) as ckpt:
        handle = ckpt.save(state, step=3)
        result = handle.wait()
    assert not [r for r in caplog.records if "larger than the RAM budget" in r.getMessage()]
    progress = handle.progress()
    assert progress.spooled_bytes > 0 and progress.staged_bytes + progress.spooled_bytes == progress.captured_bytes
    assert result.spooled_chunks > 0


@pytest.mark.thread_only
def test_the_live_display_shows_long_saves_on_a_terminal_only() -> None:
    board = ProgressBoard()
    tracker = ProgressTracker(7, 10 * MiB, started=time.perf_counter() - 3)  # running for 3 s
    tracker.stage("uploading")
    tracker.captured(10 * MiB, spooled=False)
    tracker.sending(0, 4 * MiB, 10 * MiB)
    board.add(tracker)
    piped = LiveDisplay(board, Console(file=io.StringIO(), force_terminal=False))
    assert not piped.running
    screen = io.StringIO()
    display = LiveDisplay(board, Console(file=screen, force_terminal=True, width=120, color_system=None))
    try:
        deadline = time.monotonic() + 10
        while "aiosnap step 7 uploading" not in screen.getvalue() or "4.0/10.0 MiB" not in screen.getvalue():
            assert time.monotonic() < deadline, screen.getvalue()
            time.sleep(0.02)
    finally:
        display.close()
    assert not display.running


@pytest.mark.thread_only
def test_the_resume_bar_knows_its_total_from_the_start_and_shows_the_real_rate() -> None:
    """The reported case: nothing landed for 9 s (eight chunks uploading side by side), then
    all of them within 3.5 s. Rich's own speed column showed 14x the real rate."""
    total = 503 * 1000 * 1000
    clock = [0.0]
    screen = io.StringIO()
    bar = bytes_bar(Console(file=screen, force_terminal=True, width=120, color_system=None), get_time=lambda: clock[0])
    task = bar.add_task("uploading spooled chunks", total=None)
    bar.update(task, total=total)  # aiosnap resume's callback, on the report of the total (before any byte)
    bar.advance(task, 0)
    for second in (9.0, 10.0, 11.0, 12.0):
        clock[0] = second
        bar.advance(task, total // 4)
    clock[0] = 12.5
    columns = bar.columns
    rate = columns[3].render(bar.tasks[0]).plain
    rich_rate = TransferSpeedColumn().render(bar.tasks[0]).plain
    assert rate == "38.4 MiB/s", rate  # 503 MB in 12.5 s
    assert rich_rate != rate  # what the bar used to show


@pytest.mark.thread_only
def test_resume_reports_its_total_before_the_first_byte(
    crashed_spool: tuple[Path, Path, Config, dict[str, Any]],
) -> None:
    import shutil

    spool_copy, root_copy, config, _ = crashed_spool
    shutil.rmtree(config.storage.url)
    shutil.copytree(root_copy, config.storage.url)
    assert config.spool.dir is not None
    shutil.rmtree(config.spool.dir)
    shutil.copytree(spool_copy, config.spool.dir)
    calls: list[tuple[int, int]] = []
    with SyncCheckpointer(config) as ckpt:
        report = ckpt.resume_spool(lambda nbytes, total: calls.append((nbytes, total)))
    assert report.resumed == [4]
    first_total = calls[0][1]
    assert calls[0] == (0, first_total) and first_total > 0
    assert sum(n for n, _ in calls) == first_total and {t for _, t in calls} == {first_total}
