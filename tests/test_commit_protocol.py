"""The commit protocol under the unhappy paths: an ambiguous commit, a cancelled save(), a
rollback, a second writer, a store that is down."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import time
from pathlib import Path

import pytest
import torch
from aiosnap import Checkpointer, Config, StepOrderError, SyncCheckpointer
from aiosnap.core.names import MANIFEST_FILE, step_dir
from aiosnap.storage.local import LocalStorage
from tests.conftest import FaultyStorage

pytestmark = pytest.mark.both_executors


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def _attempts(root: Path, step: int) -> list[str]:
    folder = root / step_dir(step)
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.exists() else []


# -- 1. once the manifest write has started, data goes only if the manifest is provably not ours


def test_manifest_that_landed_while_its_answer_was_lost_is_a_commit(
    small_config: Config, faulty: FaultyStorage, root: Path
) -> None:
    state = {"w": torch.randn(40_000)}
    faulty.lose_answer_when = lambda name: name.endswith(MANIFEST_FILE)
    faulty.error = ConnectionResetError("the answer to the manifest PUT was lost (injected)")
    with SyncCheckpointer(small_config, storage=faulty) as ckpt:
        result = ckpt.save(state, step=3).wait(30)  # read back: the manifest is this attempt's
        assert result.step == 3
        assert ckpt.steps() == [3]
        assert torch.equal(ckpt.load()["w"], state["w"]), "the data of a committed step is never removed"


def test_close_timeout_during_the_manifest_write_keeps_the_committed_data(
    small_config: Config, faulty: FaultyStorage
) -> None:
    state = {"w": torch.randn(40_000)}
    faulty.hang_after_write_when = lambda name: name.endswith(MANIFEST_FILE)
    ckpt = SyncCheckpointer(small_config, storage=faulty)
    handle = ckpt.save(state, step=5)
    deadline = time.monotonic() + 10
    while not any(name.endswith(MANIFEST_FILE) for name in faulty.writes):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(TimeoutError, match="cancelled"):
        ckpt.close(timeout=0.2)
    assert handle.done() and handle.wait().step == 5, "it committed: the handle says so"
    with SyncCheckpointer(small_config) as reader:
        assert reader.steps() == [5]
        assert torch.equal(reader.load()["w"], state["w"])


@pytest.mark.thread_only  # wraps a storage in the trainer's process
def test_an_undecidable_commit_leaves_the_data_for_gc(small_config: Config, faulty: FaultyStorage, root: Path) -> None:
    store = FaultyStorage(LocalStorage(root))
    store.settled_writes = False  # like S3: an abandoned request may still land later
    state = {"w": torch.randn(40_000)}
    store.lose_answer_when = lambda name: name.endswith(MANIFEST_FILE)
    store.error = ConnectionResetError("the answer was lost (injected)")
    store.read_error = ConnectionRefusedError("the store went down (injected)")  # no read-back possible
    ckpt = SyncCheckpointer(small_config, storage=store)
    with pytest.raises(ConnectionResetError):
        ckpt.save(state, step=2).wait(30)
    ckpt.close()
    assert (root / step_dir(2) / MANIFEST_FILE).exists()
    with SyncCheckpointer(small_config) as reader:  # the store is back: the step is whole
        assert reader.steps() == [2]
        assert torch.equal(reader.load()["w"], state["w"])


def test_a_manifest_write_that_failed_before_landing_removes_the_attempt(
    small_config: Config, faulty: FaultyStorage, root: Path
) -> None:
    faulty.fail_when = lambda name: name.endswith(MANIFEST_FILE)
    faulty.error = OSError(errno.ENOSPC, "No space left on device (injected)")
    ckpt = SyncCheckpointer(small_config, storage=faulty)
    with pytest.raises(OSError, match="No space"):
        ckpt.save({"w": torch.randn(40_000)}, step=2).wait(30)
    ckpt.close()
    assert _files(root / step_dir(2)) == [], "a local write that raised did not land: our data goes"


# -- 2. cancelling save() before it returned aborts that save


async def test_cancelled_async_save_commits_nothing(small_config: Config, faulty: FaultyStorage, root: Path) -> None:
    faulty.delay = 0.05  # capture must wait for uploads: 4 MB through a 1 MiB budget
    state = {"w": torch.zeros(1_000_000)}
    async with Checkpointer(small_config, storage=faulty) as ckpt:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(ckpt.save(state, step=1), 0.2)
        state["w"].fill_(1.0)  # training goes on and mutates the state
        await asyncio.sleep(1.0)  # whatever was in flight has had time to finish
        assert await ckpt.steps() == [], "nothing committed: no torn checkpoint"
        handle = await ckpt.save({"w": torch.full((1_000,), 2.0)}, step=1)
        result = await handle  # budgets and slabs came back: the next save works
        assert ckpt.ram_high_water <= 1024**2
    attempts = {p.parent.parent.name for p in _files(root / step_dir(1)) if p.suffix == ".bin"}
    assert attempts == {result.save_id}, "the aborted attempt's objects are removed"


def test_sync_save_interrupted_by_a_signal_commits_nothing(small_config: Config, faulty: FaultyStorage) -> None:
    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    faulty.delay = 0.05
    state = {"w": torch.zeros(1_000_000)}
    previous = signal.signal(signal.SIGALRM, interrupt)
    ckpt = SyncCheckpointer(small_config, storage=faulty)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            ckpt.save(state, step=1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    state["w"].fill_(1.0)
    time.sleep(1.0)
    assert ckpt.steps() == []
    ckpt.close()
    assert ckpt._engine.budget.used == 0, "every slab returned and freed"


# -- 5. steps only move forward; rollback() is the way back


def test_an_older_step_is_refused_in_save_and_rollback_makes_a_new_branch(root: Path) -> None:
    config = Config(storage={"url": str(root)}, retention={"keep_last": 2})
    with SyncCheckpointer(config) as ckpt:
        for step in (100, 200, 300):
            ckpt.save({"x": torch.full((3,), float(step))}, step=step).wait()
        assert ckpt.steps() == [200, 300]
        ckpt.load(step=200)
        with pytest.raises(StepOrderError, match=r"step 210 is older than the latest committed step 300") as info:
            ckpt.save({"x": torch.full((3,), 210.0)}, step=210)  # refused by save() itself
        assert "rollback(" in str(info.value)
        assert ckpt.steps() == [200, 300]

        assert ckpt.rollback(200) == [300]
        for step in (210, 220, 230):
            ckpt.save({"x": torch.full((3,), float(step))}, step=step).wait()
        assert ckpt.steps() == [220, 230]
        assert torch.equal(ckpt.load()["x"], torch.full((3,), 230.0)), "load() returns the new branch"


def test_a_step_already_being_saved_is_refused(small_config: Config, faulty: FaultyStorage) -> None:
    config = small_config.model_copy(update={"max_pending_saves": 2})
    with SyncCheckpointer(config, storage=faulty) as ckpt:
        faulty.hold()
        first = ckpt.save({"x": torch.ones(3)}, step=7)
        with pytest.raises(StepOrderError, match="already being saved"):
            ckpt.save({"x": torch.ones(3)}, step=7)
        with pytest.raises(StepOrderError, match="older than step 7"):
            ckpt.save({"x": torch.ones(3)}, step=6)
        faulty.release(ckpt._loop.loop)
        assert first.wait(10).step == 7


# -- 7. a store that is down is reported within the deadline, cleanup comes after


def test_failure_is_reported_before_the_slow_cleanup(small_config: Config, faulty: FaultyStorage, root: Path) -> None:
    faulty.hold()
    faulty.fail_when = lambda name: name.endswith(".bin")
    faulty.error = ConnectionResetError("the store is down (injected)")
    faulty.delete_delay = 3.0  # removing the failed attempt is slow
    ckpt = SyncCheckpointer(small_config, storage=faulty)
    handle = ckpt.save({"w": torch.randn(40_000)}, step=1)
    started = time.monotonic()
    faulty.release(ckpt._loop.loop)
    with pytest.raises(ConnectionResetError):
        handle.wait(30)
    assert time.monotonic() - started < 1.5, "reported without waiting for the cleanup"
    ckpt.close()  # waits (bounded) for the cleanup
    assert _files(root / step_dir(1)) == []


# -- 8. a second writer: decided at the start, never deletes what it does not own


@pytest.mark.thread_only  # wraps a storage in the trainer's process
def test_second_writer_of_a_new_step_fails_and_never_touches_the_first(small_config: Config, root: Path) -> None:
    first_store, second_store = FaultyStorage(LocalStorage(root)), FaultyStorage(LocalStorage(root))
    first = SyncCheckpointer(small_config, storage=first_store)
    second = SyncCheckpointer(small_config, storage=second_store)
    try:
        first_store.hold()
        second_store.hold_when = lambda name: name.endswith(("/3.bin", MANIFEST_FILE))
        a = first.save({"x": torch.zeros(50_000)}, step=5)  # both decide "new step 5"
        b = second.save({"x": torch.ones(50_000)}, step=5)
        deadline = time.monotonic() + 10
        while len(second_store.writes) < 3:  # the second writer is mid-upload ...
            assert time.monotonic() < deadline
            time.sleep(0.01)
        first_store.release(first._loop.loop)
        ours = a.wait(10).save_id  # ... when the first commits
        theirs = [s for s in _attempts(root, 5) if s != ours]
        assert len(theirs) == 1 and len(_files(root / step_dir(5) / theirs[0])) == 3, "the rival's data is untouched"
        second_store.release(second._loop.loop)
        with pytest.raises(FileExistsError, match="committed by another writer"):
            b.wait(10)
    finally:
        first.close()
        second.close()
    assert _attempts(root, 5) == [ours], "the loser removed its own attempt, nothing else"
    with SyncCheckpointer(small_config) as reader:
        assert torch.equal(reader.load(step=5)["x"], torch.zeros(50_000)), "the first commit stands"


# -- found by review: cancellation before the save's task ran, the ledger race, settling
#    under close(timeout), a re-save whose abandoned manifest write lands late


def test_a_save_cancelled_before_its_task_ran_frees_its_slot(small_config: Config) -> None:
    ckpt = SyncCheckpointer(small_config)
    engine = ckpt._engine
    plan, order = ckpt._plan({"w": torch.zeros(10)}, 7, None)

    async def cancel_at_once() -> None:
        started = asyncio.ensure_future(engine.save(plan, order, 0.0, ckpt._storage, None))
        await asyncio.sleep(0)  # engine.save made the task; it has not taken a step yet
        engine.abort(plan.save_id)
        started.cancel()
        await asyncio.gather(started, return_exceptions=True)
        await asyncio.sleep(0.1)

    ckpt._loop.run(cancel_at_once())
    assert engine._jobs == {}
    saves_on_the_transfer_side = getattr(engine.transfer, "_saves", {})  # thread executor: inspectable
    assert saves_on_the_transfer_side == {}, "the transfer side was told: it waits for no chunks"
    ckpt.save({"w": torch.zeros(10)}, step=7).wait(10)  # neither refused nor blocked
    ckpt.close()


async def test_a_failure_the_handle_delivered_is_never_raised_again(
    small_config: Config, faulty: FaultyStorage
) -> None:
    faulty.fail_when = lambda name: name.endswith(MANIFEST_FILE)
    faulty.error = OSError(errno.EIO, "injected")
    raised_twice = 0
    async with Checkpointer(small_config, storage=faulty) as ckpt:
        for step in range(1, 151):
            handle = await ckpt.save({"w": torch.zeros(10)}, step=step)  # raises only a failure not yet seen
            with contextlib.suppress(OSError):
                await handle
        faulty.fail_when = None
        try:
            await ckpt.save({"w": torch.zeros(10)}, step=1000)
        except OSError:
            raised_twice += 1
    assert raised_twice == 0


@pytest.mark.thread_only  # wraps a storage in the trainer's process
def test_close_timeout_while_a_failed_save_reads_back_still_settles_it(small_config: Config, root: Path) -> None:
    class SlowReadBack(FaultyStorage):
        async def read(self, name: str, *, limit: int | None = None) -> bytes:
            if name.endswith(MANIFEST_FILE):
                await asyncio.sleep(2)
            return await super().read(name, limit=limit)

    store = SlowReadBack(LocalStorage(root), fail_when=lambda n: n.endswith(MANIFEST_FILE), error=OSError(28, "full"))
    ckpt = SyncCheckpointer(small_config, storage=store)
    handle = ckpt.save({"w": torch.zeros(1000)}, step=1)
    time.sleep(0.5)  # the manifest write failed; reading back is under way
    with pytest.raises(OSError, match="full"):  # nobody saw it: close() reports it
        ckpt.close(timeout=0.3)
    assert handle.done()
    with pytest.raises(OSError, match="full"):
        handle.wait(1)


@pytest.mark.thread_only  # wraps a storage in the trainer's process
def test_a_resaves_abandoned_manifest_write_that_lands_late_keeps_its_data(small_config: Config, root: Path) -> None:
    class LateLanding(FaultyStorage):
        late = False

        async def write(self, name: str, data: object, *, if_absent: bool = False) -> None:
            if self.late and name.endswith(MANIFEST_FILE):
                self.late = False
                payload = bytes(data)  # type: ignore[call-overload]

                async def lands_later() -> None:
                    await asyncio.sleep(0.5)
                    await self.inner.write(name, payload)

                asyncio.get_running_loop().create_task(lands_later())
                raise ConnectionResetError("reset while the manifest PUT was in flight (injected)")
            await super().write(name, data, if_absent=if_absent)  # type: ignore[arg-type]

    store = LateLanding(LocalStorage(root))
    store.settled_writes = False  # like S3: an abandoned request may still land later
    with SyncCheckpointer(small_config, storage=store) as ckpt:
        ckpt.save({"w": torch.zeros(1000)}, step=5).wait()
        store.late = True
        with pytest.raises(ConnectionResetError):
            ckpt.save({"w": torch.ones(1000)}, step=5).wait()  # the old manifest is still there
        time.sleep(1.0)  # ... until the abandoned write lands
        assert torch.equal(ckpt.load()["w"], torch.ones(1000)), "the re-save's data was left in place"
