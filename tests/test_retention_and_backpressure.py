"""Retention after commit only; re-saving a step; max_pending_saves backpressure."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from aiosnap import Config, SyncCheckpointer
from aiosnap.storage.local import LocalStorage
from tests.conftest import FaultyStorage

pytestmark = pytest.mark.both_executors


def _config(root: Path, **extra: object) -> Config:
    return Config(storage={"url": str(root)}, ram_budget="1MiB", upload={"chunk_size": "64KiB"}, **extra)  # type: ignore[arg-type]


@pytest.mark.thread_only  # wraps a storage in the trainer's process
def test_keep_last_deletes_old_steps_only_after_the_new_one_commits(root: Path) -> None:
    storage = FaultyStorage(LocalStorage(root))
    with SyncCheckpointer(_config(root, retention={"keep_last": 2}), storage=storage) as ckpt:
        for step in (1, 2):
            ckpt.save({"x": torch.full((10,), step)}, step=step).wait()
        storage.hold()  # step 3's writes hang: nothing may be deleted meanwhile
        handle = ckpt.save({"x": torch.full((10,), 3)}, step=3)
        time.sleep(0.1)
        assert ckpt.steps() == [1, 2]
        storage.release(ckpt._loop.loop)
        result = handle.wait(10)
        assert result.deleted_steps == (1,)
        assert ckpt.steps() == [2, 3]
    assert not (root / "000000000001").exists()


def test_retention_keeps_the_newest_steps(root: Path) -> None:
    with SyncCheckpointer(_config(root, retention={"keep_last": 2}), storage=None) as ckpt:
        for step in (10, 20, 30):
            ckpt.save({"x": torch.full((4,), float(step))}, step=step).wait()
        assert ckpt.steps() == [20, 30]
        ckpt.save({"x": torch.ones(1)}, step=30).wait()  # re-saving the latest replaces it, deletes nothing
        assert ckpt.steps() == [20, 30]


@pytest.mark.thread_only  # wraps a storage in the trainer's process
def test_failed_save_never_triggers_retention(root: Path) -> None:
    storage = FaultyStorage(LocalStorage(root))
    ckpt = SyncCheckpointer(_config(root, retention={"keep_last": 1}), storage=storage)
    ckpt.save({"x": torch.ones(1)}, step=1).wait()
    storage.fail_when = lambda name: True
    storage.error = OSError("injected")
    with pytest.raises(OSError, match="injected"):
        ckpt.save({"x": torch.ones(1)}, step=2).wait()
    assert ckpt.steps() == [1], "the only good checkpoint stays"
    ckpt.close()


def test_resaving_a_step_replaces_its_objects(root: Path) -> None:
    with SyncCheckpointer(_config(root), storage=None) as ckpt:
        first = ckpt.save({"x": torch.zeros(100)}, step=7).wait()
        second = ckpt.save({"x": torch.ones(100)}, step=7).wait()
        assert first.save_id != second.save_id
        assert torch.equal(ckpt.load()["x"], torch.ones(100))
    attempts = sorted(p.name for p in (root / "000000000007").iterdir())
    assert attempts == sorted([second.save_id, "manifest.json"])


@pytest.mark.thread_only  # wraps a storage in the trainer's process
def test_max_pending_saves_makes_the_next_save_wait(root: Path) -> None:
    storage = FaultyStorage(LocalStorage(root))
    with SyncCheckpointer(_config(root, max_pending_saves=1), storage=storage) as ckpt:
        storage.hold()
        first = ckpt.save({"x": torch.ones(10)}, step=1)  # captured, upload held
        returned = threading.Event()

        def second_save() -> None:
            ckpt.save({"x": torch.ones(10)}, step=2)
            returned.set()

        thread = threading.Thread(target=second_save)
        thread.start()
        assert not returned.wait(0.3), "second save() must wait while one save is pending"
        storage.release(ckpt._loop.loop)
        assert returned.wait(10)
        thread.join()
        assert first.wait(10).step == 1


@pytest.mark.thread_only  # counts validations in the trainer's process
def test_retention_does_not_validate_again_what_this_process_committed(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention asks after each commit which recent steps are readable; a manifest this
    process wrote (read back as a reader would before its commit) or validated, byte for
    byte the same, is not parsed and checked again (at tens of thousands of tensors that
    cost about a second per step per save)."""
    from aiosnap.format.manifest import Manifest

    validated: list[str] = []
    real = Manifest.from_json.__func__  # type: ignore[attr-defined]

    def counting(cls: type[Manifest], data: bytes, where: str) -> Manifest:
        validated.append(where)
        return real(cls, data, where)  # type: ignore[no-any-return]

    monkeypatch.setattr(Manifest, "from_json", classmethod(counting))
    with SyncCheckpointer(_config(root, retention={"keep_last": 2})) as ckpt:
        for step in range(1, 6):
            ckpt.save({"x": torch.full((10,), float(step))}, step=step).wait()
        assert ckpt.steps() == [4, 5]
        assert validated == [str(root / f"{step:012d}" / "manifest.json") for step in range(1, 6)]  # each commit's
        assert torch.equal(ckpt.load()["x"], torch.full((10,), 5.0))
        assert len(validated) == 6  # a load validates what it reads


def test_a_manifest_damaged_after_it_was_trusted_is_checked_afresh(root: Path) -> None:
    with SyncCheckpointer(_config(root, retention={"keep_last": 2})) as ckpt:
        for step in (1, 2):
            ckpt.save({"x": torch.full((10,), float(step))}, step=step).wait()
        manifest = root / "000000000002" / "manifest.json"
        data = bytearray(manifest.read_bytes())
        data[len(data) // 2] ^= 0x01  # one flipped bit: the crc no longer matches
        manifest.write_bytes(bytes(data))
        ckpt.save({"x": torch.full((10,), 3.0)}, step=3).wait()
        # step 2 cannot be read: it is not counted as kept, so step 1 stays
        assert ckpt.steps() == [1, 2, 3]
        assert torch.equal(ckpt.load(step=1)["x"], torch.full((10,), 1.0))
