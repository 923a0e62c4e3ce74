"""The spool and its resume trust nothing they did not check: live saves are not leftovers,
landed objects are verified, journals of other roots are left alone, a spool file goes only
once the journal says its chunk landed, and a process killed right after save() returned
loses nothing."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
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
from aiosnap import Config, SyncCheckpointer
from aiosnap.core.arena import Arena
from aiosnap.core.budget import ByteBudget
from aiosnap.core.names import step_dir
from aiosnap.format.journal import JOURNAL
from aiosnap.handoff.spooldir import Spool
from aiosnap.storage.local import LocalStorage
from aiosnap.trainer.plan import make_plan
from aiosnap.trainer.slabs import SlabPool
from aiosnap.trainer.spool import SpoolSession
from tests.conftest import FaultyStorage, assert_same
from tests.spool_child import state as child_state

pytestmark = pytest.mark.both_executors

REPO = Path(__file__).parent.parent
Crashed = tuple[Path, Path, Config, dict[str, Any]]


def _spool_config(root: Path, spool_dir: Path, **extra: Any) -> Config:
    return Config(
        storage={"url": str(root)},
        ram_budget="1MiB",
        upload={"chunk_size": "64KiB", "concurrency": 2},
        spool={"dir": str(spool_dir), "mode": "always"},
        **extra,
    )


def _play_the_crash(crashed: Crashed) -> Config:
    """Put the spool and storage back as the crash left them."""
    spool_template, root_template, config, _ = crashed
    for folder, template in ((Path(str(config.spool.dir)), spool_template), (Path(config.storage.url), root_template)):
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(template, folder)
    return config.model_copy(update={"spool": config.spool.model_copy(update={"resume": True})})


@pytest.mark.thread_only  # wraps a storage in the trainer's process
def test_resume_never_touches_a_save_still_running(tmp_path: Path) -> None:
    root, spool_dir = tmp_path / "ckpt", tmp_path / "spool"
    config = _spool_config(root, spool_dir, max_pending_saves=1)
    store = FaultyStorage(LocalStorage(root))
    store.hold_when = lambda name: not name.endswith("/0.bin")  # one chunk lands, the rest wait
    state = {"w": torch.randn(60_000)}
    with SyncCheckpointer(config, storage=store) as ckpt:
        handle = ckpt.save(state, step=1)
        deadline = time.monotonic() + 10
        while not any(name.endswith("/0.bin") for name in store.writes):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        reports: list[Any] = []
        resume = threading.Thread(target=lambda: reports.append(ckpt.resume_spool()))
        resume.start()  # it waits for the save in flight to this root, never touches it
        resume.join(0.3)
        assert resume.is_alive() and not handle.done()
        store.release(ckpt._loop.loop)
        assert handle.wait(10).step == 1
        resume.join(20)
        report = reports[0]
        assert (report.resumed, report.discarded, report.failed, report.skipped) == ([], [], [], [])
        assert_same(ckpt.load(), state)
    assert not [p for p in spool_dir.rglob("*") if p.is_file() and p.name != "LOCK"]


@pytest.mark.thread_only  # the crash is played from a template, whatever the executor
def test_landed_objects_removed_meanwhile_are_never_committed_over(crashed_spool: Crashed) -> None:
    config = _play_the_crash(crashed_spool)
    root = Path(config.storage.url)
    no_spool = config.model_copy(update={"spool": type(config.spool)(), "retention": type(config.retention)()})
    with SyncCheckpointer(no_spool) as ckpt:  # an older good step, which retention would delete
        ckpt.save({"w": torch.zeros(3)}, step=2).wait()
    landed = sorted((root / step_dir(4)).rglob("0.bin"))
    assert len(landed) == 1
    landed[0].unlink()  # `aiosnap gc` removed the incomplete step's objects
    with SyncCheckpointer(config) as ckpt:
        report = ckpt.resume_report
        assert report.resumed == []
        assert len(report.discarded) == 1 and "gone from storage" in report.discarded[0][1]
        assert ckpt.steps() == [2], "no manifest over a missing object, no retention"
        assert torch.equal(ckpt.load()["w"], torch.zeros(3))


@pytest.mark.thread_only  # the crash is played from a template, whatever the executor
def test_the_crashed_save_resumes_when_all_is_there(crashed_spool: Crashed) -> None:
    config = _play_the_crash(crashed_spool)
    with SyncCheckpointer(config) as ckpt:
        assert ckpt.resume_report.resumed == [4]
        assert_same(ckpt.load(), crashed_spool[3])


@pytest.mark.thread_only  # the crash is played from a template, whatever the executor
def test_a_journal_of_another_root_is_left_alone(crashed_spool: Crashed, tmp_path: Path) -> None:
    config = _play_the_crash(crashed_spool)
    elsewhere = config.model_copy(update={"storage": type(config.storage)(url=str(tmp_path / "other"))})
    with SyncCheckpointer(elsewhere) as ckpt:
        report = ckpt.resume_report
        assert report.resumed == [] and report.discarded == []
        assert len(report.skipped) == 1 and "belongs to the checkpointer of" in report.skipped[0][1]
        assert ckpt.steps() == []
    assert any(Path(str(config.spool.dir)).glob(f"*/{JOURNAL}")), "kept for its own checkpointer"
    with SyncCheckpointer(config) as ckpt:
        assert ckpt.resume_report.resumed == [4]


def test_a_spool_file_goes_only_after_the_journal_says_it_landed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool_dir = tmp_path / "spool"
    checked: list[str] = []
    real_unlink = pathlib.Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.suffix == ".bin" and spool_dir in self.parents:
            journal = (self.parent / JOURNAL).read_text().splitlines()
            records = [json.loads(line.split(" ", 1)[1]) for line in journal]
            chunk = int(self.stem)
            assert {"kind": "landed", "chunk": chunk} in [{k: r.get(k) for k in ("kind", "chunk")} for r in records]
            checked.append(self.name)
        real_unlink(self, missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    config = _spool_config(tmp_path / "ckpt", spool_dir, max_pending_saves=2)
    with SyncCheckpointer(config) as ckpt:
        handles = [ckpt.save({"w": torch.randn(50_000)}, step=s) for s in (1, 2, 3)]
        for handle in handles:
            handle.wait(30)
    assert len(checked) >= 12


def test_killed_right_after_save_returned_is_always_resumed(tmp_path: Path) -> None:
    expected = child_state()
    for trial in range(3):
        root, spool_dir = tmp_path / f"ckpt{trial}", tmp_path / f"spool{trial}"
        config = Config(
            storage={"url": str(root)},
            ram_budget="8MiB",
            upload={"chunk_size": "1MiB", "concurrency": 4},
            spool={"dir": str(spool_dir), "mode": "always"},
        )
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.spool_child", config.model_dump_json(), "5"],
            stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ),
        )  # fmt: skip
        try:
            assert child.stdout is not None
            line = child.stdout.readline()
            if line.startswith("HELPER"):
                line = child.stdout.readline()
            assert line.strip() == "CAPTURED"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
            if child.stdout is not None:
                child.stdout.close()
        with SyncCheckpointer(config) as ckpt:
            report = ckpt.resume_report
            assert ckpt.steps() == [5], f"trial {trial}: lost the step ({report})"
            restored = ckpt.load()
        assert torch.equal(restored["w"], expected["w"]) and torch.equal(restored["b"], expected["b"])


async def test_a_save_cancelled_while_waiting_for_ram_returns_its_disk_budget(tmp_path: Path) -> None:
    config = _spool_config(tmp_path / "ckpt", tmp_path / "spool")
    spool = Spool.open(config.spool, min_bytes=64 * 1024)
    assert spool is not None
    try:
        arena = Arena(64 * 1024, 1, shared=False)
        pool = SlabPool(arena, ByteBudget(arena.size, "ram_budget"))
        slab = await pool.acquire()  # RAM is exhausted: the next slab must wait
        plan = make_plan({"w": torch.randn(1000)}, step=1, chunk_bytes=64 * 1024)
        session = SpoolSession(spool, plan, str(tmp_path / "ckpt"), str(tmp_path / "ckpt"), pool, None, None)

        async def copy(buffer: torch.Tensor) -> None:
            raise AssertionError("never reached")

        task = asyncio.ensure_future(session.capture(plan.chunks[0], copy))
        await asyncio.sleep(0.05)
        assert spool.budget.used > 0  # disk reserved, waiting for a slab
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert spool.budget.used == 0, "the disk budget came back"
        pool.release(slab)
        await session.finish()
        pool.close()
        del pool
        arena.close()
    finally:
        spool.close()


@pytest.mark.thread_only  # the crash is played from a template, whatever the executor
def test_a_journal_pointing_at_another_root_never_touches_it(crashed_spool: Crashed, tmp_path: Path) -> None:
    import crc32c

    config = _play_the_crash(crashed_spool)
    victim = tmp_path / "victim"
    with SyncCheckpointer(str(victim)) as other:
        for step in (1, 2, 3):
            other.save({"v": torch.ones(2)}, step=step).wait()
    journal = next(Path(str(config.spool.dir)).glob(f"*/{JOURNAL}"))
    lines = journal.read_bytes().split(b"\n")
    begin = json.loads(lines[0].split(b" ", 1)[1])
    begin.update(storage_url=str(victim), keep_last=1)  # a hand-edited journal, checksum recomputed
    body = json.dumps(begin).encode()
    lines[0] = f"{crc32c.crc32c(body):08x}".encode() + b" " + body
    journal.write_bytes(b"\n".join(lines))
    with SyncCheckpointer(config) as ckpt:
        assert ckpt.resume_report.resumed == [] and len(ckpt.resume_report.skipped) == 1
    with SyncCheckpointer(str(victim)) as other:
        assert other.steps() == [1, 2, 3], "nothing committed or deleted elsewhere"


@pytest.mark.thread_only  # wraps a storage in the trainer's process
async def test_cancelled_saves_leave_no_empty_spool_folders(tmp_path: Path) -> None:
    config = _spool_config(tmp_path / "ckpt", tmp_path / "spool")
    store = FaultyStorage(LocalStorage(tmp_path / "ckpt"))
    store.delay = 0.01
    from aiosnap import Checkpointer

    async with Checkpointer(config, storage=store) as ckpt:
        for step in range(1, 21):
            try:
                handle = await asyncio.wait_for(ckpt.save({"w": torch.randn(100_000)}, step=step), 0.001 * step)
                await handle
            except TimeoutError:
                pass
    assert [p.name for p in (tmp_path / "spool").iterdir()] == ["LOCK"]


@pytest.mark.thread_only  # wraps the journal's writer in the trainer's process
async def test_a_save_cancelled_while_its_journal_is_written_is_never_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save without tensor bytes (``always`` mode: all of it is in its journal), cancelled
    while its one journal append runs on a worker thread: the abort cancels its capture a
    second time, which gave up waiting for the thread; the spool folder was removed, the
    thread then wrote ``begin`` and ``captured`` into a new one, and the next start resumed
    and committed the save whose caller had seen it cancelled."""
    import threading

    from aiosnap import Checkpointer
    from aiosnap.format import journal

    config = _spool_config(tmp_path / "ckpt", tmp_path / "spool")
    real_append, real_discard = journal._append, Spool.discard
    held, release, appended, discarded = (threading.Event() for _ in range(4))

    def held_append(path: pathlib.Path, data: bytes, create: bool, sync: bool) -> None:
        if not (b'"begin"' in data and b'"captured"' in data) or held.is_set():  # step 2's one append
            return real_append(path, data, create, sync)
        held.set()
        release.wait(10)
        try:
            real_append(path, data, create, sync)
        finally:
            appended.set()

    async def discard_then_let_it_land(self: Spool, save_id: str) -> None:
        await real_discard(self, save_id)
        if held.is_set() and not release.is_set():  # the cleanup ran while the append was held
            discarded.set()
            release.set()
            await asyncio.to_thread(appended.wait, 10)  # what a thread left running writes now

    monkeypatch.setattr(journal, "_append", held_append)
    monkeypatch.setattr(Spool, "discard", discard_then_let_it_land)
    async with Checkpointer(config) as ckpt:
        await (await ckpt.save({"w": torch.ones(2)}, step=1))
        task = asyncio.ensure_future(ckpt.save({"n": 2, "name": "run"}, step=2))
        assert await asyncio.to_thread(held.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the cleanup must wait for the append; if it does not, it runs within this wait
        if not await asyncio.to_thread(discarded.wait, 0.3):
            release.set()
        assert await ckpt.steps() == [1]
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "spool").iterdir()] == ["LOCK"], "a journal outlived its save"
    resuming = config.model_copy(update={"spool": config.spool.model_copy(update={"resume": True})})
    with SyncCheckpointer(resuming) as ckpt:
        assert ckpt.resume_report.resumed == [] and ckpt.steps() == [1]


@pytest.mark.thread_only  # the trainer's side alone
async def test_a_finished_session_never_writes_its_journal_again(tmp_path: Path) -> None:
    """Whatever still runs when a save is over (a late record) writes nothing: the journal
    would start a new folder after the cleanup, and the next start would resume it."""
    config = _spool_config(tmp_path / "ckpt", tmp_path / "spool")
    spool = Spool.open(config.spool, min_bytes=64 * 1024)
    assert spool is not None
    arena = Arena(64 * 1024, 1, shared=False)
    pool = SlabPool(arena, ByteBudget(arena.size, "ram_budget"))
    try:
        plan = make_plan({"n": 1}, step=1, chunk_bytes=64 * 1024)  # nothing to spill: all in its journal
        session = SpoolSession(spool, plan, str(tmp_path / "ckpt"), str(tmp_path / "ckpt"), pool, None, None)
        await session.finish()
        await session.captured()
        await session.done_with(0, [0])
        assert not spool.save_dir(plan.save_id).exists()
    finally:
        pool.close()
        del pool
        arena.close()
        spool.close()
