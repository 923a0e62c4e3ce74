"""Background failures surface once, with their original type; nothing half-written is committed."""

from __future__ import annotations

import contextlib
import errno
import time
from pathlib import Path

import pytest
import torch
from aiosnap import CheckpointerClosedError, Config, SyncCheckpointer, UnsupportedStateError
from aiosnap.core.names import MANIFEST_FILE
from tests.conftest import FaultyStorage

pytestmark = pytest.mark.both_executors


def _disk_full() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device (injected)")


def _wait_done(handle: object, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not handle.done():  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the save never finished"
        time.sleep(0.01)


def _no_files(folder: Path) -> bool:
    return not folder.exists() or not any(p.is_file() for p in folder.rglob("*"))


def test_failure_seen_at_wait_is_not_raised_again(small_config: Config, faulty: FaultyStorage, root: Path) -> None:
    good = {"w": torch.randn(50_000)}
    ckpt = SyncCheckpointer(small_config, storage=faulty)
    ckpt.save(good, step=1).wait()

    faulty.fail_when = lambda name: name.startswith("000000000002/") and name.endswith("/2.bin")
    faulty.error = _disk_full()
    handle = ckpt.save({"w": torch.randn(50_000)}, step=2)
    with pytest.raises(OSError) as at_wait:
        handle.wait(timeout=30)
    assert at_wait.value.errno == errno.ENOSPC
    assert handle.done() and handle.result is None
    with pytest.raises(OSError) as again:  # the handle itself always answers the same
        handle.wait()
    assert again.value is at_wait.value

    assert ckpt.steps() == [1]
    assert not (root / "000000000002" / MANIFEST_FILE).exists()
    assert torch.equal(ckpt.load()["w"], good["w"]), "the previous checkpoint stays loadable"
    ckpt.save(good, step=3).wait()  # the next save is not refused: the caller was told already
    ckpt.close()  # nor does close() raise it again
    assert _no_files(root / "000000000002"), "the failed attempt's objects are removed"
    with pytest.raises(CheckpointerClosedError):
        ckpt.save(good, step=4)


def test_unseen_failure_is_raised_by_the_next_save_once(small_config: Config, faulty: FaultyStorage) -> None:
    faulty.fail_when = lambda name: name.startswith("000000000001/")
    faulty.error = PermissionError(errno.EACCES, "read-only target (injected)")
    with SyncCheckpointer(small_config, storage=faulty) as ckpt:
        faulty.hold()  # the write fails in the background, after save() returned
        handle = ckpt.save({"x": torch.ones(3)}, step=1)
        faulty.release(ckpt._loop.loop)
        _wait_done(handle)  # nobody waits on the handle
        with pytest.raises(PermissionError) as at_save:  # reported by the next save, which does not start
            ckpt.save({"x": torch.ones(3)}, step=2)
        assert at_save.value is handle.future.exception()
        assert ckpt.steps() == []
        ckpt.save({"x": torch.ones(3)}, step=2).wait()  # once only
        assert ckpt.steps() == [2]
    # leaving the with-block did not raise: the failure was reported once, by save()


def test_unseen_failure_is_raised_by_close_once(small_config: Config, faulty: FaultyStorage) -> None:
    class QuotaExceeded(Exception):
        pass

    faulty.fail_when = lambda name: True
    faulty.error = QuotaExceeded("bucket quota")
    ckpt = SyncCheckpointer(small_config, storage=faulty)
    faulty.hold()
    handle = ckpt.save({"x": torch.ones(3)}, step=1)
    faulty.release(ckpt._loop.loop)
    _wait_done(handle)
    with pytest.raises(QuotaExceeded, match="bucket quota"):  # custom types are kept
        ckpt.close()
    ckpt.close()  # idempotent, and the failure is not raised twice


def test_a_handled_failure_does_not_break_the_with_block(small_config: Config, faulty: FaultyStorage) -> None:
    faulty.fail_when = lambda name: name.endswith(MANIFEST_FILE)
    faulty.error = _disk_full()
    with SyncCheckpointer(small_config, storage=faulty) as ckpt:
        with contextlib.suppress(OSError):  # handled: the job decides to go on
            ckpt.save({"x": torch.ones(3)}, step=1).wait()
        assert ckpt.steps() == []
    # no exception at exit


def test_unsupported_values_fail_in_save_itself(small_config: Config) -> None:
    with SyncCheckpointer(small_config) as ckpt:
        with pytest.raises(UnsupportedStateError, match="sparse"):
            ckpt.save({"s": torch.eye(3).to_sparse()}, step=1)
        with pytest.raises(UnsupportedStateError, match="meta"):
            ckpt.save({"m": torch.empty(3, device="meta")}, step=1)
        with pytest.raises(ValueError, match="step"):
            ckpt.save({"x": torch.ones(1)}, step=-1)
        with pytest.raises(TypeError, match="metadata"):
            ckpt.save({"x": torch.ones(1)}, step=1, metadata={"bad": object()})
        deep: dict[str, object] = {}
        node = deep
        for _ in range(150):
            node["n"] = node = {}
        with pytest.raises(UnsupportedStateError, match="nested deeper"):
            ckpt.save({"deep": deep}, step=1)
        assert ckpt.steps() == []


def test_dtensor_of_a_one_rank_mesh_round_trips(small_config: Config, tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        with SyncCheckpointer(small_config) as ckpt:
            ckpt.save({"model": {"w": sharded}}, step=1).wait()
            target = {"model": {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])}}
            ckpt.load(target)
            assert torch.equal(target["model"]["w"].full_tensor(), sharded.full_tensor())
            assert ckpt.manifest().entries[0].kind == "sharded"
    finally:
        dist.destroy_process_group()


def test_failing_cleanup_after_commit_keeps_the_checkpoint(small_config: Config, faulty: FaultyStorage) -> None:
    class StubbornStorage(FaultyStorage):
        async def delete_prefix(self, prefix: str) -> None:
            raise PermissionError("cannot delete (injected)")

    storage = StubbornStorage(faulty.inner)
    with SyncCheckpointer(small_config, storage=storage) as ckpt:
        ckpt.save({"x": torch.zeros(3)}, step=1).wait()
        ckpt.save({"x": torch.ones(3)}, step=1).wait()  # re-save: the old attempt cannot be removed
        assert ckpt.steps() == [1]
        assert torch.equal(ckpt.load()["x"], torch.ones(3))
