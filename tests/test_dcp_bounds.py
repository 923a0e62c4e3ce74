"""What a hostile DCP folder or ``torch.save`` file costs to read is bounded by its real size.

A pickle may refer to one container many times (its memo): rebuilt as a tree, a kilobyte
becomes 10**8 values; a ``.metadata`` or a zip header may claim sizes its files do not have;
chunk lists may be shared by every tensor, chunks may overlap. Each is refused (or, for
``planner_data``, which reading does not need, dropped) before the work or the allocation
it would cost, and the fuzzer below forges such claims at random."""

from __future__ import annotations

import copy
import io
import pickle
import random
import shutil
import struct
import tracemalloc
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from aiosnap import AiosnapError, CorruptCheckpointError, PickleNotAllowedError, export
from aiosnap.dcp import StorageReader, load
from aiosnap.interop.dcp.metadata import parse_metadata
from tests.conftest import assert_same
from tests.fuzzing import laughs
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(60),
]

QUIET = {"ram_budget": "1MiB", "events": {"log": False}}


def _read(folder: Path) -> Metadata:
    with open(folder / ".metadata", "rb") as f:
        found: Metadata = pickle.load(f)  # the test's own, trusted file
    return found


def _write(folder: Path, metadata: Any) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def test_shared_containers_are_not_rebuilt_over_and_over(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    state = {"w": torch.arange(4.0)}
    dcp.save(state, storage_writer=FileSystemWriter(folder), no_dist=True)
    metadata = _read(folder)
    metadata.planner_data = {"w": ("w",), "junk": laughs(100, 3)}  # 10**6 values
    _write(folder, metadata)
    assert (folder / ".metadata").stat().st_size < 4096
    assert parse_metadata((folder / ".metadata").read_bytes(), "x").planner_data is None  # not needed: dropped
    assert_same(load(None, folder, config=QUIET)["w"], state["w"])

    values = tmp_path / "values"  # a value DCP pickled: more than plain data, so allow_pickle's
    dcp.save({"w": torch.ones(2), "junk": [1]}, storage_writer=FileSystemWriter(values), no_dist=True)
    blob = io.BytesIO()
    torch.save(laughs(100, 3), blob)  # what DCP's writer stores for a value
    (values / "junk.distcp").write_bytes(blob.getvalue())
    metadata = _read(values)
    metadata.storage_data[MetadataIndex("junk")] = _StorageInfo("junk.distcp", 0, len(blob.getvalue()))
    _write(values, metadata)
    with pytest.raises(PickleNotAllowedError):
        load(None, values, config=QUIET)
    target: dict[str, Any] = {"w": torch.zeros(2), "junk": None}
    with pytest.raises(CheckpointException, match="more values than its size allows"):  # the reason, in DCP's wrap
        dcp.load(target, storage_reader=StorageReader(values, QUIET), no_dist=True)
    assert load(None, values, config=QUIET, allow_pickle=True)["junk"][99][99][99] == ["x"]

    source = tmp_path / "laughs.pt"  # a torch.save file is refused as a source
    torch.save({"w": torch.ones(2), "junk": laughs(100, 3)}, source)
    with pytest.raises(CorruptCheckpointError, match="more values than its size allows"):
        export(str(source), str(tmp_path / "out.pt"), to="torch", config=QUIET)
    assert not (tmp_path / "out.pt").exists()


def test_one_chunk_list_shared_by_every_tensor_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    dcp.save({"w": torch.arange(4.0)}, storage_writer=FileSystemWriter(folder), no_dist=True)
    metadata = _read(folder)
    described = metadata.state_dict_metadata["w"]
    described.size = torch.Size([2000, 1])
    described.chunks = [ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 1])) for i in range(2000)]
    for i in range(2000):  # 2000 tensors, one list of 2000 chunks: 4 million chunks to check
        metadata.state_dict_metadata[f"t{i}"] = described
    _write(folder, metadata)
    with pytest.raises(CorruptCheckpointError, match="more chunks than its size allows"):
        parse_metadata((folder / ".metadata").read_bytes(), "x")


def test_overlapping_chunks_are_refused(tmp_path: Path) -> None:
    """Chunks whose volumes add up but overlap leave a hole nobody stored: torch's reader
    loads whatever the target held there."""
    folder = tmp_path / "ck"
    state = {"p": torch.ones(3, 3), "q": torch.full((1, 3), 2.0)}
    dcp.save(state, storage_writer=FileSystemWriter(folder), no_dist=True)
    metadata = _read(folder)
    p, q = (metadata.storage_data[MetadataIndex(k, torch.Size([0, 0]))] for k in "pq")
    described = metadata.state_dict_metadata.pop("p")
    del metadata.state_dict_metadata["q"]
    described.size = torch.Size([4, 3])
    described.chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 3])),
        ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([1, 3])),  # inside the first; row 3 never stored
    ]
    metadata.state_dict_metadata["p"] = described
    metadata.storage_data = {MetadataIndex("p", torch.Size([0, 0])): p, MetadataIndex("p", torch.Size([1, 0])): q}
    metadata.planner_data = {"p": ("p",)}
    _write(folder, metadata)
    with pytest.raises(CorruptCheckpointError, match=r"chunks at \[0, 0\] and \[1, 0\] overlap"):
        StorageReader(folder).read_metadata()
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        load(None, folder, config=QUIET)


def _local_header(name: bytes, size: int) -> bytes:
    """A stored zip record's local header with its sizes in it."""
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, 0, size, size, len(name), 0) + name


def test_sizes_an_archive_merely_claims_allocate_nothing(tmp_path: Path) -> None:
    """A strided tensor's record claims 256 MiB in a file of 8 KiB, and so does its
    location in ``.metadata``: refused when the metadata is read, nothing allocated."""
    folder = tmp_path / "ck"
    dcp.save({"t": torch.arange(8.0).reshape(2, 4).T}, storage_writer=FileSystemWriter(folder), no_dist=True)
    metadata = _read(folder)
    ((_, info),) = metadata.storage_data.items()
    blob = (folder / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    pkl = zipfile.ZipFile(io.BytesIO(blob)).read("archive/data.pkl")
    claim = 256 * 1024**2
    forged = _local_header(b"archive/data.pkl", len(pkl)) + pkl + _local_header(b"archive/data/0", claim)
    (folder / "evil.distcp").write_bytes(forged + bytes(8192 - len(forged)))
    info.relative_path, info.offset, info.length = "evil.distcp", 0, claim + 4096
    _write(folder, metadata)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="runs past the end of 'evil.distcp'"):
            StorageReader(folder).read_metadata()
        with pytest.raises(CorruptCheckpointError, match="runs past the end"):
            load(None, folder, config=QUIET)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024**2, peak


def _size_fields(data: bytes) -> tuple[list[int], list[int]]:
    """Where the (compressed, uncompressed) sizes of every zip record are in ``data`` (in
    its local header and its central directory entry): of the storages' records
    (``data/<key>``), and of the others."""
    storages: list[int] = []
    others: list[int] = []
    for signature, at, length_at, name_at in ((b"PK\x03\x04", 18, 26, 30), (b"PK\x01\x02", 20, 28, 46)):
        position = data.find(signature)
        while position >= 0:
            name_len = struct.unpack_from("<H", data, position + length_at)[0]
            name = data[position + name_at : position + name_at + name_len]
            (storages if b"/data/" in name else others).append(position + at)
            position = data.find(signature, position + 1)
    return storages, others


def _with_sizes_in_local_headers(folder: Path) -> Metadata:
    """Each item's archive rewritten by Python's zipfile, which puts every record's sizes in
    its local header (torch's writer puts them after the bytes): what other zip writers do,
    and what lets a reader find ``data.pkl`` and the storages from the archive's first
    bytes. Returns the metadata, which it rewrites too."""
    metadata = _read(folder)
    rewritten: dict[str, bytearray] = {}
    for info in sorted(metadata.storage_data.values(), key=lambda i: (i.relative_path, i.offset)):
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        archive = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(blob)) as source, zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as out:
            for record in source.infolist():
                out.writestr(record.filename, source.read(record.filename))
        target = rewritten.setdefault(info.relative_path, bytearray())
        info.offset, info.length = len(target), len(archive.getvalue())
        target += archive.getvalue()
    for name, data in rewritten.items():
        (folder / name).write_bytes(bytes(data) + bytes(16384))  # and room for a reader's first look
    _write(folder, metadata)
    return metadata


def _attempt(folder: Path, state: dict[str, torch.Tensor]) -> None:
    """Loads bit-exact, or fails with an AiosnapError (DCP wraps it)."""
    try:
        reader = StorageReader(folder, QUIET)
        reader.read_metadata()
    except AiosnapError:
        return
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    try:
        dcp.load(target, storage_reader=reader, no_dist=True)
    except CheckpointException as exc:
        errors = [error for error, _ in exc.failures.values()]
    else:
        errors = []
    assert all(isinstance(error, AiosnapError) for error in errors), errors
    if errors:
        return
    for key, value in state.items():
        assert_same(target[key], value)


def test_fuzzed_size_claims_allocate_nothing(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Item lengths in ``.metadata`` and record sizes in the archives' headers forged at
    random (up to 256 MiB, in files of a few KiB): never an allocation of what is claimed."""
    cases = max(40, int(request.config.getoption("--fuzz-cases")) // 40)
    rng = random.Random(24)
    folder, backup = tmp_path / "ck", tmp_path / "backup"
    state = {"t": torch.arange(8.0).reshape(2, 4).T, "w": torch.arange(6.0), "b": torch.arange(3)}
    dcp.save(state, storage_writer=FileSystemWriter(backup), no_dist=True)
    original = _with_sizes_in_local_headers(backup)
    _attempt(backup, state)  # loads as it is
    data_file = next(p.name for p in backup.iterdir() if p.suffix == ".distcp")
    raw = (backup / data_file).read_bytes()
    storages, others = _size_fields(raw)
    assert len(storages) == 2 * len(state), storages  # each tensor's record: local header, directory entry
    tracemalloc.start()
    try:
        for _ in range(cases):
            shutil.rmtree(folder, ignore_errors=True)
            shutil.copytree(backup, folder)
            claim = 2 ** rng.randint(12, 28)  # told alike by the metadata and the headers
            metadata = copy.deepcopy(original)
            for info in metadata.storage_data.values():
                if rng.random() < 0.5:
                    info.length = rng.choice([info.length + rng.randint(1, 64), claim + 4096])
            _write(folder, metadata)
            data = bytearray(raw)
            for _ in range(rng.randint(1, 3)):
                at = rng.choice(storages if rng.random() < 0.7 else others)
                forged = rng.choice([claim, claim, rng.randint(0, 4096)])
                struct.pack_into("<II", data, at, forged, forged)
            (folder / data_file).write_bytes(bytes(data))
            tracemalloc.reset_peak()
            _attempt(folder, state)
            peak = tracemalloc.get_traced_memory()[1]
            assert peak < 32 * 1024**2, (peak, metadata.storage_data)
    finally:
        tracemalloc.stop()
