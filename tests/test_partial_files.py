"""Issue 26, item 10: where a single-file save writes before it commits. Listings of the
checkpoint's folder show only checkpoints while saves are in flight (Lightning's own tests
list it), in either upload executor; a killed writer leaves nothing behind; without
``O_TMPFILE`` or hard links the save still commits; a spool that resumes saves keeps named
partial files, and a save killed at its commit is finished by the next process."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("lightning")

from aiosnap import Config
from aiosnap.cli import app
from aiosnap.integrations.lightning import AiosnapCheckpointIO, checkpoint_storage
from aiosnap.interop.partialfile import PartialFile, partial_name
from aiosnap.interop.singlefile import ArchiveStorage, is_archive
from tests.process_faults import CommitWaitsForRelease

REPO = Path(__file__).parent.parent
STATE = {"w": torch.arange(100_000, dtype=torch.float32), "global_step": 3}  # several 64 KiB chunks


def _config(executor: str = "thread", **extra: Any) -> Config:
    return Config(ram_budget="16MiB", upload={"chunk_size": "64KiB", "executor": executor}, **extra)


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _gated(gate: Path, **kwargs: Any) -> Callable[[str, Config], ArchiveStorage]:
    return lambda url, cfg: CommitWaitsForRelease(url, str(gate), **kwargs)


def _committed_before(folder: Path, name: str = "old.ckpt") -> Path:
    path = folder / name
    plugin = AiosnapCheckpointIO(_config())
    plugin.save_checkpoint({"w": torch.zeros(10), "global_step": 1}, path)
    plugin.teardown()
    return path


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_listings_show_only_checkpoints_while_saves_are_in_flight(tmp_path: Path, executor: str) -> None:
    folder, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    old = _committed_before(folder)
    plugin = AiosnapCheckpointIO(_config(executor), storage_for=_gated(gate))
    for path in (folder / "new.ckpt", old):  # a first save, then one replacing a file
        plugin.save_checkpoint(STATE, path)
        _wait_for(lambda: (gate / "waiting").exists(), "the commit")  # every chunk has landed
        assert sorted(os.listdir(folder)) == ["new.ckpt", "old.ckpt"]
        (gate / "release").touch()
        assert plugin.load_checkpoint(path)["global_step"] == 3
        assert sorted(os.listdir(folder)) == ["new.ckpt", "old.ckpt"]
        (gate / "waiting").unlink()
        (gate / "release").unlink()
    plugin.teardown()
    assert torch.equal(torch.load(old)["w"], STATE["w"]) and is_archive(folder / "new.ckpt")


def _save_and_hang(tmp_path: Path, gate: Path, path: Path, config: str) -> subprocess.Popen[str]:
    """A process that saves ``STATE`` to ``path`` (as step 2) through a gated storage and
    waits (a plain checkpointer: no Lightning to import)."""
    script = textwrap.dedent(
        f"""
        import sys, time, torch
        sys.path.insert(0, {str(REPO)!r})
        from aiosnap import Config, SyncCheckpointer
        from tests.process_faults import CommitWaitsForRelease
        config = Config.model_validate({config})
        storage = CommitWaitsForRelease.for_config({str(path)!r}, config, gate={str(gate)!r})
        view = SyncCheckpointer(config).at({str(path)!r}, keep_last=1, storage=storage)
        view.save({{"w": torch.arange(100_000, dtype=torch.float32), "global_step": 3}}, step=2)
        time.sleep(120)
        """
    )
    return subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, text=True, stderr=subprocess.PIPE)


def _kill_the_writer(gate: Path, process: subprocess.Popen[str]) -> None:
    """SIGKILL the process that holds the save's partial file (the trainer, or its upload
    process), then the trainer, and wait until both are gone."""
    try:
        _wait_for(lambda: (gate / "waiting").exists() or process.poll() is not None, "the commit")
        assert process.poll() is None, process.communicate()[1][-3000:]
        writer = int((gate / "waiting").read_text())
        os.kill(writer, signal.SIGKILL)
    finally:
        process.kill()
        process.communicate(timeout=30)
    _wait_for(lambda: not os.path.exists(f"/proc/{writer}") or "Z" in _state(writer), "the writer to die")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_writer_killed_mid_save_leaves_nothing_behind(tmp_path: Path, executor: str) -> None:
    folder, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    old = _committed_before(folder)
    writer = _save_and_hang(tmp_path, gate, old, repr(_config(executor).model_dump(mode="json")))
    _kill_the_writer(gate, writer)
    assert os.listdir(folder) == ["old.ckpt"]  # no partial file, named or not
    assert torch.equal(torch.load(old)["w"], torch.zeros(10))  # the previous version stands


def _no_tmpfile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real ``os.open``, failing ``O_TMPFILE`` as a file system without it does."""
    real = os.open

    def open_(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported (injected)", str(path))
        return real(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", open_)


def _no_links_from_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real ``os.link``, failing to link an unnamed file as a file system without hard
    links does."""
    real = os.link

    def link(src: Any, dst: Any, **kwargs: Any) -> None:
        if str(src).startswith("/proc/self/fd/"):
            raise OSError(errno.EPERM, "Operation not permitted (injected)", str(dst))
        real(src, dst, **kwargs)

    monkeypatch.setattr(os, "link", link)


@pytest.mark.skipif(not hasattr(os, "O_TMPFILE"), reason="Linux O_TMPFILE")
@pytest.mark.parametrize("missing", ["o_tmpfile", "hard_links"])
def test_without_o_tmpfile_or_links_a_save_still_commits_whole(
    tmp_path: Path, missing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    old = _committed_before(folder)
    (_no_tmpfile if missing == "o_tmpfile" else _no_links_from_proc)(monkeypatch)
    plugin = AiosnapCheckpointIO(_config(), storage_for=_gated(gate))
    for path in (folder / "new.ckpt", old):
        plugin.save_checkpoint(STATE, path)
        _wait_for(lambda: (gate / "waiting").exists(), "the commit")
        partials = [n for n in os.listdir(folder) if n.endswith(".aiosnap-partial")]
        assert len(partials) == (1 if missing == "o_tmpfile" else 0)  # today's hidden name, as a fallback
        (gate / "release").touch()
        assert torch.equal(plugin.load_checkpoint(path)["w"], STATE["w"])  # verified: every crc32c
        (gate / "waiting").unlink()
        (gate / "release").unlink()
    plugin.teardown()
    assert sorted(os.listdir(folder)) == ["new.ckpt", "old.ckpt"]


@pytest.mark.parametrize("resumer", ["plugin", "cli"])
def test_a_spool_keeps_partial_files_and_a_killed_save_is_finished(tmp_path: Path, resumer: str) -> None:
    folder, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    # the same storage.url in both processes: a spool resumes the saves of its own checkpointer;
    # a trainer that does not resume at start (spool.resume false) leaves its saves to `aiosnap resume`
    spool = {"dir": str(tmp_path / "spool"), "mode": "always", "resume": resumer == "plugin"}
    spooled = _config(spool=spool, storage={"url": str(tmp_path / "r")})
    old = _committed_before(folder)
    writer = _save_and_hang(tmp_path, gate, old, repr(spooled.model_dump(mode="json")))
    _kill_the_writer(gate, writer)
    left = sorted(os.listdir(folder))
    assert len(left) == 2 and left[0].endswith(".aiosnap-partial"), left  # what landed, for the resume
    if resumer == "plugin":
        resumed = AiosnapCheckpointIO(spooled)
        assert torch.equal(resumed.load_checkpoint(old)["w"], STATE["w"])  # finished from the spool, then loaded
        resumed.teardown()
    else:
        (tmp_path / "job.yaml").write_text(json.dumps(spooled.model_dump(mode="json")))  # JSON is YAML
        ran = CliRunner().invoke(app, ["resume", "-c", str(tmp_path / "job.yaml"), "--root", str(old), "--json"])
        assert ran.exit_code == 0 and json.loads(ran.stdout)["resumed"] == [2], ran.output
        assert torch.equal(torch.load(old)["w"], STATE["w"]) and torch.load(old)["global_step"] == 3
    assert os.listdir(folder) == ["old.ckpt"]


@pytest.mark.skipif(not hasattr(os, "O_TMPFILE"), reason="Linux O_TMPFILE")
def test_a_named_partial_on_disk_is_the_one_written_whatever_the_kind_asked(tmp_path: Path) -> None:
    # what a crash left: the chunks of a save in its named partial file (a trainer whose spool
    # resumes, or an unnamed file linked to its hidden name just before the rename over ``P``)
    target = tmp_path / "old.ckpt"
    target.write_bytes(b"the previous checkpoint")
    name = partial_name(target, "000000000002", "0123456789abcdef")
    name.write_bytes(b"chunks that landed|")
    resumed = PartialFile(target, name, resumable=False)  # a resumer that would write unnamed files
    assert resumed.landed_size() == len(b"chunks that landed|")  # what it will write into, no other file
    os.pwrite(resumed.fd(), b"tail", len(b"chunks that landed|"))
    resumed.publish()
    assert target.read_bytes() == b"chunks that landed|tail" and os.listdir(tmp_path) == ["old.ckpt"]


@pytest.mark.skipif(not hasattr(os, "O_TMPFILE"), reason="Linux O_TMPFILE")
def test_an_unnamed_partial_never_takes_a_name_it_did_not_make(tmp_path: Path) -> None:
    target = tmp_path / "old.ckpt"
    target.write_bytes(b"the previous checkpoint")
    name = partial_name(target, "000000000002", "0123456789abcdef")
    mine = PartialFile(target, name, resumable=False)
    os.pwrite(mine.fd(), b"new bytes", 0)  # unnamed: listings do not see it
    assert os.listdir(tmp_path) == ["old.ckpt"] and mine.landed_size() == len(b"new bytes")
    name.write_bytes(b"another process's partial file of this save")
    with pytest.raises(FileExistsError):
        mine.publish()
    assert name.read_bytes() == b"another process's partial file of this save"  # not unlinked
    assert target.read_bytes() == b"the previous checkpoint"


def test_whenever_a_spool_is_on_partial_files_are_named(tmp_path: Path) -> None:
    # the trainer and `aiosnap resume` (which turns spool.resume off in its copy) must agree
    spool = {"dir": str(tmp_path / "spool"), "mode": "always"}
    for resume in (True, False):
        config = _config(spool={**spool, "resume": resume})
        assert ArchiveStorage.for_config(tmp_path / "x.ckpt", config).resumable_partials
        assert isinstance(storage := checkpoint_storage(str(tmp_path / "x.ckpt"), config), ArchiveStorage)
        assert storage.resumable_partials
    assert not ArchiveStorage.for_config(tmp_path / "x.ckpt", _config()).resumable_partials
