"""A DCP ``.metadata`` (a pickle) and the blobs it points to, read as hostile input.

Crafted files -- an ``os.system`` gadget, a ``__reduce__`` of anything, huge sizes, wrong
types, names leaving the folder -- run no code and are a CorruptCheckpointError (or another
AiosnapError), never another exception, never an allocation of what the file merely
claims; then the same property fuzzed: bytes of a real ``.metadata`` damaged, and its fields
forged (re-pickled with torch's own classes)."""

from __future__ import annotations

import copy
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from aiosnap import AiosnapError, CorruptCheckpointError, SyncCheckpointer
from aiosnap.dcp import StorageReader, StorageWriter, checkpoint_storage, load
from aiosnap.interop.dcp.metadata import parse_metadata
from tests.conftest import assert_same
from tests.fuzzing import INTERESTING, laughs
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(120),
]

MARKER = "aiosnap-dcp-pwned"
QUIET = {"ram_budget": "1MiB", "events": {"log": False}}


class Gadget:
    """Unpickling it would run a shell command that leaves a file behind."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


def _saved(folder: Path, writer: str = "torch") -> dict[str, Any]:
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5), "step": 3}
    chosen = FileSystemWriter(folder) if writer == "torch" else StorageWriter(folder)
    dcp.save(state, storage_writer=chosen, no_dist=True)
    return state


def _read(folder: Path) -> Metadata:
    with open(folder / ".metadata", "rb") as f:
        found: Metadata = pickle.load(f)  # the test's own, trusted file
    return found


def _write(folder: Path, metadata: Any) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _refused(folder: Path, match: str | None = None) -> None:
    with pytest.raises(CorruptCheckpointError, match=match):
        load(None, folder, config=QUIET)
    with pytest.raises(CorruptCheckpointError, match=match):
        StorageReader(folder).read_metadata()


def test_a_shell_gadget_runs_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    _saved(folder)
    pwned = tmp_path / MARKER
    _write(folder, Gadget(pwned))
    _refused(folder, "refers to 'posix.system'")
    metadata = _read_safely_as_torch(folder.parent / "ck2")
    metadata.planner_data = {"w": Gadget(pwned)}  # the gadget deep inside a real Metadata
    _write(folder, metadata)
    _refused(folder, "posix.system")
    metadata.planner_data = None
    metadata.storage_meta = Gadget(pwned)  # type: ignore[assignment]
    _write(folder, metadata)
    _refused(folder)
    assert not pwned.exists()


def _read_safely_as_torch(folder: Path) -> Metadata:
    _saved(folder)
    return _read(folder)


def test_sizes_the_file_merely_claims_allocate_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    _saved(folder)
    metadata = _read(folder)
    described = metadata.state_dict_metadata["w"]
    described.size = torch.Size([2**40, 2**20])  # 4 EiB of float32
    described.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2**40, 2**20]))]
    _write(folder, metadata)
    with pytest.raises(CorruptCheckpointError, match=r"stored as float32 of shape \[3, 4\]"):
        load(None, folder, config=QUIET)
    metadata = _read(folder)
    metadata.state_dict_metadata["w"].size = torch.Size([1] * 1000)
    _write(folder, metadata)
    _refused(folder, "not a torch.Size")
    data = bytearray((folder / ".metadata").read_bytes())
    cut = pickle.dumps(b"x" * 100, protocol=4)  # a BINBYTES claiming more bytes than follow
    (folder / ".metadata").write_bytes(bytes(data[:20]) + cut[:4] + (2**60).to_bytes(8, "little"))
    _refused(folder)


@pytest.mark.parametrize(
    "forge",
    [
        lambda m: setattr(m, "state_dict_metadata", ["w"]),
        lambda m: setattr(m, "storage_data", {k: "__0_0.distcp" for k in m.storage_data}),
        lambda m: setattr(m, "storage_data", {k: _StorageInfo("../../etc/passwd", 0, 10) for k in m.storage_data}),
        lambda m: setattr(m, "storage_data", {k: _StorageInfo("/etc/passwd", 0, 10) for k in m.storage_data}),
        lambda m: setattr(m, "storage_data", {k: _StorageInfo("__0_0.distcp", -5, 10) for k in m.storage_data}),
        lambda m: setattr(m, "storage_data", {k: _StorageInfo("__0_0.distcp", 0, 2**70) for k in m.storage_data}),
        lambda m: setattr(m, "storage_data", {MetadataIndex(7): v for v in m.storage_data.values()}),  # type: ignore[arg-type]
        lambda m: setattr(m, "storage_data", {}),
        lambda m: m.state_dict_metadata["w"].chunks.append(m.state_dict_metadata["w"].chunks[0]),
        lambda m: setattr(m.state_dict_metadata["w"].properties, "dtype", "float32"),
        lambda m: setattr(m.state_dict_metadata["w"].properties, "requires_grad", "yes"),
        lambda m: setattr(m, "version", 3),
    ],
    ids=[
        "dict-as-list",
        "info-as-string",
        "parent-path",
        "absolute-path",
        "negative-offset",
        "huge-length",
        "fqn-not-a-string",
        "no-locations",
        "chunk-twice",
        "dtype-as-string",
        "bool-as-string",
        "version-as-int",
    ],
)
def test_wrong_types_and_values_are_refused(tmp_path: Path, forge: Any) -> None:
    folder = tmp_path / "ck"
    _saved(folder)
    metadata = _read(folder)
    forge(metadata)
    _write(folder, metadata)
    with pytest.raises(AiosnapError) as caught:
        load(None, folder, config=QUIET)
    assert isinstance(caught.value, CorruptCheckpointError), caught.value


def test_a_forged_blob_header_is_refused(tmp_path: Path) -> None:
    """The archive of an item: its pickle forged to name another shape, or a gadget."""
    folder = tmp_path / "ck"
    _saved(folder)
    data_file = folder / "__0_0.distcp"
    raw = bytearray(data_file.read_bytes())
    where = raw.find(b"torch._utils")
    assert where > 0
    raw[where : where + 12] = b"os.system\x00\x00\x00"  # the rebuild function of an item, replaced
    data_file.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        load(None, folder, config=QUIET)


def _outcome(ckpt: SyncCheckpointer, state: dict[str, Any]) -> None:
    """Loads bit-exact, or fails with an AiosnapError (a damaged file may still parse)."""
    try:
        restored = ckpt.load()
    except AiosnapError:
        return
    assert_same(restored["w"], state["w"])
    assert_same(restored["b"], state["b"])


def test_fuzzed_metadata_bytes_fail_cleanly(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    cases = max(50, int(request.config.getoption("--fuzz-cases")) // 20)
    rng = random.Random(22)
    for writer in ("torch", "aiosnap"):
        folder = tmp_path / writer
        state = _saved(folder, writer)
        original = (folder / ".metadata").read_bytes()
        ckpt = SyncCheckpointer(QUIET, storage=checkpoint_storage(folder))
        for _ in range(cases):
            data = bytearray(original)
            how = rng.random()
            if how < 0.4:
                for _ in range(rng.randint(1, 4)):
                    data[rng.randrange(len(data))] = rng.randrange(256)
            elif how < 0.7:
                data = data[: rng.randrange(len(data))]
            else:
                at = rng.randrange(len(data))
                data[at:at] = rng.randbytes(rng.randint(1, 16))
            (folder / ".metadata").write_bytes(bytes(data))
            try:
                parse_metadata(bytes(data), "fuzz")
            except CorruptCheckpointError:
                continue
            _outcome(ckpt, state)
        ckpt.close()
        (folder / ".metadata").write_bytes(original)


def _fields(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Attribute and item paths into a Metadata object graph."""
    found = [path]
    if isinstance(value, dict):
        for key in list(value)[:20]:
            found += _fields(value[key], (*path, ("item", key)))
    elif isinstance(value, list):
        for index, item in enumerate(value[:5]):
            found += _fields(item, (*path, ("item", index)))
    elif hasattr(value, "__dict__") and not isinstance(value, (torch.dtype, type)):
        for name in list(vars(value))[:10]:
            found += _fields(getattr(value, name), (*path, ("attr", name)))
    return found


def _set(root: Any, path: tuple[Any, ...], value: Any) -> None:
    target = root
    for kind, key in path[:-1]:
        target = target[key] if kind == "item" else getattr(target, key)
    kind, key = path[-1]
    if kind == "item":
        target[key] = value
    else:
        object.__setattr__(target, key, value)


def test_forged_metadata_fields_fail_cleanly(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    cases = max(50, int(request.config.getoption("--fuzz-cases")) // 20)
    rng = random.Random(23)
    pwned = tmp_path / MARKER
    extra = [
        torch.Size([2, 2]), torch.Size([2**62]), torch.float64, Gadget(pwned), _StorageInfo("x.distcp", 0, 1),
        laughs(10, 7),  # 10**7 values from a few hundred bytes: never rebuilt as a tree
    ]  # fmt: skip
    for writer in ("torch", "aiosnap"):
        folder = tmp_path / writer
        state = _saved(folder, writer)
        backup = tmp_path / f"{writer}.bak"
        shutil.copytree(folder, backup)
        original = _read(folder)
        paths = [p for p in _fields(original) if p]
        ckpt = SyncCheckpointer(QUIET, storage=checkpoint_storage(folder))
        for _ in range(cases):
            forged = copy.deepcopy(original)
            for _ in range(rng.randint(1, 3)):
                value = rng.choice([*INTERESTING, *extra])  # not deep-copied: copying a gadget runs it
                try:
                    _set(forged, rng.choice(paths), value)
                except (KeyError, IndexError, AttributeError, TypeError):
                    continue
            try:
                _write(folder, forged)
            except (pickle.PicklingError, TypeError, AttributeError, RecursionError, RuntimeError):
                continue
            _outcome(ckpt, state)
        ckpt.close()
        shutil.rmtree(folder)
        shutil.copytree(backup, folder)
    assert not pwned.exists()
