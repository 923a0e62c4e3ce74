"""The converter: every source format (an aiosnap root, an aiosnap single file, a DCP folder
by torch's writer and by aiosnap's, a torch.save file) to every destination format (an
aiosnap root, a DCP folder, a torch.save file), each result read back by that format's own
reader (aiosnap's load, torch's ``FileSystemReader``, ``torch.load(weights_only=True)``) and
compared bit for bit with the saved state; partial exports; hostile sources; the CLI."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from aiosnap import ChecksumMismatchError, CorruptCheckpointError, PickleNotAllowedError, SyncCheckpointer, export
from aiosnap.cli import main as cli
from aiosnap.dcp import StorageWriter
from aiosnap.interop.singlefile import ArchiveStorage
from tests.conftest import assert_same
from tests.memory_probe import SLACK, needs_peak_rss, run_probe
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(120),
]

MiB = 1024 * 1024
SMALL = {"ram_budget": "1MiB", "upload": {"chunk_size": "64KiB"}, "events": {"log": False}}
SOURCES = ("aiosnap-root", "aiosnap-file", "dcp-torch", "dcp-aiosnap", "torch-file")
SINKS = ("aiosnap", "dcp", "torch")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {
        "model": {
            "w": torch.randn(200, 300, generator=g),  # 240 KB: several objects, tiles, pieces
            "b": torch.arange(6, dtype=torch.int64),
            "bf16": torch.randn(5, 3, generator=g).bfloat16(),
            "mask": torch.arange(9) % 2 == 0,
            "scalar": torch.tensor(1.5),
            "empty": torch.empty(0, 4),
        },
        "optim": {"step": torch.tensor(4.0), "lr": 0.001},
        "epoch": 3,
    }


def _make(kind: str, folder: Path, state: dict[str, Any]) -> Path:
    """The state saved as a checkpoint of ``kind`` at ``folder/<kind>``."""
    path = folder / kind
    if kind == "aiosnap-root":
        with SyncCheckpointer({**SMALL, "storage": {"url": str(path)}}) as ckpt:
            ckpt.save(state, step=9).wait(timeout=30)
    elif kind == "aiosnap-file":
        path = folder / "single.ckpt"
        with SyncCheckpointer(
            {**SMALL, "storage": {"url": str(folder / "unused")}}, storage=ArchiveStorage(path)
        ) as ckpt:
            ckpt.save(state, step=9).wait(timeout=30)
    elif kind == "dcp-torch":
        dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
    elif kind == "dcp-aiosnap":
        dcp.save(state, storage_writer=StorageWriter(path, SMALL), no_dist=True)
    else:
        path = folder / "plain.pt"
        torch.save(state, path)
    return path


def _zeros(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _zeros(v) for k, v in value.items()}
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else None


def _read(kind: str, path: Path, like: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint at ``path`` read by its own format's reader."""
    if kind == "aiosnap":
        with SyncCheckpointer({**SMALL, "storage": {"url": str(path)}}) as ckpt:
            loaded: dict[str, Any] = ckpt.load()
            return loaded
    if kind == "dcp":
        target = _zeros(like)
        dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
        return target
    found: dict[str, Any] = torch.load(path, weights_only=True)
    return found


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("sources")
    state = _state()
    return {kind: _make(kind, folder, state) for kind in SOURCES}


@pytest.mark.parametrize("sink", SINKS)
@pytest.mark.parametrize("source", SOURCES)
def test_every_direction_bit_for_bit(sources: dict[str, Path], source: str, sink: str, tmp_path: Path) -> None:
    state = _state()
    dest = tmp_path / ("out.pt" if sink == "torch" else "out")
    result = export(str(sources[source]), str(dest), to=sink, config=SMALL)
    assert result.entries == 7 and result.nbytes == sum(
        t.numel() * t.element_size() for part in (state["model"], state["optim"]) for t in part.values()
        if isinstance(t, torch.Tensor)
    )  # fmt: skip
    loaded = _read(sink, dest, state)
    assert_same(loaded["model"], state["model"])
    assert_same(loaded["optim"], state["optim"])
    assert loaded["epoch"] == 3


def test_partial_exports_take_only_the_paths_asked_for(sources: dict[str, Path], tmp_path: Path) -> None:
    state = _state()
    result = export(str(sources["dcp-torch"]), str(tmp_path / "m.pt"), to="torch", paths=["model/*"], config=SMALL)
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(loaded) == ["model"] and result.entries == 6
    assert_same(loaded["model"], state["model"])
    export(str(sources["aiosnap-root"]), str(tmp_path / "b"), to="aiosnap", paths=["model/b", "epoch"], config=SMALL)
    with SyncCheckpointer({**SMALL, "storage": {"url": str(tmp_path / "b")}}) as ckpt:
        assert ckpt.steps() == [9]
        assert_same(ckpt.load(), {"model": {"b": state["model"]["b"]}, "epoch": 3})


def test_an_export_never_replaces_what_is_there(sources: dict[str, Path], tmp_path: Path) -> None:
    export(str(sources["torch-file"]), str(tmp_path / "d"), to="dcp", config=SMALL)
    before = sorted(os.listdir(tmp_path / "d"))
    with pytest.raises(FileExistsError):
        export(str(sources["torch-file"]), str(tmp_path / "d"), to="dcp", config=SMALL)
    assert sorted(os.listdir(tmp_path / "d")) == before
    (tmp_path / "x.pt").write_bytes(b"mine")
    with pytest.raises(FileExistsError):
        export(str(sources["torch-file"]), str(tmp_path / "x.pt"), to="torch", config=SMALL)
    assert (tmp_path / "x.pt").read_bytes() == b"mine"
    assert not list(tmp_path.glob(".*partial"))


def test_damaged_sources_are_refused_and_leave_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    dcp.save({"w": torch.arange(50_000.0)}, storage_writer=StorageWriter(folder, SMALL), no_dist=True)
    data_file = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    for sink, dest in (("torch", tmp_path / "o.pt"), ("dcp", tmp_path / "o"), ("aiosnap", tmp_path / "r")):
        with pytest.raises(ChecksumMismatchError):
            export(str(folder), str(dest), to=sink, config=SMALL)
        assert not dest.exists() or not any(p.name in (".metadata",) or p.suffix == ".json" for p in dest.rglob("*"))
    assert not list(tmp_path.glob(".*partial"))


class Gadget:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


def test_a_hostile_torch_file_runs_nothing(tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    torch.save({"w": torch.ones(3), "evil": Gadget(pwned)}, tmp_path / "evil.pt")
    with pytest.raises(CorruptCheckpointError, match="posix.system"):
        export(str(tmp_path / "evil.pt"), str(tmp_path / "o"), to="aiosnap", config=SMALL)
    assert not pwned.exists()
    torch.save({"w": torch.ones(3), "odd": {1, 2}}, tmp_path / "set.pt")  # a set: plain, but no aiosnap tree holds it
    with pytest.raises(CorruptCheckpointError):
        export(str(tmp_path / "set.pt"), str(tmp_path / "o2"), to="aiosnap", config=SMALL)


def test_pickled_values_need_allow_pickle_to_change_format(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with SyncCheckpointer({**SMALL, "storage": {"url": str(root)}, "pickle_values": True}) as ckpt:
        ckpt.save({"w": torch.ones(3), "odd": {1, 2}}, step=1).wait(timeout=30)
    with pytest.raises(PickleNotAllowedError):
        export(str(root), str(tmp_path / "o.pt"), to="torch", config=SMALL)
    export(str(root), str(tmp_path / "o.pt"), to="torch", config=SMALL, allow_pickle=True)
    assert torch.load(tmp_path / "o.pt", weights_only=False)["odd"] == {1, 2}
    export(str(root), str(tmp_path / "copy"), to="aiosnap", config=SMALL)  # bytes copied, nothing unpickled
    with SyncCheckpointer({**SMALL, "storage": {"url": str(tmp_path / "copy")}}) as ckpt:
        assert ckpt.load(allow_pickle=True)["odd"] == {1, 2}


def test_the_cli(sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dcp_folder = str(sources["dcp-torch"])
    assert cli(["ls", dcp_folder]) == 0
    captured = capsys.readouterr()
    assert "is a DCP checkpoint" in captured.err and "committed" in captured.out
    assert cli(["info", dcp_folder, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "a DCP checkpoint"
    assert cli(["verify", sources["dcp-aiosnap"].as_posix()]) == 0
    assert "verified" in capsys.readouterr().out
    out = tmp_path / "cli.pt"
    assert cli(["export", dcp_folder, str(out), "--to", "torch", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["to"] == "torch" and doc["source_kind"] == "a DCP checkpoint" and doc["entries"] == 7
    assert_same(torch.load(out, weights_only=True)["model"], _state()["model"])
    assert cli(["export", dcp_folder, str(tmp_path / "x"), "--to", "zip"]) == 2
    (tmp_path / "exp.pt").write_bytes(b"x")
    assert cli(["download", str(sources["aiosnap-root"]), str(tmp_path / "exp.pt")]) == 1
    assert "is a file" in capsys.readouterr().err
    assert cli(["download", dcp_folder, str(tmp_path / "dl")]) == 1
    assert "aiosnap export" in capsys.readouterr().err


def test_the_cli_answers_for_a_dcp_folder_without_torch(sources: dict[str, Path]) -> None:
    code = (
        "import sys\nfrom aiosnap.cli import main\nstatus = main(['info', sys.argv[1]])\n"
        "print('torch' in sys.modules, status)"
    )
    run = subprocess.run([sys.executable, "-c", code, str(sources["dcp-aiosnap"])], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})  # fmt: skip
    assert run.stdout.strip().splitlines()[-1] == "False 0", run.stdout + run.stderr


def test_pickle_of_the_gadget_is_what_we_think(tmp_path: Path) -> None:
    """The gadget above is real: plain unpickling runs it."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Gadget(marker)))
    assert marker.exists()


@needs_peak_rss
def test_an_export_ten_times_the_budget_streams_within_it(tmp_path: Path) -> None:
    budget_mib = 16
    source = tmp_path / "dcp"
    g = torch.Generator().manual_seed(1)
    state = {"a": torch.randn(20 * MiB, generator=g), "b": torch.randn(4 * MiB, generator=g).view(1024, -1),
             "small": {str(i): torch.randn(100, generator=g) for i in range(50)}}  # fmt: skip
    state["c"] = torch.randn(16 * MiB, generator=g)  # 160 MiB in all: 10x the budget
    dcp.save(state, storage_writer=FileSystemWriter(source), no_dist=True)
    del state
    figures = run_probe(source, budget_mib, "export", str(tmp_path))
    for to, found in figures["exports"].items():
        assert found["nbytes"] >= 10 * figures["budget"], (to, found)
        assert found["rss_increase"] <= figures["budget"] + SLACK, (to, figures)


def test_verify_lists_damage_in_a_dcp_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "ck"
    dcp.save({"w": torch.arange(20_000.0)}, storage_writer=StorageWriter(folder, SMALL), no_dist=True)
    assert cli(["verify", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unverified_bytes"] == 0  # aiosnap wrote it: every range checked
    data_file = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    assert cli(["verify", str(folder)]) == 1
    assert "checksum mismatch" in capsys.readouterr().err
    torch_written = tmp_path / "torch"
    dcp.save({"w": torch.arange(20_000.0)}, storage_writer=FileSystemWriter(torch_written), no_dist=True)
    assert cli(["verify", str(torch_written)]) == 0
    assert "no recorded checksum" in capsys.readouterr().out


def test_verify_finds_damage_outside_a_dcp_payload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A damaged byte of an item's archive around its tensor's bytes -- its first local
    header, data.pkl and headers before the payload, the zip directory after it -- which
    torch's reader trips on: verify checks the crc32c aiosnap's writer recorded for the
    whole item, and says so (exit 1)."""
    from aiosnap.interop.dcp.checksums import SaveChecksums

    folder = tmp_path / "ck"
    dcp.save({"w": torch.arange(1000.0)}, storage_writer=StorageWriter(folder, SMALL), no_dist=True)
    sums = next(folder.glob(".aiosnap-checksums.*"))
    ((file, offset, length, _, at, _, _),) = SaveChecksums.from_json(sums.read_bytes(), str(sums)).items
    pristine = (folder / file).read_bytes()
    for where in (offset + 1, at - 100, offset + length - 30):
        raw = bytearray(pristine)
        raw[where] ^= 0xFF
        (folder / file).write_bytes(bytes(raw))
        assert cli(["verify", str(folder)]) == 1, where
        assert "checksum mismatch" in capsys.readouterr().err
    (folder / file).write_bytes(pristine)
    assert cli(["verify", str(folder)]) == 0
