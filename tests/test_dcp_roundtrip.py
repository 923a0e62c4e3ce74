"""DCP checkpoints both ways in one process (``no_dist``): aiosnap's writer makes what torch's
``FileSystemReader`` loads, aiosnap's reader loads what torch's ``FileSystemWriter`` wrote,
and aiosnap's own load path (``aiosnap.dcp.load``, ``SyncCheckpointer(folder)``) loads both
into live state; every tensor compared bit for bit."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from aiosnap import PickleNotAllowedError, SyncCheckpointer, UnsupportedCheckpointError
from aiosnap.dcp import StorageReader, StorageWriter, checkpoint_storage, load
from aiosnap.storage.local import LocalStorage
from tests.conftest import FaultyStorage, assert_same
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning"),
    pytest.mark.timeout(60),
]

SMALL = {"ram_budget": "1MiB", "upload": {"chunk_size": "64KiB"}, "events": {"log": False}}
"""64 KiB slabs: larger tensors are written as tiles, several files per rank."""


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "w": torch.randn(300, 200, generator=g),  # 240 KB: tiles of rows
            "wide": torch.randn(2, 40_000, generator=g),  # rows larger than a slab: tiles within rows
            "b": torch.arange(5, dtype=torch.int64),
            "half": torch.randn(33, generator=g).half(),
            "bf16": torch.randn(7, 3, generator=g).bfloat16(),
            "f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
            "u16": torch.arange(6, dtype=torch.int32).to(torch.uint16),
            "mask": torch.arange(10) % 3 == 0,
            "c": torch.randn(4, generator=g, dtype=torch.complex64),
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3),
        },
        "step": 7,
        "meta": {"lr": 0.01, "name": "run", "betas": (0.9, 0.99), "shape": torch.Size([2, 3])},
    }


def _zeros(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _zeros(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None


def test_aiosnap_writes_a_real_dcp_checkpoint(tmp_path: Path) -> None:
    state = _state()
    folder = tmp_path / "ck"
    dcp.save(state, storage_writer=StorageWriter(folder, SMALL), no_dist=True)
    names = sorted(os.listdir(folder))
    assert ".metadata" in names and any(n.startswith(".aiosnap-checksums.") for n in names)
    assert sum(n.endswith(".distcp") for n in names) > 3, names  # 64 KiB files: the big tensors were cut
    for reader in (FileSystemReader(folder), StorageReader(folder, SMALL)):
        target = _zeros(state)
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert_same(target["model"], state["model"])
        assert target["step"] == 7 and target["meta"] == state["meta"]
    metadata = FileSystemReader(folder).read_metadata()
    assert len(metadata.state_dict_metadata["model.w"].chunks) > 1  # tiles are chunks of their tensor


def test_aiosnap_loads_what_torch_wrote(tmp_path: Path) -> None:
    state = _state()
    state["model"]["t"] = torch.randn(40, 30).t()  # a transposed view: torch stores it strided
    folder = tmp_path / "ck"
    dcp.save(state, storage_writer=FileSystemWriter(folder, thread_count=2), no_dist=True)
    target = _zeros(state)
    dcp.load(target, storage_reader=StorageReader(folder), no_dist=True)
    assert_same(target["model"], {**state["model"], "t": state["model"]["t"].contiguous()})
    assert target["meta"] == state["meta"]
    with pytest.raises(UnsupportedCheckpointError, match=r"'model\.t' is stored as a strided view"):
        load(None, folder)  # a manifest cannot describe it; dcp.load above read it


def test_aiosnap_load_path_reads_both_writers(tmp_path: Path) -> None:
    """In place into a module and nested tensors, partially, and into new tensors."""
    state = _state()
    torch.manual_seed(0)
    module = torch.nn.Linear(6, 4)
    saved = {**state, "net": module.state_dict()}
    for name, writer in (
        ("ours", StorageWriter(tmp_path / "ours", SMALL)),
        ("torch", FileSystemWriter(tmp_path / "torch")),
    ):
        folder = tmp_path / name
        dcp.save(saved, storage_writer=writer, no_dist=True)
        fresh = torch.nn.Linear(6, 4)
        target = {"model": _zeros(state["model"]), "net": fresh}
        pointer = target["model"]["w"].data_ptr()
        with SyncCheckpointer(str(folder)) as ckpt:  # a local DCP folder opens as a read-only root
            assert ckpt.steps() == [0]
            ckpt.load(target)
            assert ckpt.load(paths=["meta/*"]) == {"meta": state["meta"]}
        assert target["model"]["w"].data_ptr() == pointer  # read in place
        assert_same(target["model"], state["model"])
        assert_same(fresh.state_dict(), module.state_dict())
        restored = load(None, folder, config=SMALL)
        assert_same(restored["model"], state["model"])
        assert restored["step"] == 7 and restored["meta"] == state["meta"]


def test_pickled_values_need_allow_pickle(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    dcp.save({"w": torch.ones(3), "odd": {1, 2}}, storage_writer=StorageWriter(folder, SMALL), no_dist=True)
    target: dict[str, Any] = {"w": torch.zeros(3), "odd": None}
    with pytest.raises(BaseException, match="pickled object") as caught:  # DCP wraps it in CheckpointException
        dcp.load(target, storage_reader=StorageReader(folder), no_dist=True)
    assert "PickleNotAllowedError" in str(caught.value)
    dcp.load(target, storage_reader=StorageReader(folder, allow_pickle=True), no_dist=True)
    assert target["odd"] == {1, 2}
    with pytest.raises(PickleNotAllowedError):
        load(None, folder)
    assert load(None, folder, allow_pickle=True)["odd"] == {1, 2}


def test_async_save_through_aiosnap_in_a_thread(tmp_path: Path) -> None:
    state = _state()
    folder = tmp_path / "ck"
    future = dcp.async_save(
        state, storage_writer=StorageWriter(folder, SMALL), async_checkpointer_type=AsyncCheckpointerType.THREAD,
        no_dist=True,
    )  # fmt: skip
    future.result(timeout=30)
    target = _zeros(state)
    dcp.load(target, storage_reader=FileSystemReader(folder), no_dist=True)
    assert_same(target["model"], state["model"])


def _data_files(folder: Path) -> set[str]:
    return {n for n in os.listdir(folder) if n.endswith(".distcp") or n.startswith(".aiosnap-checksums")}


def test_overwrite_never_rewrites_data_under_the_old_metadata(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    dcp.save({"x": torch.full((50_000,), 1.0)}, storage_writer=StorageWriter(folder, SMALL), no_dist=True)
    first = _data_files(folder)
    dcp.save({"x": torch.full((50_000,), 2.0)}, storage_writer=StorageWriter(folder, SMALL), no_dist=True)
    second = _data_files(folder)
    assert not first & second  # fresh names: the old checkpoint stayed whole until the new one committed
    target = {"x": torch.zeros(50_000)}
    dcp.load(target, storage_reader=FileSystemReader(folder), no_dist=True)
    assert torch.equal(target["x"], torch.full((50_000,), 2.0))
    with pytest.raises(BaseException, match="overwrite=False"):
        dcp.save({"x": torch.zeros(3)}, storage_writer=StorageWriter(folder, SMALL, overwrite=False), no_dist=True)
    assert _data_files(folder) == second
    torch_written = tmp_path / "torch"
    dcp.save({"x": torch.ones(4)}, storage_writer=FileSystemWriter(torch_written), no_dist=True)
    dcp.save({"x": torch.zeros(4)}, storage_writer=StorageWriter(torch_written, SMALL), no_dist=True)
    assert "__0_0.distcp" not in os.listdir(torch_written)  # the replaced checkpoint's file, removed after
    assert torch.equal(load(None, torch_written)["x"], torch.zeros(4))


def test_checksums_are_checked(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    dcp.save({"x": torch.arange(10_000.0)}, storage_writer=StorageWriter(folder), no_dist=True)
    checksums = next(folder.glob(".aiosnap-checksums.*.json"))
    data_file = next(folder.glob("*.distcp"))
    record = json.loads(checksums.read_text())["items"][0]
    _, _, _, _, payload_at, payload_nbytes, _ = record
    with open(data_file, "r+b") as f:  # flip one byte of the tensor's raw bytes
        f.seek(payload_at + payload_nbytes // 2)
        byte = f.read(1)
        f.seek(payload_at + payload_nbytes // 2)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(BaseException, match="checksum mismatch"):
        dcp.load({"x": torch.zeros(10_000)}, storage_reader=StorageReader(folder), no_dist=True)
    with pytest.raises(Exception, match="checksum mismatch"):
        load(None, folder)
    checksums.unlink()
    with pytest.raises(Exception, match="checksums .* are missing"):
        load(None, folder)


def test_checkpoint_storage_is_read_only(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    dcp.save({"x": torch.ones(3)}, storage_writer=StorageWriter(folder), no_dist=True)
    with SyncCheckpointer({"events": {"log": False}}, storage=checkpoint_storage(folder)) as ckpt:
        assert torch.equal(ckpt.load()["x"], torch.ones(3))
        with pytest.raises(PermissionError, match="read-only"):
            ckpt.save({"x": torch.zeros(3)}, step=1).wait(timeout=30)
    assert torch.equal(load(None, folder)["x"], torch.ones(3))


def test_saves_through_the_writer_emit_events(tmp_path: Path) -> None:
    journal = tmp_path / "events.jsonl"
    config = {**SMALL, "events": {"log": False, "jsonl": str(journal)}}
    dcp.save({"x": torch.ones(1000)}, storage_writer=StorageWriter(tmp_path / "ck", config), no_dist=True)
    events = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [(e["kind"], e["stage"]) for e in events] == [
        ("start", None),
        ("end", "upload"),
        ("end", "commit"),
        ("end", None),
    ]
    assert events[1]["nbytes"] > 4000 and events[-1]["save_id"] == events[0]["save_id"]
    failed = tmp_path / "failed.jsonl"
    broken = FaultyStorage(
        LocalStorage(tmp_path / "ck2"), fail_when=lambda n: n.endswith(".distcp"), error=OSError(5, "EIO")
    )
    writer = StorageWriter(tmp_path / "ck2", {**SMALL, "events": {"log": False, "jsonl": str(failed)}}, storage=broken)
    with pytest.raises(BaseException, match="EIO"):
        dcp.save({"x": torch.ones(3)}, storage_writer=writer, no_dist=True)
    events = [json.loads(line) for line in failed.read_text().splitlines()]
    assert [e["kind"] for e in events] == ["start", "exception"] and events[1]["error_type"] == "OSError"


@pytest.mark.parametrize("early_check", [True, False], ids=["plan", "finish"])
def test_the_writer_refuses_what_its_reader_would_refuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, early_check: bool
) -> None:
    """A key over 4096 characters, a tensor of 70 dimensions: torch's reader would take them,
    aiosnap's refuses them as corrupt, so aiosnap's writer commits neither -- a ConfigError
    naming the key, checked on the plan before a byte is written; and, should the plan's
    check miss something, the reader's own parser runs on the .metadata before its commit.
    The checkpoint that was there stays whole, and the refused save leaves no file."""
    from aiosnap import ConfigError
    from aiosnap.interop.dcp import writer as writer_module

    if not early_check:
        monkeypatch.setattr(writer_module, "check_plan", lambda plan, where: None)
    folder = tmp_path / "ck"
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(folder, SMALL), no_dist=True)
    before = sorted(os.listdir(folder))
    for state, named in (({"k" * 5000: torch.ones(3)}, "k" * 40), ({"t": torch.ones([1] * 70)}, "'t'")):
        with pytest.raises(BaseException) as caught:  # DCP wraps it in CheckpointException
            dcp.save(state, storage_writer=StorageWriter(folder, SMALL), no_dist=True)
        errors = [error for error, _ in getattr(caught.value, "failures", {0: (caught.value, None)}).values()]
        assert any(isinstance(e, ConfigError) and "aiosnap's reader would refuse" in str(e) for e in errors), errors
        assert not early_check or named in str(errors), errors
        assert sorted(os.listdir(folder)) == before
        target = {"w": torch.zeros(3)}
        dcp.load(target, storage_reader=StorageReader(folder), no_dist=True)
        assert_same(target["w"], torch.ones(3))
