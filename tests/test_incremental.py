"""Incremental saves (``upload.dedup``, issue 24): a range whose captured bytes equal one of
the root's latest committed step is not uploaded again; the manifest names that range.

Real files, real torch, real training steps (a LoRA-style fine-tune: a frozen base with
``requires_grad=False``, adapters and their Adam state trained), both upload executors, the
spool with a resume, and S3 (moto). What each step owns is read from its manifest."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Config, CorruptCheckpointError, SyncCheckpointer
from aiosnap.catalog.pins import pins_for
from aiosnap.config import RetentionConfig
from aiosnap.core.checksums import crc32c_of
from aiosnap.core.names import attempt_of_object, step_dir
from aiosnap.format.journal import JOURNAL
from aiosnap.format.manifest import Manifest
from aiosnap.storage.base import Storage
from aiosnap.storage.local import LocalStorage
from aiosnap.transfer.readback import READ_BUFFER_BYTES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import CliRunner, FaultyStorage, assert_same, damage_entry, s3_config
from tests.dist_launch import run_ranks
from tests.fuzzing import mutate_document, sign_manifest
from tests.referencing import on_root

pytestmark = pytest.mark.both_executors


class _LoraLinear(torch.nn.Module):
    """A frozen linear layer and a trained low-rank update."""

    def __init__(self, n_in: int, n_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = torch.nn.Linear(n_in, n_out)
        self.base.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, n_in) * 0.01)
        self.lora_b = torch.nn.Parameter(torch.zeros(n_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


def _fine_tune(layers: int = 6, width: int = 256) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_LoraLinear(width, width) for _ in range(layers)))
    trained = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.Adam(trained, lr=1e-2)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        x = torch.randn(8, 256)
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy({"model": state["model"].state_dict(), "optim": state["optim"].state_dict()})


def _config(root: Path, **upload: Any) -> Config:
    return Config(
        storage={"url": str(root)},
        ram_budget="8MiB",
        upload={"chunk_size": "1MiB", "concurrency": 4, "dedup": True, **upload},
        retention={"keep_last": None},  # what retention keeps of referenced steps: the catalog's tests
    )


def _changed_bytes(model: torch.nn.Module) -> int:
    """The bytes a trained step changes: adapters and their two Adam moments."""
    return 3 * sum(p.nbytes for p in model.parameters() if p.requires_grad)


def test_a_fine_tune_saved_five_times_writes_only_what_changed_and_loads_bit_exact(root: Path) -> None:
    model, optimizer = _fine_tune()
    state = {"model": model, "optim": optimizer}
    frozen = model[2].base.weight
    kept: dict[int, dict[str, Any]] = {}
    with SyncCheckpointer(_config(root)) as ckpt:
        for step in range(1, 6):
            _train(model, optimizer)
            if step == 4:  # a kernel writing frozen bytes without bumping the version counter
                version = frozen._version
                frozen.detach().numpy()[3, :17] += 1.0
                assert frozen._version == version
            ckpt.save(state, step=step).wait()
            kept[step] = _snapshot(state)
        manifests = {step: ckpt.manifest(step) for step in range(1, 6)}
        for step, expected in kept.items():
            assert_same(ckpt.load(step=step), expected)
    total = manifests[1].total_bytes
    assert manifests[1].references is None and manifests[1].own_bytes == total
    changed = _changed_bytes(model)
    for step in (2, 3, 5):
        m = manifests[step]
        assert m.total_bytes >= total - 64 * len(m.entries)  # the same state, wherever its bytes are
        assert changed <= m.own_bytes <= changed + 64 * 4 * len(m.entries), (step, m.own_bytes, changed)
        assert m.own_bytes < 0.1 * total
        for ref in m.references or ():
            found = attempt_of_object(ref.name)
            assert found is not None and found[0] < step
    # step 4 saved the frozen weight again: it changed, although its version did not
    weight = next(e for e in manifests[4].entries if e.path == "model/2.base.weight")
    own = {o.name for o in manifests[4].objects}
    assert all(r.object in own for r in weight.ranges)
    assert manifests[4].own_bytes >= changed + frozen.nbytes
    # and step 5 names step 4's copy of it, not step 1's
    weight5 = next(e for e in manifests[5].entries if e.path == "model/2.base.weight")
    assert {attempt_of_object(r.object)[0] for r in weight5.ranges} == {4}  # type: ignore[index]


def test_a_chunk_mixing_frozen_and_changed_tensors_writes_only_the_changed_ones(root: Path) -> None:
    g = torch.Generator().manual_seed(1)
    state = {
        "frozen_a": torch.randn(3001, generator=g),
        "adapter": torch.randn(17, generator=g),
        "frozen_b": torch.randn(999, generator=g),
        "tiny": torch.ones(1, dtype=torch.bfloat16),
    }
    with SyncCheckpointer(_config(root)) as ckpt:  # one chunk holds all four
        ckpt.save(state, step=1).wait()
        state["adapter"].mul_(2)
        ckpt.save(state, step=2).wait()
        first, second = ckpt.manifest(1), ckpt.manifest(2)
        assert_same(ckpt.load(step=2), state)
    assert len(first.objects) == 1
    assert [o.nbytes for o in second.objects] == [state["adapter"].nbytes]
    assert [r.name for r in second.references or ()] == [first.objects[0].name]
    by_path = {e.path: e for e in second.entries}
    assert by_path["adapter"].ranges[0].object == second.objects[0].name
    for path in ("frozen_a", "frozen_b", "tiny"):
        assert by_path[path].ranges[0].object == first.objects[0].name


def test_equal_tensors_in_one_state_never_name_one_range_twice(root: Path) -> None:
    state = {"a": torch.zeros(1000), "b": torch.zeros(1000), "c": torch.ones(10)}
    with SyncCheckpointer(_config(root)) as ckpt:
        ckpt.save(state, step=1).wait()
        state["b2"] = torch.zeros(1000)  # a third copy of the same bytes
        ckpt.save(state, step=2).wait()
        assert_same(ckpt.load(step=2), state)
        second = ckpt.manifest(2)
    assert second.own_bytes == 4000  # a and b reuse step 1's two ranges; b2 is written


def _restore(source: Path, target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)


def _spooled_config(root: Path, spool_dir: Path, keep_last: int | None) -> Config:
    """Incremental saves through the spool (never resumed at start: the tests resume)."""
    return Config(
        storage={"url": str(root)},
        ram_budget="1MiB",
        upload={"chunk_size": "64KiB", "concurrency": 2, "executor": "thread", "dedup": True},
        spool={"dir": str(spool_dir), "mode": "always", "resume": False},
        retention={"keep_last": keep_last},
    )


def _crashed_incremental_save(tmp_path: Path) -> tuple[Config, dict[str, Any], Path, Path]:
    """Step 1 committed, then an incremental step 2 (``spool.mode: always``) caught by a crash
    while some chunks had landed (those with nothing new, at once) and others were still on
    the spool disk. Returns the config, the state of step 2, and copies of the spool and of
    the root as the crash left them (restore them to play it)."""
    root, spool_dir = tmp_path / "ckpt", tmp_path / "spool"
    config = _spooled_config(root, spool_dir, keep_last=None)
    g = torch.Generator().manual_seed(5)
    state = {"frozen": torch.randn(40_000, generator=g), "adapter": torch.randn(300, generator=g), "n": 1}
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=1).wait()
    state["adapter"].add_(1)
    state["frozen"][-5:] = 0.0  # the last chunk changes too: it is held below
    store = FaultyStorage(LocalStorage(root))
    store.hold_when = lambda name: name.startswith(step_dir(2))
    ckpt = SyncCheckpointer(config, storage=store)
    ckpt.save(state, step=2)
    spool_copy, root_copy = _crash_once_landed(ckpt, spool_dir, root, tmp_path, landed=2)
    return config, state, spool_copy, root_copy


def _crash_once_landed(
    ckpt: SyncCheckpointer, spool_dir: Path, root: Path, tmp_path: Path, landed: int
) -> tuple[Path, Path]:
    """Once the spooled save in flight has journaled ``landed`` landings (chunks with nothing
    new land at once), copy the spool and the root as a crash would leave them, then give the
    save up; returns the copies."""
    journal = next(p for p in spool_dir.iterdir() if p.is_dir()) / JOURNAL
    deadline = time.monotonic() + 20
    while journal.read_text().count('"landed"') < landed:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    spool_copy, root_copy = tmp_path / "spool-copy", tmp_path / "root-copy"
    shutil.copytree(spool_dir, spool_copy, ignore=shutil.ignore_patterns("LOCK"), copy_function=_copy_unless_gone)
    shutil.copytree(root, root_copy)
    with pytest.raises(TimeoutError):
        ckpt.close(timeout=0.1)
    return spool_copy, root_copy


def _play_crash(config: Config, spool_copy: Path, root_copy: Path) -> None:
    assert config.spool.dir is not None
    _restore(spool_copy, Path(config.spool.dir))
    _restore(root_copy, Path(config.storage.url))


@pytest.mark.thread_only  # the storage wrapper that holds writes lives in the trainer's process
def test_a_spooled_incremental_save_resumed_after_a_crash_commits_the_same_references(tmp_path: Path) -> None:
    config, state, spool_copy, root_copy = _crashed_incremental_save(tmp_path)
    _play_crash(config, spool_copy, root_copy)
    with SyncCheckpointer(config) as again:
        report = again.resume_spool()
        assert report.resumed == [2], report
        resumed = again.manifest(2)
        assert_same(again.load(step=2), state)
    assert resumed.references, "the resumed save names step 1's objects"
    assert resumed.own_bytes < resumed.total_bytes // 2


@pytest.mark.thread_only
def test_retention_after_a_resumed_incremental_save_keeps_the_bytes_it_references(tmp_path: Path) -> None:
    config, state, spool_copy, root_copy = _crashed_incremental_save(tmp_path)
    _play_crash(config, spool_copy, root_copy)
    keep_one = config.model_copy(update={"retention": config.retention.model_copy(update={"keep_last": 1})})
    with SyncCheckpointer(keep_one) as again:
        assert again.resume_spool().resumed == [2]
        assert again.steps() == [2]  # step 1 is gone as a checkpoint ...
        named = {o.name for o in again.manifest(2).references or ()}
        assert named and all((Path(config.storage.url) / n).is_file() for n in named)  # ... its bytes are not
        assert_same(again.load(step=2), state)


def _copy_unless_gone(source: str, dest: str) -> None:
    """Copy a spool file that the save may delete meanwhile (a chunk's file goes once its
    landing is journaled: a crash then leaves it gone too)."""
    with contextlib.suppress(FileNotFoundError):
        shutil.copy2(source, dest)


def _crash_while_saving(config: Config, state: dict[str, Any], step: int, chunks_landed: int) -> Path:
    """Save ``step`` with its object writes and manifest held, until ``chunks_landed`` chunks
    landed (those with nothing new land at once), then crash; returns its spool folder."""
    spool = Path(str(config.spool.dir))
    before = {p.name for p in spool.iterdir()} if spool.exists() else set()
    store = FaultyStorage(LocalStorage(config.storage.url))
    store.hold_when = lambda name: name.startswith(step_dir(step))
    ckpt = SyncCheckpointer(config, storage=store)
    ckpt.save(state, step=step)
    folder = next(p for p in spool.iterdir() if p.is_dir() and p.name not in before)
    deadline = time.monotonic() + 20
    while (folder / JOURNAL).read_text().count('"landed"') < chunks_landed:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    copy = folder.parent / f"crashed-{folder.name}"
    shutil.copytree(folder, copy, copy_function=_copy_unless_gone)  # the save goes on meanwhile
    with pytest.raises(TimeoutError):
        ckpt.close(timeout=0.1)
    _restore(copy, folder)
    shutil.rmtree(copy)
    return folder


@pytest.mark.thread_only  # the storage wrapper that holds writes lives in the trainer's process
def test_two_spooled_incremental_saves_resume_in_step_order_and_both_commit(tmp_path: Path) -> None:
    """Steps 2 and 3 left by crashes, both based on step 1 (step 3's adapter is back to step
    1's value: every piece of it is a reference), resumed with ``keep_last: 1``: both commit,
    in step order, and step 2's retention never deletes what step 3's journal references; the
    root ends with step 3 and what it names."""
    root = tmp_path / "ckpt"
    config = _spooled_config(root, tmp_path / "spool", keep_last=1)
    g = torch.Generator().manual_seed(6)
    frozen, adapter = torch.randn(3 * 16 * 1024, generator=g), torch.randn(300, generator=g)  # 3 chunks + 1
    with SyncCheckpointer(config) as ckpt:
        ckpt.save({"frozen": frozen, "adapter": adapter}, step=1).wait()
    second = _crash_while_saving(config, {"frozen": frozen, "adapter": adapter + 1}, 2, chunks_landed=3)
    for _ in range(12):  # resume order must not hang on save ids: make step 2's the first by name
        third = _crash_while_saving(config, {"frozen": frozen, "adapter": adapter}, 3, chunks_landed=4)
        if second.name < third.name:
            break
        shutil.rmtree(third)
    assert second.name < third.name
    with SyncCheckpointer(config) as again:
        report = again.resume_spool()
        assert report.resumed == [2, 3] and not report.discarded, report
        assert again.steps() == [3]
        assert_same(again.load(step=3), {"frozen": frozen, "adapter": adapter})
        named = {o.name for o in again.manifest(3).stored_objects()} | {f"{step_dir(3)}/manifest.json"}
    assert {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} == named


def _edit_landed(journal: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``edit`` to every ``landed`` record that has a landing, re-signing its line."""
    records = [json.loads(line.partition(b" ")[2]) for line in journal.read_bytes().splitlines()]
    for record in records:
        if record.get("kind") == "landed" and "placed" in record:
            edit(record)
    bodies = [json.dumps(record).encode() for record in records]
    journal.write_bytes(b"".join(f"{crc32c_of(body):08x} ".encode() + body + b"\n" for body in bodies))


def _forge_place(record: dict[str, Any]) -> None:
    record["placed"][0][0] = "000000000001/" + "f" * 32 + "/rank-0/0.bin"


def _forge_size(record: dict[str, Any]) -> None:
    record["stored"] = 2**40


def _forge_escape(record: dict[str, Any]) -> None:
    record["references"] = [["../outside.bin", 0, 64]]
    record["placed"][0][0] = "../outside.bin"


def _forge_digest(record: dict[str, Any]) -> None:
    record["placed"][0][2] = "not hex"


def _forge_offset(record: dict[str, Any]) -> None:
    for place in record["placed"]:
        place[1] += 8


class _ForgeSwap:
    """The first two landings that name earlier objects swap them: every name, size and
    offset stays valid, only the bytes are another piece's (a crc32c says so)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def __call__(self, record: dict[str, Any]) -> None:
        if record["references"] and len(self.records) < 2:
            self.records.append(record)
        if len(self.records) == 2:
            first, second = self.records
            first["placed"][0], second["placed"][0] = second["placed"][0], first["placed"][0]
            first["references"], second["references"] = second["references"], first["references"]
            self.records.append({})  # done


@pytest.mark.thread_only
def test_hand_edited_landings_in_a_journal_never_commit_a_step_that_does_not_load(tmp_path: Path) -> None:
    config, state, spool_copy, root_copy = _crashed_incremental_save(tmp_path)
    rng = random.Random(7)
    edits: list[Callable[[dict[str, Any]], None]] = [_forge_place, _forge_size, _forge_escape, _forge_digest]
    edits += [_forge_offset, _ForgeSwap()]
    edits += [functools.partial(_fuzz_record, random.Random(rng.random())) for _ in range(12)]
    for edit in edits:
        _play_crash(config, spool_copy, root_copy)
        assert config.spool.dir is not None
        journal = next(p for p in Path(config.spool.dir).iterdir() if p.is_dir()) / JOURNAL
        _edit_landed(journal, edit)
        with SyncCheckpointer(config) as again:
            report = again.resume_spool()
            if 2 in again.steps():  # committed: then it loads, bit-exact
                assert_same(again.load(step=2), state)
            else:
                assert report.resumed == [], (edit, report)
            assert_same(again.load(step=1)["frozen"][:10], state["frozen"][:10])


@pytest.mark.thread_only  # the storage wrapper that holds writes lives in the trainer's process
@pytest.mark.parametrize("field", ["shuffle", "stored"])
def test_a_journal_whose_codec_fields_were_edited_never_commits_a_step_that_does_not_load(
    tmp_path: Path, field: str
) -> None:
    """A compressed incremental save caught by a crash; its journal's landed records edited in
    one field each (lines re-signed): the byte shuffle of a compressed range (frame and crc32c
    untouched: the frame's crc32c still matches, so the resume decompresses every range it
    would commit and checks the raw bytes' crc32c), or its stored size (2**62: refused before
    anything of that size is allocated). The leftover is discarded, not kept to fail again,
    and the retention of a commit that would not load never deletes step 1."""
    root, spool_dir = tmp_path / "ckpt", tmp_path / "spool"
    config = _spooled_config(root, spool_dir, keep_last=1)
    config = config.model_copy(update={"upload": config.upload.model_copy(update={"compression": "zstd"})})
    g = torch.Generator().manual_seed(5)
    state = {
        "frozen": (torch.randn(60_000, generator=g) * 0.02).to(torch.bfloat16),
        "adapter": torch.randn(300, generator=g),
    }
    first = copy.deepcopy(state)
    store = FaultyStorage(LocalStorage(root))
    ckpt = SyncCheckpointer(config, storage=store)
    ckpt.save(state, step=1).wait()  # by the same transfer side: step 2 names its frames
    state["adapter"].add_(1)
    state["frozen"][-5:] = 0.0
    store.hold_when = lambda name: name.startswith(step_dir(2))
    ckpt.save(state, step=2)
    spool_copy, root_copy = _crash_once_landed(ckpt, spool_dir, root, tmp_path, landed=1)
    _play_crash(config, spool_copy, root_copy)
    edited = []

    def edit(record: dict[str, Any]) -> None:
        for codec in record.get("codecs") or ():
            if codec is not None and codec[2] == 2:
                codec[2 if field == "shuffle" else 0] = None if field == "shuffle" else 2**62
                edited.append(record)

    _edit_landed(next(p for p in spool_dir.iterdir() if p.is_dir()) / JOURNAL, edit)
    assert edited
    with SyncCheckpointer(config) as again:
        report = again.resume_spool()
        assert report.resumed == [] and report.failed == [] and len(report.discarded) == 1, report
        assert again.steps() == [1]
        assert_same(again.load(step=1), first)


def _fuzz_record(rng: random.Random, record: dict[str, Any]) -> None:
    fields = {k: record[k] for k in ("stored", "placed", "references")}
    record.update(mutate_document(fields, rng))


def test_a_referenced_object_gone_before_the_commit_fails_the_save_and_the_next_writes_whole(root: Path) -> None:
    g = torch.Generator().manual_seed(2)
    state = {"frozen": torch.randn(100_000, generator=g), "adapter": torch.randn(64, generator=g)}
    with SyncCheckpointer(_config(root, chunk_size="128KiB")) as ckpt:
        ckpt.save(state, step=1).wait()
        state["adapter"].add_(1)
        ckpt.save(state, step=2).wait()
        gone = ckpt.manifest(2).references[0]  # type: ignore[index]
        (root / gone.name).unlink()  # another process's purge, say
        with pytest.raises(CorruptCheckpointError, match="step 2.*" + gone.name.replace("/", ".")):
            ckpt.load(step=2)
        state["adapter"].add_(1)
        with pytest.raises(CorruptCheckpointError, match=gone.name.replace("/", ".")):
            ckpt.save(state, step=3).wait()
        assert ckpt.steps() == [1, 2]
        ckpt.save(state, step=4).wait()
        whole = ckpt.manifest(4)
        assert whole.references is None and whole.own_bytes == whole.total_bytes
        assert_same(ckpt.load(step=4), state)
        state["adapter"].add_(1)
        ckpt.save(state, step=5).wait()  # and incremental again, against step 4
        assert ckpt.manifest(5).references
        assert_same(ckpt.load(step=5), state)


@pytest.mark.thread_only  # the pins registry is per process: this one's
def test_the_base_objects_are_pinned_while_a_save_references_them(root: Path) -> None:
    seen: list[frozenset[str]] = []
    store = FaultyStorage(LocalStorage(root))
    store.hold_when = lambda name: seen.append(pins_for(store.url).pinned()) is not None  # records, never holds
    state = {"frozen": torch.randn(50_000), "adapter": torch.randn(10)}
    with SyncCheckpointer(_config(root), storage=store) as ckpt:
        ckpt.save(state, step=1).wait()
        first = {o.name for o in ckpt.manifest(1).objects}
        seen.clear()
        state["adapter"].add_(1)
        ckpt.save(state, step=2).wait()
    assert seen and all(first <= pinned for pinned in seen)
    assert pins_for(store.url).pinned() == frozenset()


@pytest.mark.thread_only  # the storage is this process's
def test_a_save_admitted_while_the_one_before_uploads_takes_the_newest_committed_step_as_its_base(
    root: Path,
) -> None:
    """``max_pending_saves: 2``: step 3 is captured while step 2 still uploads; its base is
    step 2 once step 2 committed (an older base is protected by nothing from another process's
    retention or gc), so it references only objects the newest committed step names."""
    store = FaultyStorage(LocalStorage(root))
    config = _config(root).model_copy(update={"max_pending_saves": 2})
    g = torch.Generator().manual_seed(3)
    frozen, first = torch.randn(256 * 1024, generator=g), torch.randn(64, generator=g)  # one object each
    with SyncCheckpointer(config, storage=store) as ckpt:
        ckpt.save({"frozen": frozen, "adapter": first}, step=1).wait()
        store.hold_when = lambda name: name.startswith(step_dir(2) + "/")
        second = ckpt.save({"frozen": frozen, "adapter": first + 1}, step=2)
        third = ckpt.save({"frozen": frozen, "adapter": first}, step=3)  # back to step 1's value
        store.release(ckpt._loop.loop)  # type: ignore[attr-defined]
        second.wait()
        third.wait()
        newest = {o.name for o in ckpt.manifest(2).stored_objects()}
        references = {o.name for o in ckpt.manifest(3).references or ()}
        assert references and references <= newest, references - newest
        assert_same(ckpt.load(step=3), {"frozen": frozen, "adapter": first})


def test_the_same_step_saved_again_never_references_itself(root: Path) -> None:
    state = {"w": torch.randn(10_000)}
    with SyncCheckpointer(_config(root)) as ckpt:
        ckpt.save(state, step=1).wait()
        ckpt.save(state, step=1).wait()  # a re-save replaces step 1: it cannot name its own bytes
        again = ckpt.manifest(1)
        assert again.references is None
        assert_same(ckpt.load(step=1), state)


@pytest.mark.thread_only
def test_incremental_compressed_saves_to_s3_reference_the_earlier_steps_objects(
    s3_endpoint: str, s3_bucket: str
) -> None:
    config = s3_config(s3_endpoint, s3_bucket, prefix="inc")
    upload = config.upload.model_copy(update={"dedup": True, "compression": "zstd"})
    config = config.model_copy(update={"upload": upload})
    model, optimizer = _fine_tune(layers=3)
    state = {"model": model, "optim": optimizer}
    with SyncCheckpointer(config) as ckpt:
        for step in (1, 2):
            _train(model, optimizer, steps=1)
            ckpt.save(state, step=step).wait()
            expected = _snapshot(state)
        second: Manifest = ckpt.manifest(2)
        assert_same(ckpt.load(step=2), expected)
    assert second.references and second.own_bytes < 0.2 * second.total_bytes
    assert any(r.codec == "zstd" for e in second.entries for r in e.ranges)


_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.int8,
    torch.float64,
    torch.int16,
    torch.float16,
    torch.complex64,
    torch.uint8,
]


@st.composite
def _histories(draw: st.DrawFn) -> list[dict[str, torch.Tensor]]:
    """A few states of the same tensors (random sizes, tiny and odd ones included), each
    changing some tensors (in whole or in part) and keeping the others."""
    count = draw(st.integers(1, 6))
    state: dict[str, torch.Tensor] = {}
    for index in range(count):
        numel = draw(st.sampled_from([1, 3, 17, 255, 1000, 4099, 20_001]))
        dtype = draw(st.sampled_from(_DTYPES))
        seed = draw(st.integers(0, 2**16))
        raw = torch.randint(
            0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
        )
        state[f"t{index}"] = raw.view(dtype)
    history = [{k: v.clone() for k, v in state.items()}]
    for _ in range(draw(st.integers(1, 4))):
        for name in draw(st.lists(st.sampled_from(sorted(state)), unique=True)):
            tensor = state[name].view(torch.uint8)
            at = draw(st.integers(0, tensor.numel() - 1))
            tensor[at] ^= 0x5A  # one byte differs: the whole range is new
        history.append({k: v.clone() for k, v in state.items()})
    return history


@pytest.mark.thread_only
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    history=_histories(),
    chunk=st.sampled_from(["64KiB", "1MiB"]),
    compression=st.sampled_from(["none", "zstd"]),
    keep_last=st.sampled_from([None, 1, 2]),
)
def test_random_histories_saved_with_dedup_load_back_as_saved(
    tmp_path: Path, history: list[dict[str, torch.Tensor]], chunk: str, compression: str, keep_last: int | None
) -> None:
    """What save() accepts loads back exactly: every kept step, with dedup, with or without
    compression, after retention deleted the steps that first wrote what later ones reference."""
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    config = _config(root, chunk_size=chunk, compression=compression)
    config = config.model_copy(update={"retention": RetentionConfig(keep_last=keep_last)})
    with SyncCheckpointer(config) as ckpt:
        for step, state in enumerate(history, start=1):
            ckpt.save(state, step=step).wait()
        kept = ckpt.steps()
        assert kept == list(range(1, len(history) + 1))[-keep_last if keep_last else 0 :]
        for step in kept:
            state = history[step - 1]
            assert_same(ckpt.load(step=step), state)
            manifest = ckpt.manifest(step)
            assert manifest.total_bytes >= sum(t.nbytes for t in state.values())


def test_retention_deletes_steps_but_keeps_the_objects_kept_steps_reference(root: Path) -> None:
    g = torch.Generator().manual_seed(4)
    state = {"frozen": torch.randn(30_000, generator=g), "x": torch.randn(500, generator=g), "adapter": torch.ones(9)}
    config = _config(root).model_copy(update={"retention": _config(root).retention.model_copy(update={"keep_last": 2})})
    kept: dict[int, dict[str, torch.Tensor]] = {}
    with SyncCheckpointer(config) as ckpt:
        for step in range(1, 7):
            if step in (2, 5):
                state["x"].add_(1)  # x written at step 2, named by steps 3 and 4, written again at 5
            state["adapter"].add_(1)
            ckpt.save(state, step=step).wait()
            kept[step] = {k: v.clone() for k, v in state.items()}
            for alive in ckpt.steps():  # whatever retention kept loads, after every save
                assert_same(ckpt.load(step=alive), kept[alive])
        steps = ckpt.steps()
        named = {o.name for s in steps for o in ckpt.manifest(s).references or ()}
    assert steps == [5, 6]  # keep_last counts steps; the bytes kept steps name stay where they are
    assert any(n.startswith(step_dir(1)) for n in named) and all((root / n).is_file() for n in named)
    kept_folders = (step_dir(5), step_dir(6))
    leftover = {n for p in root.rglob("*.bin") if not (n := str(p.relative_to(root))).startswith(kept_folders)}
    assert leftover == {n for n in named if not n.startswith(kept_folders)}  # nothing else of deleted steps


@pytest.mark.thread_only  # the ranks pick their executor themselves: one launch covers both
def test_two_ranks_each_reference_their_own_earlier_objects(tmp_path: Path) -> None:
    root = tmp_path / "root"
    child = Path(__file__).resolve().parent / "incremental_ranks.py"
    results = run_ranks("fine_tune_ranks", 2, tmp_path / "job", child=child, root=str(root), executor="process")
    steps = [r.get("ok", r)["steps"] for r in results]  # type: ignore[index]
    for rank_steps in steps:
        assert [s["same"] for s in rank_steps] == [True, True, True], rank_steps
    first, second, third = steps[0]
    assert first["refs"] == [] and first["own"] == first["total"]
    for later in (second, third):
        assert later["refs"] and later["own"] < 0.1 * later["total"]
        for name, rank in later["refs"]:  # each rank names its own earlier objects only
            assert f"/rank-{rank}/" in name
    assert third["own"] > second["own"]  # rank 1's rank-local tensor changed at step 3


@pytest.mark.thread_only
def test_the_incremental_benchmark_measures_what_dedup_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from aiosnap.bench.incremental import main
    from aiosnap.bench.results import read_figures

    results = tmp_path / "results.jsonl"
    report = main(["--base-mb", "3", "--full-mb", "2", "--saves", "2", "--no-s3", "--results", str(results)])
    assert json.loads(capsys.readouterr().out) == report
    rows = {f.figure: f for f in read_figures(results)}
    assert rows["fine-tune: bytes written per save after the first, dedup on"].ratio < 0.2
    assert rows["bf16 weights + Adam moments: bytes with zstd"].goal == 0.8
    tune, full = report["fine_tune"]["local"], report["full"]["local"]
    on, off = "dedup_on_zstd_off", "dedup_off_zstd_off"
    assert tune[on]["bytes_per_save"] < 0.2 * tune[off]["bytes_per_save"]
    assert full[on]["bytes_per_save"] == full[off]["bytes_per_save"]  # everything changed
    assert full["dedup_off_zstd_on"]["bytes_per_save"] < full[off]["bytes_per_save"]
    assert report["fine_tune"]["dcp_async_save_local"]["durable_s"] > 0


@pytest.mark.thread_only
def test_a_downloaded_incremental_step_stands_alone_and_leaves_objects_copied_before(tmp_path: Path) -> None:
    import asyncio

    from aiosnap.transfer.copy import copy_step

    root, other = tmp_path / "ckpt", tmp_path / "copy"
    g = torch.Generator().manual_seed(6)
    state = {"frozen": torch.randn(60_000, generator=g), "adapter": torch.randn(50, generator=g)}
    with SyncCheckpointer(_config(root, compression="zstd")) as ckpt:
        ckpt.save(state, step=1).wait()
        first_state = {k: v.clone() for k, v in state.items()}
        state["adapter"].add_(1)
        ckpt.save(state, step=2).wait()
        first, second = ckpt.manifest(1), ckpt.manifest(2)
    assert second.references

    async def copy(manifest: Manifest, to: Path = other) -> bool:
        source, dest = LocalStorage(str(root)), LocalStorage(str(to))
        try:
            return await copy_step(source, dest, manifest)
        finally:
            await source.close()
            await dest.close()

    assert asyncio.run(copy(first))
    assert asyncio.run(copy(second))  # the objects of step 1 it names are there already: left alone
    alone = tmp_path / "alone"
    assert asyncio.run(copy(second, alone))  # step 2 only, with the bytes it names
    shutil.rmtree(root)  # the copies stand alone
    with SyncCheckpointer(_config(alone)) as copied:
        assert copied.steps() == [2]
        assert_same(copied.load(step=2), state)
    with SyncCheckpointer(_config(other)) as copied:
        assert copied.steps() == [1, 2]
        assert_same(copied.load(step=2), state)
        assert_same(copied.load(step=1), first_state)


def test_a_base_re_saved_by_another_writer_is_read_again_not_taken_from_the_cache(root: Path) -> None:
    """Writer A caches the base it committed (step 5, its save id); writer B re-saves step 5
    (its old attempt goes). A's next save must see that step 5 is now another save's, read
    its ranges, and reference B's objects: with the cache keyed on the step alone it named
    A's removed objects and failed before its commit."""
    frozen = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    with SyncCheckpointer(_config(root)) as a:
        a.save({"f": frozen, "a": torch.ones(10)}, step=5).wait()
        ours = a.manifest(5).save_id
        with SyncCheckpointer(_config(root)) as b:
            b.save({"f": frozen, "a": torch.zeros(10)}, step=5).wait()
            theirs = b.manifest(5).save_id
        assert theirs != ours
        a.save({"f": frozen, "a": torch.full((10,), 2.0)}, step=6).wait()
        manifest = a.manifest(6)
        assert {ref.name.split("/")[1] for ref in manifest.references or ()} == {theirs}
        assert torch.equal(a.load(step=6)["f"], frozen)


def test_the_spool_takes_digests_only_for_incremental_saves(tmp_path: Path) -> None:
    """An xxh3-128 pass over every spilled chunk is what dedup compares; without
    ``upload.dedup`` the spill costs its crc32c pass alone (no digests in the journal), and
    a spooled save round-trips either way."""
    import asyncio

    from aiosnap.core.checksums import content_digest

    data = memoryview(torch.randn(4096).view(torch.uint8).numpy()).cast("B")
    for dedup in (False, True):
        root, spool_dir = tmp_path / f"ckpt-{dedup}", tmp_path / f"spool-{dedup}"
        config = _config(root, dedup=dedup).model_copy(
            update={"spool": Config(spool={"dir": str(spool_dir), "mode": "always"}).spool}
        )
        with SyncCheckpointer(config) as ckpt:
            spool = ckpt._engine.resources.spool
            assert spool is not None and spool.digests is dedup
            *_, digests = asyncio.run(spool.spill("probe", 0, data, [(0, 1000), (1024, 3000)]))
            assert digests == ([content_digest(data[0:1000]), content_digest(data[1024:4024])] if dedup else None)
            state = {"w": torch.randn(100_000), "b": torch.randn(10)}
            ckpt.save(state, step=1).wait()
            assert all(torch.equal(ckpt.load(step=1)[k], v) for k, v in state.items())


@pytest.mark.thread_only
def test_a_resume_recomputes_the_digests_its_journal_gives_for_spooled_chunks(tmp_path: Path) -> None:
    """The journal's ``spooled`` digests are untrusted like the rest of it: the resume reads
    the spool files anyway (their crc32c), so it takes each piece's digest from the bytes,
    and never commits one the journal made up (the next save would take it for the content
    of that range)."""
    from aiosnap.core.checksums import content_digest

    config, state, spool_copy, root_copy = _crashed_incremental_save(tmp_path)
    _play_crash(config, spool_copy, root_copy)
    assert config.spool.dir is not None
    journal = next(p for p in Path(config.spool.dir).iterdir() if p.is_dir()) / JOURNAL
    forged = "0123456789abcdef0123456789abcdef"
    records = [json.loads(line.partition(b" ")[2]) for line in journal.read_bytes().splitlines()]
    spooled = [r for r in records if r.get("kind") == "spooled" and r.get("digests")]
    assert spooled, "the crash left chunks on the spool"
    for record in spooled:
        record["digests"] = [forged] * len(record["digests"])
    bodies = [json.dumps(record).encode() for record in records]
    journal.write_bytes(b"".join(f"{crc32c_of(body):08x} ".encode() + body + b"\n" for body in bodies))
    with SyncCheckpointer(config) as again:
        assert again.resume_spool().resumed == [2]
        manifest = again.manifest(2)
        assert_same(again.load(step=2), state)
    root = Path(config.storage.url)
    found = {(name, offset): digest for name, offset, digest in manifest.digests or ()}
    assert forged not in found.values()
    for entry in manifest.entries:
        for r in entry.ranges:
            if r.codec is None and (r.object, r.offset) in found:
                with open(root / r.object, "rb") as f:
                    f.seek(r.offset)
                    assert found[(r.object, r.offset)] == content_digest(memoryview(f.read(r.nbytes)))


@pytest.mark.thread_only  # wraps a storage in the trainer's process
def test_a_spool_resume_waits_for_the_saves_in_flight_to_its_root(tmp_path: Path) -> None:
    """A resumed step commits and runs retention, which must not delete what an incremental
    save in flight names: resume_spool() waits for the saves to its root, as rollback does
    (found by the second review: the resumed step's retention deleted an in-flight base)."""
    root = tmp_path / "ckpt"
    config = Config(
        storage={"url": str(root)}, upload={"dedup": True, "executor": "thread"},
        spool={"dir": str(tmp_path / "spool"), "mode": "overflow"}, events={"log": False},
    )  # fmt: skip
    store = FaultyStorage(LocalStorage(root))
    g = torch.Generator().manual_seed(9)
    state = {"frozen": torch.randn(20_000, generator=g), "adapter": torch.zeros(10)}
    with SyncCheckpointer(config, storage=store) as ckpt:
        ckpt.save(state, step=1).wait()
        store.hold_when = lambda name: name.startswith(step_dir(2))
        state["adapter"].add_(1)
        expected = {k: v.clone() for k, v in state.items()}
        handle = ckpt.save(state, step=2)
        reports: list[Any] = []
        resume = threading.Thread(target=lambda: reports.append(ckpt.resume_spool()))
        resume.start()
        resume.join(0.5)
        assert resume.is_alive() and not handle.done()  # the resume waits for the save in flight
        store.release(ckpt._loop.loop)
        resume.join(30)
        assert not resume.is_alive() and handle.done() and reports
        assert_same(ckpt.load(step=2), expected)
        assert ckpt.manifest(2).references


@pytest.mark.thread_only  # slows the trainer-process storage
def test_a_pipelined_save_after_a_reference_went_missing_writes_whole(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With max_pending_saves 2 the next save is admitted before the one whose reference is
    gone fails: it must still write whole once it learns of that failure (second review)."""
    write = LocalStorage.write_checksummed

    async def slow(self: LocalStorage, name: str, data: Any, checksums: Any) -> None:
        if name.startswith(step_dir(2)):
            await asyncio.sleep(0.5)  # step 3 is admitted while step 2 uploads
        await write(self, name, data, checksums)

    monkeypatch.setattr(LocalStorage, "write_checksummed", slow)
    config = Config(
        storage={"url": str(root)}, ram_budget="8MiB", max_pending_saves=2, events={"log": False},
        upload={"chunk_size": "256KiB", "concurrency": 2, "dedup": True, "executor": "thread"},
    )  # fmt: skip
    base = torch.randn(256, 1024, generator=torch.Generator().manual_seed(3))

    def state(step: int) -> dict[str, torch.Tensor]:
        return {"base": base.clone(), "adapter": torch.full((4096,), float(step))}

    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state(1), step=1).wait()
        sorted(root.glob(f"{step_dir(1)}/*/rank-0/0.bin"))[0].unlink()  # taken by someone else
        second = ckpt.save(state(2), step=2)
        third = ckpt.save(state(3), step=3)
        with pytest.raises(CorruptCheckpointError, match="is gone"):
            second.wait(30)
        third.wait(30)  # wrote whole: it names nothing of step 1
        assert not ckpt.manifest(3).references
        assert_same(ckpt.load(step=3), state(3))


@pytest.mark.thread_only  # the storage is this process's
def test_the_base_is_read_once_capture_is_over_not_while_save_blocks(root: Path) -> None:
    """Reading and parsing the base manifest runs on aiosnap's loop, which also drives the
    capture: an incremental save reads it only once the uploads may start (here: capture is
    over), so dedup adds nothing to the time save() blocks."""
    reads: list[tuple[float, str]] = []
    ended: list[float] = []

    class Recording(FaultyStorage):
        async def read(self, name: str, *, limit: int | None = None) -> bytes:
            reads.append((time.time(), name))
            return await super().read(name, limit=limit)

    def on_event(event: Any) -> None:
        if event.op == "save" and event.stage == "capture" and event.kind == "end":
            ended.append(event.time)

    g = torch.Generator().manual_seed(4)
    state = {f"frozen{i}": torch.randn(200_000, generator=g) for i in range(4)}  # 4 chunks: no RAM wait
    state["adapter"] = torch.randn(64, generator=g)
    store = Recording(LocalStorage(root))
    with SyncCheckpointer(_config(root), storage=store, event_handlers=[on_event]) as ckpt:
        ckpt.save(state, step=1).wait()
        state["adapter"].add_(1)
        reads.clear()
        ckpt.save(state, step=2).wait()
        ckpt.flush_events()
        assert ckpt.manifest(2).references  # it did reference step 1
    base_reads = [at for at, name in reads if name == f"{step_dir(1)}/manifest.json"]
    assert base_reads and len(ended) == 2, (reads, ended)
    assert min(base_reads) >= ended[1], f"the base was read {ended[1] - min(base_reads):.4f} s before capture ended"


@pytest.mark.thread_only  # the storage is this process's
@pytest.mark.parametrize("delete_fails", [False, True])
def test_a_reference_deleted_while_the_manifest_is_written_takes_the_commit_back_and_skips_retention(
    root: Path, delete_fails: bool
) -> None:
    """A second job saving to the same root (unsupported: pins are per process) deletes an
    object between this save's reference check and its manifest write: the step would not
    load, so its commit is taken back, retention does not run (it would count that step and
    delete good ones), the save fails typed, and the next save writes whole. If taking it
    back fails too (the delete of its manifest), the step stays, says so, and keeps its data."""

    class Store(FaultyStorage):
        async def delete(self, name: str) -> None:
            if delete_fails and name == f"{step_dir(3)}/manifest.json":
                raise OSError(5, "EIO (injected)")
            await super().delete(name)

    store = Store(LocalStorage(root))
    config = _config(root).model_copy(update={"retention": RetentionConfig(keep_last=2)})
    g = torch.Generator().manual_seed(5)
    state = {"frozen": torch.randn(300_000, generator=g), "adapter": torch.randn(64, generator=g)}
    with SyncCheckpointer(config, storage=store) as ckpt:
        ckpt.save(state, step=1).wait()
        state["adapter"].add_(1)
        ckpt.save(state, step=2).wait()
        referenced = [r.name for r in ckpt.manifest(2).references or ()]
        assert referenced
        store.hold_when = lambda name: name == f"{step_dir(3)}/manifest.json"
        state["adapter"].add_(1)
        third = ckpt.save(state, step=3)
        deadline = time.monotonic() + 30
        while store._gate is None:  # the manifest write waits: its references were checked
            assert time.monotonic() < deadline, "the manifest write was never reached"
            time.sleep(0.01)
        for name in referenced:
            (root / name).unlink()  # the other job's retention
        store.release(ckpt._loop.loop)  # type: ignore[attr-defined]
        said = "stays committed and does not load" if delete_fails else "taken back"
        with pytest.raises(CorruptCheckpointError, match=f"step 3.*{said}"):
            third.wait()
        if delete_fails:  # nothing removed behind a manifest that stands: gc's to judge
            assert ckpt.steps() == [1, 2, 3] and _data_files(root / step_dir(3))
        else:
            assert ckpt.steps() == [1, 2]  # no retention ran; step 3 is not committed
            assert not (root / step_dir(3) / "manifest.json").exists()
            while _data_files(root / step_dir(3)):  # its data goes, in the background
                assert time.monotonic() < deadline, "the taken-back attempt was never removed"
                time.sleep(0.01)
        state["adapter"].add_(1)
        ckpt.save(state, step=4).wait()
        assert ckpt.manifest(4).references is None  # whole
        assert_same(ckpt.load(step=4), state)


def _data_files(folder: Path) -> list[str]:
    """The data objects under ``folder``, listed while they may be being deleted (os.walk
    skips a folder that vanishes under it; ``Path.rglob`` raises)."""
    return [name for _, _, names in os.walk(folder) for name in names if name.endswith(".bin")]


def _frozen_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"frozen": torch.randn(400_000, generator=g), "adapter": torch.zeros(300), "n": 0}


def _trained(state: dict[str, Any], step: int) -> dict[str, Any]:
    state["adapter"].fill_(float(step))
    state["n"] = step
    return copy.deepcopy(state)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_base_range_that_rotted_in_storage_is_written_again_and_every_later_step_loads(
    root: Path, compression: str, upload_executor: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One flipped bit in the frozen tensor's object of a step an earlier process wrote: the
    first save after the restart reads the raw base ranges it would name back (crc32c and
    digest), names none that fails, writes those bytes again, and warns once; compressed
    base ranges an earlier process wrote it never names (it writes them again, once).
    Retention deletes the rotted step and every kept step loads."""
    config = _config(root, compression=compression)
    config = config.model_copy(update={"retention": config.retention.model_copy(update={"keep_last": 2})})
    state = _frozen_state(11)
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=1).wait()
        rotted = next(e for e in ckpt.manifest(1).entries if e.path == "frozen").ranges[0]
    assert (rotted.codec == "zstd") == (compression == "zstd")
    damage_entry(config, "frozen", at=7, mask=0x01)
    kept: dict[int, dict[str, Any]] = {}
    with caplog.at_level(logging.WARNING, logger="aiosnap"), SyncCheckpointer(config) as ckpt:
        for step in range(2, 6):
            kept[step] = _trained(state, step)
            ckpt.save(state, step=step).wait()
            if step == 2:
                frozen = next(e for e in ckpt.manifest(2).entries if e.path == "frozen")
                assert rotted.object not in {r.object for r in frozen.ranges}
                assert frozen.ranges[0].object.startswith(step_dir(2) + "/")  # written again, as step 2's own
                if compression == "none":
                    assert ckpt.manifest(2).references  # the ranges that still hold their bytes are named
                else:  # another process's frames are not named (checking one takes decompressing it)
                    assert not ckpt.manifest(2).references
            elif step == 3:
                assert ckpt.manifest(3).own_bytes < 0.1 * ckpt.manifest(3).total_bytes  # dedup goes on
        assert ckpt.steps() == [4, 5]
        for step in (4, 5):
            assert_same(ckpt.load(step=step), kept[step])
    if upload_executor == "thread":  # the upload process logs in its own process
        warned = [r for r in caplog.records if "do not match the crc32c" in r.getMessage()]
        if compression == "none":
            assert len(warned) == 1 and rotted.object in warned[0].getMessage() and "step 2" in warned[0].getMessage()
        else:
            assert not warned  # never read back


def test_an_edited_codec_field_in_the_newest_manifest_is_never_named_and_retention_keeps_a_loadable_step(
    root: Path,
) -> None:
    """The newest step's manifest edited in one field, the byte shuffle of a compressed range
    (its frame and every crc32c untouched, the manifest re-signed): that step no longer loads.
    The saves after a restart never name another process's frames, so each of them loads, and
    retention never leaves the root without a loadable step."""
    config = _config(root, compression="zstd", chunk_size="64KiB")
    config = config.model_copy(update={"retention": RetentionConfig(keep_last=2)})
    frozen = (torch.randn(100_000, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)

    def state(step: int) -> dict[str, Any]:
        return {"frozen": frozen, "adapter": torch.full((300,), float(step))}

    with SyncCheckpointer(config) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(state(step), step=step).wait()
    path = root / step_dir(3) / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc.pop("crc32c")
    edited = [r for e in doc["entries"] for r in e["ranges"] if r.get("shuffle") == 2]
    assert edited
    for byte_range in edited:
        byte_range["shuffle"] = None
    path.write_bytes(sign_manifest(doc))
    with SyncCheckpointer(config) as ckpt, pytest.raises(CorruptCheckpointError):
        ckpt.load(step=3)
    for step in (4, 5):
        with SyncCheckpointer(config) as ckpt:  # a restart before each save
            ckpt.save(state(step), step=step).wait()
            assert_same(ckpt.load(step=step), state(step))
            assert ckpt.steps() == [step - 1, step]


def _tamper_keeping_crc32c(data: bytearray, start: int, end: int) -> None:
    """Zero the first 4000 bytes of ``data[start:end]`` and set its last 4 bytes so that its
    crc32c stays what it was (crc32c is linear over GF(2): it is no MAC)."""
    target = crc32c_of(bytes(data[start:end]))
    data[start : start + 4000] = bytes(4000)
    fix = end - 4 - start
    body = bytearray(data[start:end])
    body[fix : fix + 4] = bytes(4)
    zero = crc32c_of(bytes(body))
    basis: dict[int, tuple[int, int]] = {}  # pivot bit -> (crc change, the bits of the fix that make it)
    for bit in range(32):
        flipped = bytearray(body)
        flipped[fix + bit // 8] ^= 1 << (bit % 8)
        vector, made = crc32c_of(bytes(flipped)) ^ zero, 1 << bit
        for pivot in sorted(basis, reverse=True):
            if vector >> pivot & 1:
                vector, made = vector ^ basis[pivot][0], made ^ basis[pivot][1]
        if vector:
            basis[vector.bit_length() - 1] = (vector, made)
    want, made = target ^ zero, 0
    for pivot in sorted(basis, reverse=True):
        if want >> pivot & 1:
            want, made = want ^ basis[pivot][0], made ^ basis[pivot][1]
    assert want == 0
    for bit in range(32):
        if made >> bit & 1:
            body[fix + bit // 8] ^= 1 << (bit % 8)
    data[start:end] = body
    assert crc32c_of(bytes(data[start:end])) == target


def test_base_bytes_tampered_with_their_crc32c_kept_are_found_by_their_digest_and_written_again(root: Path) -> None:
    """Bytes of a frozen range changed in storage with 4 more bytes set so that its crc32c
    still matches: the read-back after a restart compares the xxh3-128 digest too, so the next
    save writes the genuine bytes again, and every later step loads them."""
    config = _config(root).model_copy(update={"retention": RetentionConfig(keep_last=2)})
    frozen = torch.randn(100_000, generator=torch.Generator().manual_seed(1))

    def state(step: int) -> dict[str, Any]:
        return {"frozen": frozen, "adapter": torch.full((64,), float(step))}

    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state(1), step=1).wait()
        where = next(e for e in ckpt.manifest(1).entries if e.path == "frozen").ranges[0]
    target = root / where.object
    data = bytearray(target.read_bytes())
    _tamper_keeping_crc32c(data, where.offset, where.offset + where.nbytes)
    target.write_bytes(bytes(data))
    for step in (2, 3):
        with SyncCheckpointer(config) as ckpt:
            ckpt.save(state(step), step=step).wait()
            named = {(r.object, r.offset) for e in ckpt.manifest(step).entries for r in e.ranges}
            assert (where.object, where.offset) not in named
            assert_same(ckpt.load(step=step), state(step))


@pytest.mark.parametrize("damage", ["cut", "emptied", "top bit"])
def test_a_manifest_damaged_past_json_keeps_what_it_references_so_that_repaired_it_loads(
    root: Path, damage: str, aiosnap: CliRunner, upload_executor: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 3's manifest references step 1's objects; damaged so that it is no longer JSON
    (its last byte cut, every byte lost, or one character's top bit flipped: not UTF-8), it
    is neither counted nor deleted by retention, and every deletion, gc's too, keeps every
    object of every attempt of its step and the steps before it. Repaired (a backup, a
    one-bit fix), it loads; then what only it kept goes."""
    config = _config(root, chunk_size="256KiB").model_copy(update={"retention": RetentionConfig(keep_last=2)})
    frozen = torch.randn(200_000, generator=torch.Generator().manual_seed(4))

    def state(step: int) -> dict[str, Any]:
        return {"frozen": frozen, "adapter": torch.full((64,), float(step))}

    with SyncCheckpointer(config) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(state(step), step=step).wait()
        assert ckpt.manifest(3).references
    path = root / step_dir(3) / "manifest.json"
    good = path.read_bytes()
    if damage == "cut":
        path.write_bytes(good[:-1])
    elif damage == "emptied":
        path.write_bytes(b"")
    else:
        at = good.index(b'"created_at"') + 2
        path.write_bytes(good[:at] + bytes([good[at] ^ 0x80]) + good[at + 1 :])
    with caplog.at_level(logging.WARNING, logger="aiosnap"), SyncCheckpointer(config) as ckpt:
        for step in (4, 5, 6, 7):
            ckpt.save(state(step), step=step).wait()
        assert ckpt.steps() == [3, 6, 7]  # the damaged step listed, neither counted nor deleted
    if upload_executor == "thread":  # retention runs in the upload process otherwise
        said = [r for r in caplog.records if "no deletion removes data of it or of any earlier step" in r.getMessage()]
        assert len(said) == 1 and "step 3" in said[0].getMessage()
    assert aiosnap("gc", str(root), "--keep-last", "2", "--grace", "0s").returncode == 0
    path.write_bytes(good)
    with SyncCheckpointer(config) as ckpt:
        assert_same(ckpt.load(step=3), state(3))
        ckpt.save(state(8), step=8).wait()  # retention counts step 3 again, and deletes it
        assert ckpt.steps() == [7, 8]
        assert_same(ckpt.load(step=8), state(8))
        named = {o.name for step in (7, 8) for o in ckpt.manifest(step).stored_objects()}
    assert aiosnap("gc", str(root), "--keep-last", "2", "--grace", "0s").returncode == 0
    assert {str(p.relative_to(root)) for p in root.rglob("*.bin")} == named  # what only step 3 held is gone


@pytest.mark.thread_only  # the storage that counts reads is this process's
def test_the_base_ranges_are_read_back_once_after_a_restart_and_never_what_this_side_wrote(root: Path) -> None:
    """A long-running job reads nothing back: the ranges it names are those it wrote (or read
    back) itself. The first save after a restart reads each range it names once, through a
    bounded buffer; the saves after it read nothing."""
    sizes: list[int] = []

    class Counting(FaultyStorage):
        async def read_into(self, name: str, offset: int, dest: memoryview) -> int:
            sizes.append(len(dest))
            return await super().read_into(name, offset, dest)

    def referenced_bytes(manifest: Manifest) -> int:
        own = {o.name for o in manifest.objects}
        return sum(r.nbytes for e in manifest.entries for r in e.ranges if r.object not in own)

    state = _frozen_state(12)
    config = _config(root)
    with SyncCheckpointer(config, storage=Counting(LocalStorage(root))) as ckpt:
        for step in range(1, 4):
            _trained(state, step)
            ckpt.save(state, step=step).wait()
        assert ckpt.manifest(3).references and not sizes  # steps 2 and 3 named step 1's bytes, read none
    with SyncCheckpointer(config, storage=Counting(LocalStorage(root))) as ckpt:
        _trained(state, 4)
        ckpt.save(state, step=4).wait()
        named = referenced_bytes(ckpt.manifest(4))
        assert named >= state["frozen"].nbytes
        assert sum(sizes) == named and max(sizes, default=0) <= READ_BUFFER_BYTES, (
            sum(sizes),
            named,
            max(sizes, default=0),
        )
        sizes.clear()
        _trained(state, 5)
        ckpt.save(state, step=5).wait()
        assert ckpt.manifest(5).references and not sizes


def test_a_rotted_base_range_on_s3_is_read_back_and_written_again(s3_endpoint: str, s3_bucket: str) -> None:
    """The read-back runs on S3 too (ranged GETs through the bounded buffer): the bytes of a
    frozen tensor overwritten with one bit flipped after an earlier process committed them
    are written again; the other ranges are still named."""
    config = s3_config(s3_endpoint, s3_bucket, prefix="rot")
    upload = config.upload.model_copy(update={"dedup": True, "chunk_size": 1 << 20})
    config = config.model_copy(update={"upload": upload})
    state = _frozen_state(13)
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=1).wait()
        rotted = next(e for e in ckpt.manifest(1).entries if e.path == "frozen").ranges[0]

    async def flip(storage: Storage) -> None:
        data = bytearray(await storage.read(rotted.object))
        data[rotted.offset + 3] ^= 0x10
        await storage.write(rotted.object, bytes(data))

    on_root(config, flip)
    with SyncCheckpointer(config) as ckpt:
        expected = _trained(state, 2)
        ckpt.save(state, step=2).wait()
        second = ckpt.manifest(2)
        frozen = next(e for e in second.entries if e.path == "frozen")
        assert rotted.object not in {r.object for r in frozen.ranges} and second.references
        assert_same(ckpt.load(step=2), expected)


def test_a_truncated_base_object_is_written_again_and_no_save_fails(root: Path, upload_executor: str) -> None:
    """A base object that lost its tail in storage: its head ranges still hold their crc32c,
    but the object is not the size its manifest records, so no range of it is named (the
    commit's reference check compares that size): the first save after the restart writes
    them again and commits; every later step loads."""
    config = _config(root)
    g = torch.Generator().manual_seed(12)
    state = {
        "adapter": torch.zeros(300),
        "a": torch.randn(100_000, generator=g),
        "b": torch.randn(100_000, generator=g),
    }
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=1).wait()
        (cut,) = ckpt.manifest(1).objects  # adapter, a, b: the cut takes b's tail, a still holds its crc32c
    path = root / cut.name
    path.write_bytes(path.read_bytes()[:-1000])
    kept: dict[int, dict[str, Any]] = {}
    with SyncCheckpointer(config) as ckpt:
        for step in (2, 3):
            kept[step] = _trained(state, step)
            ckpt.save(state, step=step).wait()  # no CorruptCheckpointError ("has ... bytes, not ...")
        assert cut.name not in {r.name for r in ckpt.manifest(2).references or ()}
        assert ckpt.manifest(3).references  # dedup goes on, against step 2
        for step in (2, 3):
            assert_same(ckpt.load(step=step), kept[step])
