"""Background failures surface with their original type; nothing half-written is committed."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from aiosnap import CheckpointerClosedError, Config, SyncCheckpointer
from aiosnap.manifest import MANIFEST_FILE
from tests.conftest import FaultyStorage


def _disk_full() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device (injected)")


def test_failed_write_surfaces_at_wait_next_save_and_close(
    small_config: Config, faulty: FaultyStorage, root: Path
) -> None:
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

    with pytest.raises(OSError) as at_save:  # the next save reports it (once) and does not start
        ckpt.save(good, step=3)
    assert at_save.value is at_wait.value

    assert ckpt.steps() == [1]
    assert not (root / "000000000002" / MANIFEST_FILE).exists()
    step2 = root / "000000000002"
    assert not step2.exists() or not any(p.is_file() for p in step2.rglob("*")), "failed attempt's objects removed"
    assert torch.equal(ckpt.load()["w"], good["w"]), "the previous checkpoint stays loadable"

    with pytest.raises(OSError) as at_close:
        ckpt.close()
    assert at_close.value is at_wait.value
    with pytest.raises(CheckpointerClosedError):
        ckpt.save(good, step=4)


def test_a_later_successful_save_clears_the_failure(small_config: Config, faulty: FaultyStorage) -> None:
    faulty.fail_when = lambda name: name.startswith("000000000001/")
    faulty.error = PermissionError(errno.EACCES, "read-only target (injected)")
    with SyncCheckpointer(small_config, storage=faulty) as ckpt:
        with pytest.raises(PermissionError):
            ckpt.save({"x": torch.ones(3)}, step=1).wait()
        with pytest.raises(PermissionError):
            ckpt.save({"x": torch.ones(3)}, step=2)
        ckpt.save({"x": torch.ones(3)}, step=2).wait()
        assert ckpt.steps() == [2]
    # leaving the with-block did not raise: the failure was reported and a later save committed


def test_manifest_write_failure_leaves_step_uncommitted(small_config: Config, faulty: FaultyStorage) -> None:
    faulty.fail_when = lambda name: name.endswith(MANIFEST_FILE)
    faulty.error = _disk_full()
    ckpt = SyncCheckpointer(small_config, storage=faulty)
    with pytest.raises(OSError):
        ckpt.save({"x": torch.ones(3)}, step=1).wait()
    assert ckpt.steps() == []
    with pytest.raises(OSError):
        ckpt.close()


def test_custom_exception_type_is_kept(small_config: Config, faulty: FaultyStorage) -> None:
    class QuotaExceeded(Exception):
        pass

    faulty.fail_when = lambda name: True
    faulty.error = QuotaExceeded("bucket quota")
    ckpt = SyncCheckpointer(small_config, storage=faulty)
    with pytest.raises(QuotaExceeded, match="bucket quota"):
        ckpt.save({"x": torch.ones(3)}, step=1).wait()
    with pytest.raises(QuotaExceeded):
        ckpt.close()


def test_unsupported_values_fail_in_save_itself(small_config: Config) -> None:
    from aiosnap import UnsupportedStateError

    with SyncCheckpointer(small_config) as ckpt:
        with pytest.raises(UnsupportedStateError, match="sparse"):
            ckpt.save({"s": torch.eye(3).to_sparse()}, step=1)
        with pytest.raises(UnsupportedStateError, match="meta"):
            ckpt.save({"m": torch.empty(3, device="meta")}, step=1)
        with pytest.raises(ValueError, match="step"):
            ckpt.save({"x": torch.ones(1)}, step=-1)
        with pytest.raises(TypeError, match="metadata"):
            ckpt.save({"x": torch.ones(1)}, step=1, metadata={"bad": object()})
        assert ckpt.steps() == []


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


def test_two_writers_never_silently_overwrite_one_new_step(small_config: Config, faulty: FaultyStorage) -> None:
    class RacingStorage(FaultyStorage):
        async def exists(self, name: str) -> bool:
            return False if name.endswith(MANIFEST_FILE) else await self.inner.exists(name)

    with SyncCheckpointer(small_config, storage=faulty) as first:
        first.save({"x": torch.zeros(3)}, step=5).wait()
    second = SyncCheckpointer(small_config, storage=RacingStorage(faulty.inner))  # checked just before the rival
    with pytest.raises(FileExistsError, match="committed by another writer"):
        second.save({"x": torch.ones(3)}, step=5).wait()
    with pytest.raises(FileExistsError):
        second.close()
    with SyncCheckpointer(small_config) as reader:
        assert torch.equal(reader.load(step=5)["x"], torch.zeros(3)), "the first commit stands"
