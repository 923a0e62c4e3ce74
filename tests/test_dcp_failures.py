"""aiosnap's DCP writer when things go wrong: a failed ``async_save``, a failed commit, two
writers of one new checkpoint, a save killed half-way. The previous checkpoint stays whole
and loadable (by torch's reader and by aiosnap's), nothing half-written is taken for a
checkpoint, and a failed attempt's files go where nothing else can still write them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from aiosnap import Config
from aiosnap.core.loop import LoopThread
from aiosnap.dcp import StorageReader, StorageWriter, load
from aiosnap.interop.dcp.runtime import SlabPool, runtime
from aiosnap.storage.base import ObjectInfo
from aiosnap.storage.local import LocalStorage
from tests.conftest import FaultyStorage
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(60),
]

SMALL = {"ram_budget": "1MiB", "upload": {"chunk_size": "64KiB"}, "events": {"log": False}}


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((60_000,), value), "b": torch.arange(7) + int(value), "step": int(value)}


def _assert_holds(folder: Path, value: float) -> None:
    """Both readers load the checkpoint at ``folder`` as the state of ``value``."""
    for reader in (FileSystemReader(folder), StorageReader(folder, SMALL)):
        target = {"w": torch.zeros(60_000), "b": torch.zeros(7, dtype=torch.int64), "step": None}
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert torch.equal(target["w"], torch.full((60_000,), value)) and target["step"] == int(value)
    assert torch.equal(load(None, folder, config=SMALL)["b"], torch.arange(7) + int(value))


def _files(folder: Path) -> set[str]:
    return set(os.listdir(folder))


def test_a_failed_async_save_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    dcp.save(_state(1.0), storage_writer=StorageWriter(folder, SMALL), no_dist=True)
    before = _files(folder)
    faulty = FaultyStorage(
        LocalStorage(folder), fail_when=lambda n: n.startswith("__0_2."), error=OSError(28, "disk full")
    )
    writer = StorageWriter(folder, SMALL, storage=faulty)
    future = dcp.async_save(
        _state(2.0), storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.THREAD, no_dist=True
    )  # fmt: skip
    with pytest.raises(BaseException, match="disk full") as caught:  # DCP wraps it in CheckpointException
        future.result(timeout=30)
    assert isinstance(caught.value.failures[0][0], OSError)  # DCP keeps the original error, with its type
    assert any(n.startswith("__0_3.") for n in faulty.writes)  # later files were written, then removed
    assert _files(folder) == before
    _assert_holds(folder, 1.0)


def test_a_failed_commit_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    dcp.save(_state(1.0), storage_writer=StorageWriter(folder, SMALL), no_dist=True)
    before = _files(folder)
    faulty = FaultyStorage(LocalStorage(folder), fail_when=lambda n: n == ".metadata", error=OSError(5, "I/O error"))
    with pytest.raises(BaseException, match="I/O error"):
        dcp.save(_state(2.0), storage_writer=StorageWriter(folder, SMALL, storage=faulty), no_dist=True)
    assert _files(folder) == before  # the attempt's files went: its .metadata provably did not land
    _assert_holds(folder, 1.0)


def test_two_writers_of_one_new_checkpoint(tmp_path: Path) -> None:
    """Both start while no checkpoint is there; the first to commit wins, the second fails
    with FileExistsError instead of replacing it, and its files go."""
    folder = tmp_path / "ck"
    held = FaultyStorage(LocalStorage(folder))
    held.hold_when = lambda name: name == ".metadata"
    failure: list[BaseException] = []

    def first() -> None:
        try:
            dcp.save(_state(1.0), storage_writer=StorageWriter(folder, SMALL, storage=held), no_dist=True)
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    deadline = time.monotonic() + 20
    while not any(n.startswith(".aiosnap-checksums") for n in held.writes) and time.monotonic() < deadline:
        time.sleep(0.01)  # the first writer's data is written; its .metadata waits
    dcp.save(_state(2.0), storage_writer=StorageWriter(folder, SMALL), no_dist=True)
    held.release(runtime().loop.loop)
    thread.join(timeout=30)
    assert failure and "FileExistsError" in repr(failure[0]) + str(failure[0]), failure
    _assert_holds(folder, 2.0)
    data = [n for n in _files(folder) if n.endswith(".distcp")]
    assert len({n.split(".")[1] for n in data}) == 1  # only the winner's attempt is left


CHILD = """
import sys, time, torch, warnings
warnings.simplefilter("ignore")
import torch.distributed.checkpoint as dcp
from aiosnap.dcp import StorageWriter
from aiosnap.storage.base import ObjectInfo
from aiosnap.storage.local import LocalStorage
from tests.conftest import FaultyStorage
folder = sys.argv[1]
slow = FaultyStorage(LocalStorage(folder), delay=0.05)  # every write takes a while: killed half-way
print("saving", flush=True)
dcp.save({"w": torch.full((60_000,), 2.0), "b": torch.arange(7) + 2, "step": 2},
         storage_writer=StorageWriter(folder, {"ram_budget": "1MiB", "upload": {"chunk_size": "64KiB",
         "concurrency": 1}, "events": {"log": False}}, storage=slow), no_dist=True)
print("done", flush=True)
"""


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    dcp.save(_state(1.0), storage_writer=StorageWriter(folder, SMALL), no_dist=True)
    before = _files(folder)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(folder)], cwd=Path(__file__).parent.parent, stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}, start_new_session=True, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while len(_files(folder) - before) < 2 and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.01)
        assert child.poll() is None, "the save ended before it could be killed"
        os.killpg(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    assert len(_files(folder) - before) >= 2  # some of the new attempt's files had landed
    _assert_holds(folder, 1.0)


def test_an_interrupt_as_a_slab_arrives_loses_no_slab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C lands while ``write_data`` waits for a staging slab, just as one is lent to
    it (the slab's coroutine finishes before the cancellation reaches it): the slab goes
    back to the pool instead of being lost with the result (four lost: every later save
    in the process hangs)."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT does not raise KeyboardInterrupt here")
    pool = runtime().pool(Config(**SMALL))
    real = SlabPool.acquire
    interrupted = threading.Event()

    async def lent_as_the_interrupt_lands(self: SlabPool) -> int:
        slab = await real(self)
        if self is pool and not interrupted.is_set():
            interrupted.set()
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            # the caller, interrupted, cancels this (or, woken late, finds it done) ...
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.5)
            # ... too late: the slab is this coroutine's result all the same
        return slab

    monkeypatch.setattr(SlabPool, "acquire", lent_as_the_interrupt_lands)
    with pytest.raises(BaseException) as caught:  # KeyboardInterrupt, maybe in DCP's wrap
        dcp.save(_state(1.0), storage_writer=StorageWriter(tmp_path / "ck", SMALL), no_dist=True)
    assert "KeyboardInterrupt" in repr(caught.value) + repr(getattr(caught.value, "failures", "")), caught.value
    deadline = time.monotonic() + 10
    while len(pool._free) < pool.count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pool._free) == pool.count, f"{pool.count - len(pool._free)} slab(s) lost"
    monkeypatch.undo()
    dcp.save(_state(2.0), storage_writer=StorageWriter(tmp_path / "ck", SMALL), no_dist=True)
    _assert_holds(tmp_path / "ck", 2.0)


def test_a_result_that_comes_after_its_caller_left_is_handed_back() -> None:
    """LoopThread.run's ``abandoned``: a caller that gave up (here a timeout) cancels the
    coroutine; what the coroutine returns anyway goes to ``abandoned``, once."""
    loop = LoopThread(name="aiosnap-test")
    back: list[str] = []

    async def stubborn() -> str:
        with contextlib.suppress(asyncio.CancelledError):  # cleans up, then returns what it holds
            await asyncio.sleep(10)
        return "slab"

    try:
        with pytest.raises(TimeoutError):
            loop.run(stubborn(), timeout=0.05, abandoned=back.append)
        deadline = time.monotonic() + 10
        while not back and time.monotonic() < deadline:
            time.sleep(0.01)
        assert back == ["slab"]

        async def prompt() -> str:
            return "kept"

        assert loop.run(prompt(), timeout=None, abandoned=back.append) == "kept" and back == ["slab"]
    finally:
        loop.stop()


def test_a_commit_removes_stray_attempt_files_past_their_grace(tmp_path: Path) -> None:
    """Files of attempts no ``.metadata`` names (a rank or process killed mid-save, the
    loser of an overwrite race) go at the next commit once older than the grace period
    (an hour); younger ones (a save that may still be running) and files aiosnap does not
    name stay. A save whose own files vanished before its commit does not commit."""
    folder = tmp_path / "ck"
    dcp.save(_state(1.0), storage_writer=StorageWriter(folder, SMALL), no_dist=True)
    data = next(n for n in _files(folder) if n.endswith(".distcp"))
    old, young = "0123456789abcdef", "fedcba9876543210"
    strays = [f"__1_0.{old}.distcp", f"__0_3.{old}.distcp", f".aiosnap-checksums.{old}.json"]
    kept = [f"__1_0.{young}.distcp", "notes.txt", f"__1_0.{old}.distcp.bak"]
    for name in strays + kept:
        (folder / name).write_bytes((folder / data).read_bytes())
    two_hours_ago = time.time() - 7200
    for name in [*strays, kept[1], kept[2]]:
        os.utime(folder / name, (two_hours_ago, two_hours_ago))
    dcp.save(_state(2.0), storage_writer=StorageWriter(folder, SMALL), no_dist=True)
    _assert_holds(folder, 2.0)
    assert not set(strays) & _files(folder)
    assert set(kept) <= _files(folder)

    class Vanishing(LocalStorage):  # one of this save's files goes (another writer's sweep) before the commit
        async def walk(self, prefix: str = "") -> list[ObjectInfo]:
            os.remove(folder / next(n for n in os.listdir(folder) if n.startswith("__0_0.") and n not in before))
            return await super().walk(prefix)

    before = _files(folder)
    with pytest.raises(BaseException, match="vanished") as caught:  # DCP wraps it
        dcp.save(_state(3.0), storage_writer=StorageWriter(folder, SMALL, storage=Vanishing(folder)), no_dist=True)
    assert "StorageError" in repr(caught.value.failures[0][0].__class__.__mro__)
    assert _files(folder) == before  # the refused attempt's other files removed
    _assert_holds(folder, 2.0)


def test_a_load_racing_an_overwrite_says_the_checkpoint_was_replaced(tmp_path: Path) -> None:
    """A load read ``.metadata``, then an overwrite committed and removed the files that
    ``.metadata`` named: the load fails with CheckpointReplacedError (load again), not as a
    corrupt checkpoint; loading again gets the new one."""
    from aiosnap import CheckpointReplacedError

    folder = tmp_path / "ck"
    dcp.save(_state(1.0), storage_writer=StorageWriter(folder, SMALL), no_dist=True)

    class OverwrittenMidLoad(StorageReader):
        def read_data(self, plan: Any, planner: Any) -> Any:
            dcp.save(_state(2.0), storage_writer=StorageWriter(folder, SMALL), no_dist=True)
            return super().read_data(plan, planner)

    target = {"w": torch.zeros(60_000), "b": torch.zeros(7, dtype=torch.int64), "step": None}
    with pytest.raises(BaseException, match="replaced") as caught:  # DCP wraps it
        dcp.load(target, storage_reader=OverwrittenMidLoad(folder, SMALL), no_dist=True)
    assert isinstance(caught.value.failures[0][0], CheckpointReplacedError)
    _assert_holds(folder, 2.0)
