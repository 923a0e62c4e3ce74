"""The async API inside a running loop, the sync API from threads, the thread guard."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path

import pytest
import torch
from aiosnap import Checkpointer, CheckpointerClosedError, Config, SyncCheckpointer, WrongThreadError
from tests.conftest import FaultyStorage

pytestmark = pytest.mark.both_executors


async def test_async_save_does_not_block_the_callers_loop(small_config: Config, faulty: FaultyStorage) -> None:
    faulty.delay = 0.05  # every object write takes 50 ms
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    async with Checkpointer(small_config, storage=faulty) as ckpt:
        state = {"w": torch.randn(100_000)}  # 400 KB: 7 objects
        handle = await ckpt.save(state, step=1)
        ticks_at_capture = ticks
        result = await handle
        assert result.durable_s >= 0.05
        assert ticks - ticks_at_capture >= 5, "the caller's loop kept running while the save became durable"
        assert await ckpt.steps() == [1]
        restored = await ckpt.load()
        assert torch.equal(restored["w"], state["w"])
    task.cancel()


async def test_handle_wait_timeout_does_not_cancel_the_save(small_config: Config, faulty: FaultyStorage) -> None:
    faulty.hold()
    async with Checkpointer(small_config, storage=faulty) as ckpt:
        handle = await ckpt.save({"x": torch.ones(10)}, step=1)
        with pytest.raises(TimeoutError):
            await handle.wait(timeout=0.05)
        assert not handle.done()
        faulty.release(ckpt._loop.loop)
        result = await handle.wait(timeout=10)
        assert result.step == 1 and handle.result == result


async def test_closed_checkpointer_refuses_calls(small_config: Config) -> None:
    ckpt = Checkpointer(small_config)
    await ckpt.close()
    await ckpt.close()  # idempotent
    with pytest.raises(CheckpointerClosedError):
        await ckpt.save({"x": torch.ones(1)}, step=1)
    with pytest.raises(CheckpointerClosedError):
        await ckpt.steps()


def test_sync_api_from_several_threads(root: Path) -> None:
    config = Config(
        storage={"url": str(root)},
        ram_budget="1MiB",
        upload={"chunk_size": "64KiB"},
        retention={"keep_last": None},
        max_pending_saves=2,
    )
    errors: list[BaseException] = []
    with SyncCheckpointer(config) as ckpt:
        # one root per thread (steps only move forward within a root), one loop, budget and queue
        views = [ckpt.at(str(root / f"thread-{i}")) for i in range(4)]

        def worker(index: int) -> None:
            try:
                for j in range(3):
                    step = index * 10 + j
                    views[index].save({"v": torch.full((30_000,), float(step))}, step=step).wait()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for index, view in enumerate(views):
            assert view.steps() == [index * 10, index * 10 + 1, index * 10 + 2]
            for step in view.steps():
                assert torch.equal(view.load(step=step)["v"], torch.full((30_000,), float(step)))


def test_sync_call_from_the_loop_thread_raises_instead_of_deadlocking(small_config: Config) -> None:
    with SyncCheckpointer(small_config) as ckpt:
        result: list[BaseException] = []

        def inside_loop() -> None:
            try:
                ckpt.steps()
            except BaseException as exc:
                result.append(exc)

        done = threading.Event()
        ckpt._loop.loop.call_soon_threadsafe(lambda: (inside_loop(), done.set()))
        assert done.wait(5)
        assert isinstance(result[0], WrongThreadError)


def test_checkpointer_accepts_url_path_dict_and_config(root: Path) -> None:
    for spec in (str(root), root, {"storage": {"url": str(root)}}, Config(storage={"url": f"file://{root}"})):
        with SyncCheckpointer(spec) as ckpt:  # type: ignore[arg-type]
            assert ckpt.url == str(root)


def test_close_timeout_cancels_a_stuck_save(small_config: Config, faulty: FaultyStorage) -> None:
    faulty.hold()  # the target never answers
    ckpt = SyncCheckpointer(small_config, storage=faulty)
    handle = ckpt.save({"x": torch.ones(10)}, step=1)
    with pytest.raises(TimeoutError, match="did not finish within 0.2 s and were cancelled"):
        ckpt.close(timeout=0.2)
    with pytest.raises(concurrent.futures.CancelledError):
        handle.wait(timeout=5)
    assert not any(p.name == "manifest.json" for p in faulty.inner.root.rglob("*"))  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["asyncio", "uvloop", "auto"])
def test_loop_kind_is_honoured(root: Path, kind: str) -> None:
    with SyncCheckpointer({"storage": {"url": str(root)}, "loop": kind}) as ckpt:
        assert ckpt.loop_kind == ("asyncio" if kind == "asyncio" else "uvloop")
        result = ckpt.save({"x": torch.ones(3)}, step=1).wait()
    assert result.blocked_s <= result.durable_s
    assert result.nbytes == 12
    assert result.objects == 1


def test_views_share_the_pipeline_and_keep_their_own_retention(small_config: Config, tmp_path: Path) -> None:
    ckpt = SyncCheckpointer(small_config)
    other = ckpt.at(str(tmp_path / "other"), keep_last=1)
    assert other.url == str(tmp_path / "other") and other.ram_high_water == ckpt.ram_high_water == 0
    for step in (1, 2, 3):
        other.save({"w": torch.full((50_000,), float(step))}, step=step).wait()
    ckpt.save({"w": torch.zeros(10)}, step=9).wait()
    assert other.steps() == [3] and ckpt.steps() == [9]
    assert torch.equal(other.load()["w"], torch.full((50_000,), 3.0))
    assert 0 < ckpt.ram_high_water <= 1024**2  # one budget for both roots
    assert other.purge() == [3] and not (tmp_path / "other").exists()
    ckpt.close()
    with pytest.raises(CheckpointerClosedError):
        other.save({"w": torch.ones(1)}, step=4)
