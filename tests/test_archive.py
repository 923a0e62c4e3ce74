"""Single-file checkpoints (:class:`~aiosnap.interop.singlefile.ArchiveStorage`): the zip
layout other tools read, the commit by rename, and hostile files at the path."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import time
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Checkpointer, Config, SyncCheckpointer
from aiosnap.catalog.steps import committed_steps, read_manifest
from aiosnap.errors import CheckpointNotFoundError, CorruptCheckpointError, StepOrderError, UnsupportedStateError
from aiosnap.format.archive import (
    ALIGN,
    MANIFEST_RECORD,
    MAX_TRAILER_BYTES,
    Record,
    build_tail,
    local_header,
    parse_trailer,
)
from aiosnap.interop.singlefile import ArchiveStorage, is_archive
from aiosnap.load.fetch import fetch_entries
from aiosnap.trainer.plan import make_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import FaultyStorage, assert_same


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    weights = torch.randn(600, 100)
    return {
        "w": weights,
        "tied": weights,
        "flags": torch.tensor([True, False, True]),
        "c": torch.randn(7, dtype=torch.complex64),
        "f8": torch.randn(11).to(torch.float8_e4m3fn),
        "empty": torch.empty(0, 3),
        "t": torch.randn(40, 30).t(),
        "many": [torch.full((i + 1,), float(i)) for i in range(300)],
        "meta": {"epoch": 4, "name": "run", "nan": float("nan")},
    }


@pytest.fixture
def checkpointer(tmp_path: Path) -> Any:
    root = SyncCheckpointer(Config(storage={"url": str(tmp_path / "root")}, upload={"chunk_size": "64KiB"}))
    yield root
    root.close()


def _no_partial_files(folder: Path, timeout: float = 10.0) -> bool:
    """Wait (failed attempts are removed in the background) until no partial file is left."""
    deadline = time.monotonic() + timeout
    while list(folder.glob(".*aiosnap-partial")):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _deleted_files_open(name: str) -> list[str]:
    """Files named ``name`` this process still holds open although they were deleted."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if name in target and target.endswith("(deleted)"):
                found.append(target)
    return found


def _file(root: SyncCheckpointer, path: Path, storage: Any = None) -> SyncCheckpointer:
    return root.at(str(path), keep_last=1, storage=storage or ArchiveStorage(path))


def test_python_zipfile_agrees_with_the_layout(tmp_path: Path, checkpointer: SyncCheckpointer) -> None:
    path = tmp_path / "m.ckpt"
    state = _state()
    _file(checkpointer, path).save(state, step=3).wait()
    with zipfile.ZipFile(path) as archive:
        infos = {info.filename: info for info in archive.infolist()}
    assert {"archive/data.pkl", "archive/version", "archive/byteorder", MANIFEST_RECORD} <= set(infos)
    raw = path.read_bytes()
    for info in infos.values():  # each record's data starts aligned, right after its local header
        name_length, extra_length = struct.unpack_from("<HH", raw, info.header_offset + 26)
        start = info.header_offset + 30 + name_length + extra_length
        assert start % ALIGN == 0, info.filename
        assert info.compress_type == zipfile.ZIP_STORED and info.file_size == info.compress_size
    loaded = torch.load(path)
    for key in ("w", "flags", "c", "empty", "t"):
        assert torch.equal(loaded[key], state[key]) and loaded[key].dtype == state[key].dtype, key
    assert torch.equal(loaded["f8"].float(), state["f8"].float()) and loaded["f8"].dtype == torch.float8_e4m3fn
    assert all(torch.equal(a, b) for a, b in zip(loaded["many"], state["many"], strict=True))
    assert loaded["tied"].data_ptr() == loaded["w"].data_ptr()
    assert loaded["meta"]["epoch"] == 4 and loaded["meta"]["nan"] != loaded["meta"]["nan"]


def test_aiosnap_loads_what_it_saved_and_lists_one_step(tmp_path: Path, checkpointer: SyncCheckpointer) -> None:
    path = tmp_path / "m.ckpt"
    single = _file(checkpointer, path)
    state = _state()
    single.save(state, step=3).wait()
    assert single.steps() == [3] and is_archive(path)
    loaded = single.load()
    assert torch.equal(loaded["w"], state["w"]) and loaded["meta"]["name"] == "run"
    state["w"].add_(1)
    single.save(state, step=4).wait()
    assert single.steps() == [4]
    assert torch.equal(single.load()["w"], state["w"])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "root") == ["m.ckpt"]
    single.purge()
    assert not path.exists()


def test_zip64_records_and_offsets_past_4_gib(tmp_path: Path) -> None:
    path = tmp_path / "huge.zip"
    big = 5 * 1024**3  # a sparse file: only headers are written
    first = local_header("archive/data/0", big, 0)
    second_at = len(first) + big
    second = local_header("archive/data/1", 64, second_at)
    tail_at = second_at + len(second) + 64
    records = [Record("archive/data/0", 0, big), Record("archive/data/1", second_at, 64)]
    tail = build_tail(tail_at, records, b"", b"{}", step=1, save_id="0123456789abcdef")
    with open(path, "wb") as f:
        f.write(first)
        f.seek(second_at)
        f.write(second)
        f.seek(tail_at)
        f.write(tail)
    with zipfile.ZipFile(path) as archive:
        infos = {info.filename: info for info in archive.infolist()}
    assert infos["archive/data/0"].file_size == big
    assert infos["archive/data/1"].header_offset == second_at
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(size - MAX_TRAILER_BYTES)
        trailer = parse_trailer(f.read(), size)
    assert trailer is not None and trailer.step == 1 and trailer.manifest_nbytes == 2


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=MAX_TRAILER_BYTES), st.integers(min_value=0, max_value=2**40))
def test_any_file_end_is_an_archive_or_not_never_an_error(tail: bytes, extra: int) -> None:
    found = parse_trailer(tail, len(tail) + extra)
    if found is not None:
        assert found.manifest_offset + found.manifest_nbytes <= len(tail) + extra


def test_a_real_trailer_survives_mutation_only_as_a_checked_archive(tmp_path: Path) -> None:
    tail = build_tail(1000, [], b"pickle", b"{}", step=7, save_id="0123456789abcdef")
    assert parse_trailer(tail[-MAX_TRAILER_BYTES:], 1000 + len(tail)) is not None
    comment = b"aiosnap-archive step=7 save=0123456789abcdef manifest=999999+10"  # past the end
    lying = tail[: tail.rfind(b"PK\x05\x06")] + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0, 0, 0, 0, len(comment))
    assert parse_trailer((lying + comment)[-MAX_TRAILER_BYTES:], 1000 + len(lying) + len(comment)) is None
    assert parse_trailer(tail[:-1][-MAX_TRAILER_BYTES:], 1000 + len(tail) - 1) is None  # comment length off


@pytest.mark.parametrize(
    "content",
    [b"", b"not a zip at all", b"PK\x05\x06" + bytes(18)],
    ids=["empty", "text", "bare-end-record"],
)
def test_a_file_that_is_not_an_aiosnap_archive_holds_no_checkpoint(
    tmp_path: Path, checkpointer: SyncCheckpointer, content: bytes
) -> None:
    path = tmp_path / "foreign.ckpt"
    path.write_bytes(content)
    single = _file(checkpointer, path)
    assert single.steps() == []
    with pytest.raises(CheckpointNotFoundError):
        single.load()
    assert path.read_bytes() == content  # looked at, never touched


def test_a_torch_save_file_is_not_taken_for_an_aiosnap_checkpoint(
    tmp_path: Path, checkpointer: SyncCheckpointer
) -> None:
    path = tmp_path / "old.ckpt"
    torch.save({"w": torch.ones(3)}, path)
    assert not is_archive(path) and _file(checkpointer, path).steps() == []


def test_a_damaged_manifest_in_the_file_is_a_corrupt_checkpoint(tmp_path: Path, checkpointer: SyncCheckpointer) -> None:
    path = tmp_path / "m.ckpt"
    _file(checkpointer, path).save({"w": torch.ones(100)}, step=1).wait()
    raw = bytearray(path.read_bytes())
    size = len(raw)
    trailer = parse_trailer(bytes(raw[-MAX_TRAILER_BYTES:]), size)
    assert trailer is not None
    raw[trailer.manifest_offset + 5] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        _file(checkpointer, path).load()


def test_a_truncated_file_holds_no_checkpoint(tmp_path: Path, checkpointer: SyncCheckpointer) -> None:
    path = tmp_path / "m.ckpt"
    _file(checkpointer, path).save({"w": torch.ones(10_000)}, step=1).wait()
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])  # a copy cut short
    assert _file(checkpointer, path).steps() == []


def test_a_failed_save_keeps_the_previous_file_and_leaves_no_partial(
    tmp_path: Path, checkpointer: SyncCheckpointer
) -> None:
    path = tmp_path / "m.ckpt"
    broken = FaultyStorage(ArchiveStorage(path), error=OSError(5, "EIO"))
    single = _file(checkpointer, path, broken)
    single.save({"w": torch.zeros(60_000)}, step=1).wait()
    before = path.read_bytes()
    broken.fail_when = lambda name: name.endswith("/2.bin")
    with pytest.raises(OSError, match="EIO"):
        single.save({"w": torch.ones(60_000)}, step=2).wait()
    assert path.read_bytes() == before
    assert _no_partial_files(tmp_path)


async def test_a_save_cancelled_while_it_waits_for_ram_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "m.ckpt"
    config = Config(storage={"url": str(tmp_path / "root")}, ram_budget="1MiB", upload={"chunk_size": "256KiB"})
    async with Checkpointer(config) as root:
        held = FaultyStorage(ArchiveStorage(path))
        single = root.at(str(path), keep_last=1, storage=held)
        await (await single.save({"w": torch.zeros(50_000)}, step=1))
        before = await asyncio.to_thread(path.read_bytes)
        held.hold()  # uploads wait: capture runs out of RAM, save() waits too
        saving = asyncio.create_task(single.save({"w": torch.ones(2_000_000)}, step=2))
        await asyncio.sleep(0.5)
        assert not saving.done()
        saving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await saving
        held.release(root._loop.loop)
        assert await single.steps() == [1] and await asyncio.to_thread(path.read_bytes) == before
        assert await asyncio.to_thread(_no_partial_files, tmp_path)
        await (await single.save({"w": torch.full((10,), 3.0)}, step=2))  # the path works on
    assert torch.equal(torch.load(path)["w"], torch.full((10,), 3.0))


def test_a_second_writer_of_the_same_step_is_refused(tmp_path: Path, checkpointer: SyncCheckpointer) -> None:
    path = tmp_path / "m.ckpt"
    first = FaultyStorage(ArchiveStorage(path))
    first.hold_when = lambda name: name.endswith("manifest.json")
    first.hold()
    one = _file(checkpointer, path, first).save({"w": torch.zeros(10)}, step=5)
    other = SyncCheckpointer(Config(storage={"url": str(tmp_path / "root2")}))
    try:
        other.at(str(path), keep_last=1, storage=ArchiveStorage(path)).save({"w": torch.ones(10)}, step=5).wait()
        first.release(checkpointer._loop.loop)  # type: ignore[attr-defined]
        with pytest.raises(FileExistsError, match="another writer"):
            one.wait()
    finally:
        other.close()
    assert torch.equal(torch.load(path)["w"], torch.ones(10))


@pytest.mark.parametrize(
    "settings_",
    [
        {"upload": {"executor": "process"}},
        {"spool": {"mode": "always"}},
        {"upload": {"executor": "process"}, "spool": {"mode": "always"}},
    ],
    ids=["process", "spool", "process+spool"],
)
def test_every_upload_path_writes_the_same_file(tmp_path: Path, settings_: dict[str, Any]) -> None:
    path = tmp_path / "m.ckpt"
    values: dict[str, Any] = {"storage": {"url": str(tmp_path / "root")}, **settings_}
    if "spool" in values:
        values["spool"] = {**values["spool"], "dir": str(tmp_path / "spool")}
    state = _state()
    with SyncCheckpointer(Config(**values)) as root:
        single = _file(root, path)
        for step in (1, 2):
            state["w"].add_(1)
            single.save(state, step=step).wait()
            loaded = torch.load(path)
            assert torch.equal(loaded["w"], state["w"]) and loaded["tied"].data_ptr() == loaded["w"].data_ptr()
        assert single.steps() == [2] and torch.equal(single.load()["t"], state["t"])
    assert _no_partial_files(tmp_path, timeout=0)


def test_the_cli_reads_a_single_file_and_gc_removes_only_old_partial_files(
    tmp_path: Path, checkpointer: SyncCheckpointer
) -> None:
    from aiosnap.cli import main

    path = tmp_path / "m.ckpt"
    _file(checkpointer, path).save({"model": {"w": torch.ones(1000)}}, step=7).wait()
    crashed = tmp_path / ".m.ckpt.000000000009.0123456789abcdef.aiosnap-partial"  # a process killed mid-save
    crashed.write_bytes(b"x" * 100)
    os.utime(crashed, (time.time() - 86_400 * 2,) * 2)
    running = tmp_path / ".m.ckpt.000000000010.fedcba9876543210.aiosnap-partial"  # a save in progress
    running.write_bytes(b"y" * 100)
    assert main(["verify", str(path)]) == 0
    assert main(["gc", str(path), "--keep-last", "1"]) == 0
    assert not crashed.exists() and running.exists()
    assert _file(checkpointer, path).steps() == [7] and torch.equal(torch.load(path)["model"]["w"], torch.ones(1000))


def test_an_older_step_never_replaces_a_newer_file(tmp_path: Path, checkpointer: SyncCheckpointer) -> None:
    path = tmp_path / "m.ckpt"
    slow = FaultyStorage(ArchiveStorage(path))
    slow.hold_when = lambda name: name.endswith("manifest.json")
    older = _file(checkpointer, path, slow).save({"w": torch.full((10,), 5.0)}, step=5)  # waits at its commit
    with SyncCheckpointer(Config(storage={"url": str(tmp_path / "other")})) as other:
        _file(other, path).save({"w": torch.full((10,), 6.0)}, step=6).wait()
    slow.release(checkpointer._loop.loop)  # type: ignore[attr-defined]
    with pytest.raises(StepOrderError, match="holds step 6"):
        older.wait()
    assert torch.equal(torch.load(path)["w"], torch.full((10,), 6.0))


async def test_a_load_reads_one_version_while_a_writer_replaces_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.ckpt"
    config = Config(storage={"url": str(tmp_path / "root")}, upload={"chunk_size": "64KiB"})
    async with Checkpointer(config) as writer:
        single = writer.at(str(path), keep_last=1, storage=ArchiveStorage(path))
        await (await single.save({"w": torch.zeros(100_000)}, step=1))
        reader = ArchiveStorage(path)
        async with reader.reading():
            manifest = await read_manifest(reader, 1)
            await (await single.save({"w": torch.ones(100_000)}, step=2))  # renamed over the file
            tensors = await fetch_entries(reader, manifest, 4)
            assert await committed_steps(reader) == [1]  # the snapshot, to the end of the context
        assert torch.equal(tensors[0], torch.zeros(100_000))
        assert await committed_steps(reader) == [2]
        await reader.close()
    assert not await asyncio.to_thread(_deleted_files_open, "m.ckpt")  # old versions closed


def test_a_single_file_is_written_by_one_rank(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedStateError, match="one process"):
        make_plan({"w": torch.ones(3)}, step=1, chunk_bytes=2**20, rank=1, world_size=2, single_file=True)


def test_a_link_at_the_path_keeps_pointing_at_the_checkpoint(tmp_path: Path, checkpointer: SyncCheckpointer) -> None:
    target = tmp_path / "real.ckpt"
    link = tmp_path / "last.ckpt"
    os.symlink(target.name, link)
    single = _file(checkpointer, link)
    for step in (1, 2):
        single.save({"w": torch.full((4,), float(step))}, step=step).wait()
    assert link.is_symlink() and torch.equal(torch.load(link)["w"], torch.full((4,), 2.0))


def test_a_single_file_keeps_what_torch_save_keeps(tmp_path: Path) -> None:
    """It dropped a module's ``_metadata`` (its state dict's version numbers) and the Python
    attributes of tensors and Parameters, and pickled a user object's uint16 / float8 /
    complex32 tensors in a form nobody could load; ``torch.save`` of the same state loads."""
    from tests.test_symmetry import Holder

    module = torch.nn.Linear(3, 2)
    tagged = torch.arange(4.0)
    tagged.note = "kept"  # type: ignore[attr-defined]
    parameter = torch.nn.Parameter(torch.ones(2))
    parameter.tied_to = "encoder"  # type: ignore[attr-defined]
    state = {"model": module, "tagged": tagged, "param": parameter, "held": Holder()}
    reference = tmp_path / "reference.pt"
    torch.save({**state, "model": module.state_dict()}, reference)
    config = Config(storage={"url": str(tmp_path / "root")}, upload={"chunk_size": "64KiB"}, pickle_values=True)
    with SyncCheckpointer(config) as root:
        single = _file(root, tmp_path / "m.ckpt")
        single.save(state, step=1).wait()
        ours = single.load(allow_pickle=True)
    assert_same(ours["held"].tensors, state["held"].tensors)
    for path in (reference, tmp_path / "m.ckpt"):
        loaded = torch.load(path, weights_only=False)
        assert loaded["model"]._metadata == module.state_dict()._metadata, path
        assert loaded["tagged"].note == "kept" and torch.equal(loaded["tagged"], tagged), path
        assert type(loaded["param"]) is torch.nn.Parameter and loaded["param"].tied_to == "encoder", path
        assert_same(loaded["held"].tensors, state["held"].tensors)


def test_torch_load_reads_a_single_file_wherever_it_reads_torch_saves(tmp_path: Path) -> None:
    """A tensor (or Parameter) holding a tensor in a Python attribute was pickled through
    plain pickle, which ``torch.load``'s default ``weights_only`` unpickler refuses."""
    tagged = torch.arange(4.0)
    tagged.extra = torch.zeros(3)  # type: ignore[attr-defined]
    tagged.more = {"mask": torch.arange(5).to(torch.uint16), "name": "m"}  # type: ignore[attr-defined]
    parameter = torch.nn.Parameter(torch.ones(2))
    parameter.scale = torch.tensor(0.5)  # type: ignore[attr-defined]
    state = {"tagged": tagged, "param": parameter, "n": 3}
    with SyncCheckpointer(Config(storage={"url": str(tmp_path / "root")}, upload={"chunk_size": "64KiB"})) as root:
        _file(root, tmp_path / "w.ckpt").save(state, step=1).wait()
    reference = tmp_path / "reference.pt"
    torch.save(state, reference)
    for path in (reference, tmp_path / "w.ckpt"):
        loaded = torch.load(path)  # weights_only=True, torch's default
        assert torch.equal(loaded["tagged"].extra, tagged.extra) and loaded["tagged"].more["name"] == "m", path
        assert loaded["tagged"].more["mask"].dtype == torch.uint16, path
        assert torch.equal(loaded["param"].scale, parameter.scale), path


def test_a_stateful_value_inside_a_pickled_object_stays_itself_in_a_single_file(tmp_path: Path) -> None:
    """A Stateful object that is a value of the state and also sits inside a pickled object
    became its state dict in both places (chosen by ``id``, wherever the pickler met it)."""
    config = Config(storage={"url": str(tmp_path / "root")}, upload={"chunk_size": "64KiB"}, pickle_values=True)
    linear = torch.nn.Linear(2, 2)
    with SyncCheckpointer(config) as root:
        _file(root, tmp_path / "s.ckpt").save({"m": linear, "h": _Keeps(linear)}, step=1).wait()
    shared = torch.load(tmp_path / "s.ckpt", weights_only=False)
    assert type(shared["m"]) is OrderedDict and type(shared["h"].module) is torch.nn.Linear  # as torch.save's
    assert torch.equal(shared["h"].module.weight, linear.weight) and torch.equal(shared["m"]["weight"], linear.weight)


class _Keeps:
    """A user object (pickled) keeping a module that is also a value of the state."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
