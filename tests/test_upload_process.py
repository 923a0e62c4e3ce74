"""upload.executor: process -- the helper process's life, death and boundaries.

(The rest of the suite runs under both executors: modules marked ``both_executors``.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Checkpointer, Config, ConfigError, StepOrderError, SyncCheckpointer, UploadProcessError
from aiosnap.storage.local import LocalStorage
from tests.conftest import FaultyStorage, s3_config
from tests.spool_child import state as child_state

REPO = Path(__file__).parent.parent
MiB = 1024 * 1024


def _process(config: Config) -> Config:
    return config.model_copy(update={"upload": config.upload.model_copy(update={"executor": "process"})})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped yet) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _helper_pid(ckpt: Any) -> int:
    return int(ckpt._engine.transfer.pid)


def test_the_helper_starts_with_the_checkpointer_and_is_reaped_at_close(root: Path) -> None:
    ckpt = SyncCheckpointer(_process(Config(storage={"url": str(root)}, ram_budget="16MiB")))
    pid = _helper_pid(ckpt)
    assert _alive(pid)
    state = {"w": torch.randn(100_000)}
    ckpt.save(state, step=1).wait(30)
    assert _helper_pid(ckpt) == pid, "one long-lived helper, not one per save"
    assert torch.equal(ckpt.load()["w"], state["w"])
    ckpt.close()
    assert not _alive(pid) and not Path(f"/proc/{pid}").exists(), "exited and reaped: no zombie"


def test_a_killed_helper_fails_its_saves_and_the_next_save_starts_another(
    s3_endpoint: str, s3_bucket: str, proxy: Any
) -> None:
    config = _process(s3_config(proxy.url, s3_bucket))
    with SyncCheckpointer(config) as ckpt:
        ckpt.save({"w": torch.zeros(1000)}, step=1).wait(60)
        proxy.set_rate(2e6)  # 16 MB at 2 MB/s: the helper is killed mid-upload
        handle = ckpt.save({"w": torch.randn(4_000_000)}, step=2)
        pid = _helper_pid(ckpt)
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(UploadProcessError, match="died"):
            handle.wait(30)
        assert time.monotonic() - started < 5, "the death is noticed at once"
        proxy.clear()
        assert ckpt.steps() == [1] and torch.equal(ckpt.load()["w"], torch.zeros(1000)), "the previous step stands"
        ckpt.save({"w": torch.ones(1000)}, step=3).wait(60)  # a new helper
        assert _helper_pid(ckpt) != pid
        assert torch.equal(ckpt.load()["w"], torch.ones(1000))


def test_a_killed_trainer_takes_its_helper_along_and_the_spool_resumes(
    s3_endpoint: str, s3_bucket: str, proxy: Any, tmp_path: Path
) -> None:
    proxy.set_rate(2e6)
    base = _process(s3_config(proxy.url, s3_bucket).model_copy(update={"ram_budget": 8 * MiB}))
    config = base.model_copy(update={"spool": type(base.spool)(dir=str(tmp_path / "spool"), mode="always")})
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.spool_child", config.model_dump_json(), "6"],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    try:
        assert child.stdout is not None
        helper = int(child.stdout.readline().split()[1])
        assert child.stdout.readline().strip() == "CAPTURED"
        assert _alive(helper)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        if child.stdout is not None:
            child.stdout.close()
    deadline = time.monotonic() + 5
    while _alive(helper):
        assert time.monotonic() < deadline, "the helper outlived its trainer"
        time.sleep(0.05)
    proxy.clear()
    with SyncCheckpointer(config) as ckpt:
        assert ckpt.resume_report.resumed == [6]
        assert torch.equal(ckpt.load()["w"], child_state()["w"])


def _fds(pid: int) -> list[str]:
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:  # closed while we looked
            continue
    return sorted(found)


def test_ten_thousand_tensors_use_no_more_descriptors(root: Path) -> None:
    config = _process(Config(storage={"url": str(root)}, ram_budget="16MiB", upload={"chunk_size": "1MiB"}))
    state = {f"t{i}": torch.full((64,), float(i)) for i in range(10_000)}
    with SyncCheckpointer(config) as ckpt:
        helper = _helper_pid(ckpt)
        ckpt.save({"warm": torch.ones(10)}, step=1).wait(60)
        ours, theirs = _fds(os.getpid()), _fds(helper)
        for step in (2, 3):
            ckpt.save(state, step=step).wait(120)
        assert len(_fds(os.getpid())) <= len(ours) + 2 and len(_fds(helper)) <= len(theirs) + 2
        assert sum("aiosnap-staging" in fd for fd in _fds(helper)) <= 1, "one shared segment"
        restored = ckpt.load()
    assert all(torch.equal(restored[f"t{i}"], state[f"t{i}"]) for i in (0, 4321, 9999))


def test_the_ram_budget_holds_across_the_boundary(s3_endpoint: str, s3_bucket: str, proxy: Any) -> None:
    proxy.set_rate(16e6)
    config = _process(s3_config(proxy.url, s3_bucket).model_copy(update={"ram_budget": 8 * MiB}))
    state = {"w": torch.randn(8_000_000)}  # 32 MB through an 8 MiB budget
    with SyncCheckpointer(config) as ckpt:
        result = ckpt.save(state, step=1).wait(120)
        proxy.clear()
        assert torch.equal(ckpt.load()["w"], state["w"])
    assert 0 < result.ram_high_water <= 8 * MiB


async def test_a_cancelled_save_commits_nothing_in_process_mode(s3_endpoint: str, s3_bucket: str, proxy: Any) -> None:
    proxy.set_rate(4e6)  # capture must wait for uploads: 16 MB through a 4 MiB budget
    config = _process(s3_config(proxy.url, s3_bucket).model_copy(update={"ram_budget": 4 * MiB}))
    state = {"w": torch.zeros(4_000_000)}
    async with Checkpointer(config) as ckpt:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(ckpt.save(state, step=1), 0.5)
        state["w"].fill_(1.0)
        proxy.clear()
        await asyncio.sleep(1.0)
        assert await ckpt.steps() == []
        result = await (await ckpt.save({"w": torch.full((10,), 2.0)}, step=1))  # slabs came back
        assert result.step == 1 and ckpt.ram_high_water <= 4 * MiB


def test_a_storage_the_helper_cannot_open_is_a_clear_error(root: Path) -> None:
    store = FaultyStorage(LocalStorage(root), fail_when=lambda name: False)  # holds a lambda: no pickling
    with pytest.raises(ConfigError, match="cannot be pickled"):
        SyncCheckpointer(_process(Config(storage={"url": str(root)})), storage=store)


async def test_a_save_aborted_before_the_helper_read_its_begin_still_ends(root: Path) -> None:
    """A slow helper (starting up on a loaded machine) reads begin, the chunks and abort in
    one burst: the upload it starts is cancelled before it ever runs, and must still report
    its end, or the trainer waits for that save forever."""
    config = _process(Config(storage={"url": str(root)}, ram_budget="16MiB"))
    async with Checkpointer(config) as ckpt:
        pid = _helper_pid(ckpt)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):  # save() waits for RAM: the stopped helper holds every slab
                await asyncio.wait_for(ckpt.save({"w": torch.randn(8 * MiB)}, step=1), 0.3)
        finally:
            os.kill(pid, signal.SIGCONT)
        result = await asyncio.wait_for(await asyncio.wait_for(ckpt.save({"w": torch.ones(10)}, step=1), 20), 20)
        assert result.step == 1 and _helper_pid(ckpt) == pid
        assert await ckpt.steps() == [1]


# -- found by review: late slabs, a stopped helper at close(timeout), an S3 backend of its own,
#    a broken socket before the reader noticed, a forked child holding the socket


def test_slabs_staged_after_a_failed_save_come_back(root: Path) -> None:
    """The helper fails a save while capture still stages chunks; those come back after the
    save has ended, and must still free their slabs (they leaked until RAM ran out)."""
    from tests.process_faults import DataFailsBelowStep

    config = _process(Config(storage={"url": str(root)}, ram_budget="2MiB", upload={"chunk_size": "64KiB"}))
    with SyncCheckpointer(config, storage=DataFailsBelowStep(str(root), 5)) as ckpt:
        engine = ckpt._engine
        for step in range(1, 5):
            with pytest.raises(OSError, match="injected"):
                ckpt.save({"w": torch.randn(1_000_000)}, step=step).wait(30)
        deadline = time.monotonic() + 10
        while engine.budget.used and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.budget.used == 0 and engine._lent == {}
        assert ckpt.save({"w": torch.randn(1_000_000)}, step=5).wait(30).step == 5


def test_close_timeout_with_a_stopped_helper_returns(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiosnap.runtime import savejob

    monkeypatch.setattr(savejob, "ABORT_GRACE_S", 1.0)
    ckpt = SyncCheckpointer(_process(Config(storage={"url": str(root)}, ram_budget="16MiB")))
    pid = _helper_pid(ckpt)
    os.kill(pid, signal.SIGSTOP)
    try:
        handle = ckpt.save({"w": torch.randn(1000)}, step=1)  # returns after the preflight grace
        started = time.monotonic()
        with pytest.raises(TimeoutError):  # as documented (before: the killed helper's UploadProcessError)
            ckpt.close(timeout=1)
        assert time.monotonic() - started < 20
        with pytest.raises(UploadProcessError):
            handle.wait(5)
        assert not _alive(pid), "the helper that did not answer was killed"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_an_s3_backend_with_its_own_settings_is_the_one_the_helper_uses(
    s3_endpoint: str, s3_bucket: str, s3_client: Any
) -> None:
    from aiosnap.config import S3Config
    from aiosnap.storage.s3 import S3Storage

    nowhere = s3_config("http://127.0.0.1:9", s3_bucket).model_copy()  # the config's endpoint: nothing there
    nowhere = nowhere.model_copy(update={"s3": nowhere.s3.model_copy(update={"retry_deadline": 2.0})})
    own = S3Storage(s3_bucket, "own", S3Config(endpoint_url=s3_endpoint, addressing_style="path"))
    with SyncCheckpointer(_process(nowhere), storage=own) as ckpt:
        assert ckpt.save({"w": torch.arange(10)}, step=1).wait(30).step == 1
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    assert any(k.startswith("own/000000000001/") and k.endswith("manifest.json") for k in keys), keys


def test_a_save_into_a_socket_already_broken_fails_at_once_and_frees_its_slot(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiosnap.transfer import process

    deliver = process.ProcessTransfer._deliver

    def death_noticed_late(self: Any, callback: Any, *args: Any) -> None:  # a reader slow to report it
        if callback == self._lost:
            time.sleep(0.5)
        deliver(self, callback, *args)

    monkeypatch.setattr(process.ProcessTransfer, "_deliver", death_noticed_late)
    # and it dies right after save() checked it was alive: the begin goes into a broken socket
    monkeypatch.setattr(process.ProcessTransfer, "alive", lambda self: self.dead is None)
    ckpt = SyncCheckpointer(_process(Config(storage={"url": str(root)}, ram_budget="1MiB")))
    try:
        ckpt.save({"w": torch.randn(1000)}, step=1).wait(30)
        pid = _helper_pid(ckpt)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(UploadProcessError):
            ckpt.save({"w": torch.randn(1000)}, step=2).wait(10)
        assert ckpt._engine._jobs == {} and ckpt._engine.budget.used == 0
        assert ckpt.save({"w": torch.randn(1000)}, step=3).wait(30).step == 3  # a new helper, a free slot
    finally:
        ckpt.close()


def test_a_save_right_after_the_idle_helper_was_killed_goes_to_a_new_helper(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log promises that the next save starts a new upload process: also a save submitted
    in the moment after the death (the process still dying, or dead while its end of file is
    not reported yet), not only once the death was reported."""
    from aiosnap.transfer import process

    deliver = process.ProcessTransfer._deliver

    def death_noticed_late(self: Any, callback: Any, *args: Any) -> None:
        if callback == self._lost:
            time.sleep(0.3)
        deliver(self, callback, *args)

    with SyncCheckpointer(_process(Config(storage={"url": str(root)}, ram_budget="4MiB"))) as ckpt:
        ckpt.save({"w": torch.zeros(1000)}, step=1).wait(30)
        first = _helper_pid(ckpt)
        os.kill(first, signal.SIGKILL)
        ckpt.save({"w": torch.ones(1000)}, step=2).wait(30)  # submitted while it dies
        second = _helper_pid(ckpt)
        assert second != first
        monkeypatch.setattr(process.ProcessTransfer, "_deliver", death_noticed_late)
        os.kill(second, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(second) and time.monotonic() < deadline:
            time.sleep(0.005)
        ckpt.save({"w": torch.full((1000,), 3.0)}, step=3).wait(30)  # dead, not reported yet
        assert _helper_pid(ckpt) not in (first, second)
        assert ckpt.steps() == [1, 2, 3]
        assert torch.equal(ckpt.load()["w"], torch.full((1000,), 3.0))


def test_a_child_forked_from_the_trainer_does_not_keep_the_helper_alive(root: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from aiosnap import Config, SyncCheckpointer
        config = Config(storage={{"url": {str(root)!r}}}, ram_budget="16MiB", upload={{"executor": "process"}})
        ckpt = SyncCheckpointer(config)
        child = os.fork()
        if child == 0:  # a fork-started worker (DataLoader, multiprocessing) outliving the trainer
            time.sleep(30)
            os._exit(0)
        print(ckpt._engine.transfer.pid, child, flush=True)
        time.sleep(60)
        """
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    helper = child = None
    try:
        assert trainer.stdout is not None
        helper, child = (int(x) for x in trainer.stdout.readline().split())
        trainer.kill()
        trainer.wait(10)
        deadline = time.monotonic() + 10
        while _alive(helper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(helper), "the helper outlived its trainer"
    finally:
        for pid in (helper, child):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        if trainer.stdout is not None:
            trainer.stdout.close()


def test_a_helper_killed_after_its_commit_landed_reports_the_save_committed(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiosnap.runtime import savejob
    from tests.process_faults import WedgedAfterManifest

    monkeypatch.setattr(savejob, "ABORT_GRACE_S", 1.0)
    ckpt = SyncCheckpointer(
        _process(Config(storage={"url": str(root)}, ram_budget="16MiB")), storage=WedgedAfterManifest(str(root))
    )
    pid = _helper_pid(ckpt)
    try:
        handle = ckpt.save({"w": torch.arange(10)}, step=1)
        deadline = time.monotonic() + 20
        while not list(root.glob("*/manifest.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(TimeoutError):  # it had to cancel; the helper never answers: killed
            ckpt.close(timeout=0.5)
        assert handle.wait(5).step == 1
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_reports_sent_before_the_helper_died_are_heard_before_its_death(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiosnap.transfer import process

    deliver = process.ProcessTransfer._deliver

    def slow_reader(self: Any, callback: Any, *args: Any) -> None:  # a reader thread slow to get the CPU
        if args and args[0][0] == "finished":
            time.sleep(1.0)
        deliver(self, callback, *args)

    monkeypatch.setattr(process.ProcessTransfer, "_deliver", slow_reader)
    # its death is not seen before the send (it dies right after the check that it is alive)
    monkeypatch.setattr(process.ProcessTransfer, "alive", lambda self: self.dead is None)
    config = _process(Config(storage={"url": str(root)}, ram_budget="16MiB", max_pending_saves=2))
    with SyncCheckpointer(config) as ckpt:
        first = ckpt.save({"w": torch.arange(10)}, step=1)
        deadline = time.monotonic() + 20
        while not list(root.glob("*/manifest.json")) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # the helper has sent finished(committed) by now
        os.kill(_helper_pid(ckpt), signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(UploadProcessError):
            ckpt.save({"w": torch.arange(10)}, step=2).wait(10)  # its send hits the broken socket
        assert first.wait(10).step == 1  # committed, and the helper had said so


async def test_a_connected_s3_backend_still_goes_to_the_helper(s3_endpoint: str, s3_bucket: str) -> None:
    import pickle

    from aiosnap.config import S3Config
    from aiosnap.storage.s3 import S3Storage

    own = S3Storage(s3_bucket, "own", S3Config(endpoint_url=s3_endpoint, addressing_style="path"), concurrency=3)
    await own.write("probe", b"x")  # a live client inside now
    copy = pickle.loads(pickle.dumps(own))
    assert (copy.bucket, copy.prefix, copy.config, copy.concurrency) == (s3_bucket, "own", own.config, 3)
    assert await copy.read("probe") == b"x"
    await own.close()
    await copy.close()


def test_a_save_while_the_helper_still_starts_looks_at_a_file_root_itself(root: Path) -> None:
    """The step order is checked in save() by the trainer's own look at a file-system root,
    without waiting for the upload process to start (issue 25: the first save of a process
    executor waited for the helper's imports); the save commits once the helper runs."""
    ckpt = SyncCheckpointer(_process(Config(storage={"url": str(root)}, ram_budget="16MiB")))
    pid = _helper_pid(ckpt)
    os.kill(pid, signal.SIGSTOP)  # a helper that has not started serving (as one still importing)
    try:
        assert not ckpt._engine.transfer.ready
        handle = ckpt.save({"w": torch.ones(1000)}, step=1)
        (job,) = ckpt._engine._jobs.values()
        assert job.preflight.done() and job.preflight.result().latest is None, "looked without the helper"
        assert not handle.done()  # nothing could be uploaded: the helper is stopped
    finally:
        os.kill(pid, signal.SIGCONT)
    assert handle.wait(30).step == 1
    assert ckpt._engine.transfer.ready
    ckpt.close()
    ckpt = SyncCheckpointer(_process(Config(storage={"url": str(root)}, ram_budget="16MiB")))
    with pytest.raises(StepOrderError, match="older than the latest committed step 1"):
        ckpt.save({"w": torch.ones(1000)}, step=0)  # refused in save() however long the helper takes
    ckpt.close()


def test_a_stuck_look_of_the_trainer_holds_up_neither_the_handle_nor_the_next_save_nor_close(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's own look at a file root (made while the upload process still starts) is
    bounded: a listing that never returns (a stuck NFS mount, here a thread blocked on an
    event) is given up after ``PREFLIGHT_GRACE_S`` or once the helper's look is back; the
    save commits with the helper, and neither its handle, the next save nor close(timeout)
    waits for the stuck thread (review of issue 25: each waited for the listing)."""
    release = threading.Event()
    stuck: list[str] = []
    real = LocalStorage.list_children

    async def list_children(self: LocalStorage, prefix: str = "") -> list[str]:
        if not stuck:  # the first listing in this process is the trainer's look: it sticks
            stuck.append(threading.current_thread().name)
            await asyncio.to_thread(release.wait, 60)
        return await real(self, prefix)

    monkeypatch.setattr(LocalStorage, "list_children", list_children)
    ckpt = SyncCheckpointer(_process(Config(storage={"url": str(root)}, ram_budget="16MiB")))
    pid = _helper_pid(ckpt)
    os.kill(pid, signal.SIGSTOP)  # a helper that has not started serving (as one still importing)
    try:
        handle = ckpt.save({"w": torch.ones(1000)}, step=1)  # neither look back: checked before the commit
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        assert stuck, "the trainer looked itself"
        assert handle.wait(20).step == 1, "committed with the helper's own look"
        assert ckpt.save({"w": torch.zeros(1000)}, step=2).wait(20).step == 2
        started = time.monotonic()
        ckpt.close(timeout=20)
        assert time.monotonic() - started < 12, "close waited for the stuck listing (or the loop's closing did)"
    finally:
        release.set()
    with SyncCheckpointer(Config(storage={"url": str(root)})) as reader:
        assert reader.steps() == [1, 2] and torch.equal(reader.load()["w"], torch.zeros(1000))


def test_a_rank_whose_helper_still_starts_keeps_beating_from_the_trainer(root: Path) -> None:
    """A multi-rank save made while the upload process still starts: the trainer side's
    heartbeat goes on until the transfer side's own look at the root is back (its heartbeat
    then takes over). The trainer's own look (for one-process saves) is not made here: it
    answered within milliseconds, the trainer stopped beating, and the other ranks declared
    a rank stopped whose helper only started slowly (review of issue 25, on 2 gloo ranks:
    RankTimeoutError). One process in the multi-rank format (``rank_local``), as a rank."""
    config = _process(
        Config.model_validate({
            "storage": {"url": str(root)}, "ram_budget": "16MiB", "events": {"log": False},
            "distributed": {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.5},
        })
    )  # fmt: skip
    with SyncCheckpointer(config) as ckpt:
        pid = _helper_pid(ckpt)
        os.kill(pid, signal.SIGSTOP)  # a helper that has not started serving (as one still importing)
        try:
            handle = ckpt.save({"w": torch.ones(1000), "rank": 0}, step=1, rank_local=["rank"])
            (job,) = ckpt._engine._jobs.values()
            assert job.plan.spec.distributed is not None

            def beat() -> int:  # the marker is replaced whole
                found = list(root.glob("*/*/rank-0.alive"))
                return int(json.loads(found[0].read_bytes())["beat"]) if found else 0

            first, deadline = beat(), time.monotonic() + 10
            while beat() < first + 3:
                assert time.monotonic() < deadline, "the trainer stopped beating before its helper did"
                time.sleep(0.05)
            assert not job.preflight.done(), "nobody looked at the root but the stopped helper"
        finally:
            os.kill(pid, signal.SIGCONT)
        assert handle.wait(30).step == 1
