"""References are never dangling (issue 24, catalog side): retention, ``aiosnap gc``, rollback,
purge and re-saves delete an object only when no kept manifest names it and no save in flight
pins it; the last step naming a frozen weight takes its bytes with it. Referencing steps are
made from real saves by :mod:`tests.referencing`, on real files and a real S3 server (moto)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Config, CorruptCheckpointError, StorageError, SyncCheckpointer
from aiosnap.catalog.garbage import collect_garbage
from aiosnap.catalog.keep import KeptNames, names_in_manifest
from aiosnap.catalog.maintenance import verify_step
from aiosnap.catalog.pins import ReferencePins, pins_for
from aiosnap.catalog.steps import apply_retention, committed_steps, read_manifest, remove_steps_after
from aiosnap.core.names import attempt_of_object, attempt_prefix, step_dir
from aiosnap.format.manifest import Manifest
from aiosnap.format.markers import VERDICT_FILE, VERDICT_READ_S, Verdict
from aiosnap.storage.base import ObjectInfo, Storage
from aiosnap.storage.local import LocalStorage
from aiosnap.transfer.copy import copy_step
from tests.conftest import assert_same, s3_config
from tests.fuzzing import mutate_bytes, mutate_document, sign_manifest
from tests.referencing import fine_tune_state, frozen_chain, on_root, reference, reference_base


@pytest.fixture
def small_config(small_config: Config) -> Config:
    """The tests' small config, saving whole steps: this module's referencing steps are made
    by hand (:mod:`tests.referencing`) except where :func:`_dedup` saves incrementally."""
    return small_config.model_copy(update={"upload": small_config.upload.model_copy(update={"dedup": False})})


def _with(config: Config, keep_last: int | None) -> Config:
    return config.model_copy(update={"retention": config.retention.model_copy(update={"keep_last": keep_last})})


@pytest.fixture(params=["local", "s3"])
def any_config(request: pytest.FixtureRequest, small_config: Config) -> Config:
    """The tests' small local config, or the same sizes on the S3 test server."""
    if request.param == "local":
        return small_config
    found = s3_config(request.getfixturevalue("moto_endpoint"), request.getfixturevalue("s3_bucket"))
    return found.model_copy(update={"upload": small_config.upload, "ram_budget": small_config.ram_budget})


def _load(config: Config, step: int) -> Any:
    with SyncCheckpointer(_with(config, None)) as ckpt:
        return ckpt.load(step=step)


def _stored(config: Config) -> set[str]:
    return {o.name for o in on_root(config, lambda s: s.walk())}


def _manifest(config: Config, step: int) -> Manifest:
    return on_root(config, lambda s: read_manifest(s, step))


def _gc(config: Config, keep_last: int, grace_s: float = 0.0) -> Any:
    return on_root(config, lambda s: collect_garbage(s, keep_last=keep_last, grace_s=grace_s))


def _only_what_is_named(config: Config) -> set[str]:
    """After gc: the root holds exactly its committed manifests and the objects they name."""

    async def named(storage: Storage) -> set[str]:
        found: set[str] = set()
        for step in await committed_steps(storage):
            manifest = await read_manifest(storage, step)
            found |= {f"{step_dir(step)}/manifest.json", *(o.name for o in manifest.stored_objects())}
        return found

    expected = on_root(config, named)
    assert _stored(config) == expected
    return expected


def _attempt_of(manifest: Manifest) -> str:
    (first,) = {attempt_of_object(o.name) for o in manifest.references or ()}
    assert first is not None
    return attempt_prefix(*first)


def test_retention_deletes_the_first_writer_and_its_frozen_bytes_stay_until_the_last_reference_goes(
    any_config: Config,
) -> None:
    states = frozen_chain(any_config, [1, 2, 3])
    third = _manifest(any_config, 3)
    base_folder = _attempt_of(third)  # flattened: step 3 names step 1's objects, not step 2's
    assert base_folder.startswith(step_dir(1) + "/")
    frozen = {o.name for o in third.references or ()}
    with SyncCheckpointer(_with(any_config, 2)) as ckpt:
        states[4] = fine_tune_state(4)
        ckpt.save(states[4], step=4).wait()  # retention deletes steps 1 and 2
        assert ckpt.steps() == [3, 4]
    for step in (3, 4):
        assert_same(_load(any_config, step), states[step])
    stored = _stored(any_config)
    assert {n for n in stored if n.startswith(step_dir(1))} == frozen  # only the bytes step 3 names
    assert not any(n.startswith(step_dir(2)) for n in stored)

    report = _gc(any_config, keep_last=2)
    assert report.kept_referenced == [base_folder] and not report.removed_incomplete
    _only_what_is_named(any_config)

    reference(any_config, 4, 3)  # step 4 now names step 1's frozen bytes as well
    with SyncCheckpointer(_with(any_config, 2)) as ckpt:
        states[5] = fine_tune_state(5)
        ckpt.save(states[5], step=5).wait()  # deletes step 3; step 4 still names the base
    assert frozen <= _stored(any_config)
    assert_same(_load(any_config, 4), states[4])

    report = _gc(any_config, keep_last=1)  # step 4 goes: the last step naming the frozen bytes
    assert report.deleted_steps == [4] and report.kept_referenced == []
    assert not any(n.startswith(step_dir(1)) for n in _stored(any_config))
    assert _only_what_is_named(any_config) == {
        f"{step_dir(5)}/manifest.json",
        *(o.name for o in _manifest(any_config, 5).objects),
    }
    assert_same(_load(any_config, 5), states[5])


def test_rollback_keeps_what_kept_steps_reference_and_purge_deletes_everything(any_config: Config) -> None:
    states = frozen_chain(any_config, [1, 2, 3, 4])
    assert _gc(any_config, keep_last=3).deleted_steps == [1]  # step 1's base stays, named by 2-4
    with SyncCheckpointer(_with(any_config, 3)) as ckpt:
        assert ckpt.rollback(2) == [3, 4]
        assert ckpt.steps() == [2]
    assert_same(_load(any_config, 2), states[2])
    _only_what_is_named(any_config)
    with SyncCheckpointer(_with(any_config, 3)) as ckpt:
        assert ckpt.purge() == [2]
    assert _stored(any_config) == set()


def test_rollback_to_the_step_that_first_wrote_the_base_keeps_it_whole(small_config: Config) -> None:
    states = frozen_chain(small_config, [1, 2, 3])
    assert on_root(small_config, lambda s: remove_steps_after(s, 1)) == [2, 3]
    assert_same(_load(small_config, 1), states[1])
    _only_what_is_named(small_config)


def test_a_pinned_reference_survives_retention_and_goes_once_released(small_config: Config) -> None:
    states = frozen_chain(small_config, [1, 2])
    url = LocalStorage(small_config.storage.url).url
    first = _manifest(small_config, 1)
    pins = pins_for(url)
    token = pins.pin(o.name for o in first.objects)  # a save in flight that references step 1
    try:
        with SyncCheckpointer(_with(small_config, 1)) as ckpt:
            ckpt.save(fine_tune_state(3), step=3).wait()  # retention deletes steps 1 and 2
            assert ckpt.steps() == [3]
        assert {o.name for o in first.objects} <= _stored(small_config)
        assert _gc(small_config, keep_last=1).kept_referenced == [attempt_prefix(1, first.save_id)]
    finally:
        pins.release(token)
    pins.release(token)  # twice: ignored
    _gc(small_config, keep_last=1)
    assert not any(n.startswith(step_dir(1)) for n in _stored(small_config))
    assert states[2]["step"] == 2


def test_retention_between_a_saves_pin_and_its_commit_keeps_the_pinned_base(small_config: Config) -> None:
    """What an incremental save does: pin the latest step's objects, write, commit naming them,
    release. Retention of the step before it (keep_last=1) runs in between, each time."""
    states = {1: fine_tune_state(1)}
    with SyncCheckpointer(_with(small_config, 1)) as ckpt:
        ckpt.save(states[1], step=1).wait()
        pins = pins_for(LocalStorage(small_config.storage.url).url)
        for step in range(2, 6):
            base = ckpt.manifest(step - 1)
            token = pins.pin(o.name for o in base.stored_objects())
            try:
                states[step] = fine_tune_state(step)
                ckpt.save(states[step], step=step).wait()  # its retention deletes the base step
                assert ckpt.steps() == [step]
                made = reference(small_config, step, base)  # checks every referenced object is there
            finally:
                pins.release(token)
            assert _attempt_of(made).startswith(step_dir(1))  # flattened to the first writer
            assert_same(ckpt.load(step=step), states[step])
    _gc(small_config, keep_last=1)
    _only_what_is_named(small_config)


def test_a_re_save_takes_the_references_of_the_manifest_it_replaced_once_nothing_names_them(
    small_config: Config,
) -> None:
    frozen_chain(small_config, [1, 2])
    _gc(small_config, keep_last=1)  # step 1 goes; its base stays, named by step 2
    assert any(n.startswith(step_dir(1)) for n in _stored(small_config))
    with SyncCheckpointer(_with(small_config, None)) as ckpt:
        ckpt.save(fine_tune_state(22), step=2).wait()  # a re-save of the latest step, written whole
    assert_same(_load(small_config, 2), fine_tune_state(22))
    assert not any(n.startswith(step_dir(1)) for n in _stored(small_config))  # no gc needed
    _only_what_is_named(small_config)


def test_a_kept_commit_verdict_beside_referenced_objects_does_not_make_them_undecided(small_config: Config) -> None:
    """A removed multi-rank step's tombstone (its ``commit`` verdict) left by a process that
    died before sweeping it, beside objects later steps reference: gc removes the verdict,
    keeps the objects, and never calls the folder an undecided save."""
    frozen_chain(small_config, [1, 2])
    first = _manifest(small_config, 1)
    _gc(small_config, keep_last=1)
    verdict = Path(small_config.storage.url) / attempt_prefix(1, first.save_id) / VERDICT_FILE
    verdict.write_bytes(Verdict(verdict="commit", save_id=first.save_id, rank=0).to_json())
    old = time.time() - 10 * VERDICT_READ_S
    os.utime(verdict, (old, old))
    report = _gc(small_config, keep_last=1)
    assert report.kept_undecided == [] and report.kept_referenced == [attempt_prefix(1, first.save_id)]
    assert not verdict.exists()
    _only_what_is_named(small_config)


class _CommitsAfterListing(LocalStorage):
    """A root where, right after a deletion lists ``folder``, another writer commits a step
    naming objects in it: what a deletion keeps must be read after its listing."""

    def __init__(self, root: str, folder: str, step: int, base: Manifest) -> None:
        super().__init__(root)
        self.folder, self.step, self.base, self.done = folder, step, base, False

    async def walk(self, prefix: str = "") -> list[ObjectInfo]:
        found = await super().walk(prefix)
        if prefix == self.folder and not self.done:
            self.done = True
            await reference_base(LocalStorage(self.root), self.step, self.base)
        return found


def test_what_to_keep_is_read_after_the_listing(small_config: Config) -> None:
    with SyncCheckpointer(_with(small_config, None)) as ckpt:
        for step in (1, 2):
            ckpt.save(fine_tune_state(step), step=step).wait()
        first = ckpt.manifest(1)
    storage = _CommitsAfterListing(small_config.storage.url, attempt_prefix(1, first.save_id), 2, first)
    assert asyncio.run(apply_retention(storage, 1, 2, set())) == [1]
    assert storage.done
    assert_same(_load(small_config, 2), fine_tune_state(2))
    _gc(small_config, keep_last=1)
    _only_what_is_named(small_config)


def test_reference_pins_are_thread_safe_and_one_registry_per_root() -> None:
    pins = ReferencePins()
    held = pins.pin(["a/always"])
    stop = threading.Event()
    missing: list[frozenset[str]] = []

    def churn(index: int) -> None:
        for round_ in range(300):
            token = pins.pin([f"t{index}/{round_}", "shared"])
            pins.release(token)

    def watch() -> None:
        while not stop.is_set():
            if "a/always" not in (seen := pins.pinned()):
                missing.append(seen)

    watcher = threading.Thread(target=watch)
    watcher.start()
    workers = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)
    stop.set()
    watcher.join(timeout=30)
    assert not missing and pins.pinned() == {"a/always"} and len(pins) == 1
    pins.release(held)
    assert pins.pinned() == frozenset()
    assert pins_for("s3://b/x") is pins_for("s3://b/x") and pins_for("s3://b/x") is not pins_for("s3://b/y")


def test_a_crash_between_commit_and_retention_leaves_only_garbage_the_next_retention_and_gc_remove(
    any_config: Config,
) -> None:
    states = frozen_chain(any_config, [1, 2, 3, 4])  # committed, retention never ran (as after a crash)
    with SyncCheckpointer(_with(any_config, 2)) as ckpt:
        states[5] = fine_tune_state(5)
        ckpt.save(states[5], step=5).wait()  # the next save's retention: deletes 1, 2, 3
        assert ckpt.steps() == [4, 5]
    assert_same(_load(any_config, 4), states[4])
    _gc(any_config, keep_last=2)
    _only_what_is_named(any_config)
    # a crash inside a deletion: step 4's manifest went, its data and its references did not
    on_root(any_config, lambda s: s.delete(f"{step_dir(4)}/manifest.json"))
    report = _gc(any_config, keep_last=2)
    assert len(report.removed_incomplete) == 2  # step 4's own attempt and step 1's unnamed base
    _only_what_is_named(any_config)
    assert_same(_load(any_config, 5), states[5])


def test_retention_in_this_process_keeps_what_a_later_committed_step_names(small_config: Config) -> None:
    """apply_retention (the save path's) with every victim at once, oldest first."""
    states = frozen_chain(small_config, [1, 2, 3, 4])
    removed = on_root(small_config, lambda s: apply_retention(s, 1, 4, set()))
    assert removed == [1, 2, 3]
    assert_same(_load(small_config, 4), states[4])
    _only_what_is_named(small_config)


_GC_LOOP = textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path
    from aiosnap.catalog.garbage import collect_garbage
    from aiosnap.storage.local import LocalStorage

    async def main(root, runs_file, stop, no_save, deadline):
        storage, runs, orphans = LocalStorage(root), 0, 0
        while not Path(stop).exists() and time.monotonic() < deadline:
            eager = Path(no_save).exists()  # no save in flight: folders no manifest names are orphans
            report = await collect_garbage(storage, keep_last=2, grace_s=0.0 if eager else 60.0)
            orphans += bool(eager and report.kept_referenced)
            runs += 1
            Path(runs_file).write_text(f"{runs} {orphans}")

    asyncio.run(main(*sys.argv[1:5], time.monotonic() + 40))
    """
)


def _runs(path: Path, field: int = 0) -> int:
    try:
        return int(path.read_text().split()[field])
    except (FileNotFoundError, ValueError, IndexError):
        return 0


def _wait_for_runs(path: Path, more_than: int, child: subprocess.Popen[str]) -> int:
    deadline = time.monotonic() + 15
    while (runs := _runs(path)) <= more_than:
        assert child.poll() is None and time.monotonic() < deadline, "the gc process stopped"
        time.sleep(0.01)
    return runs


def test_gc_in_another_process_while_referencing_steps_are_committed(small_config: Config, tmp_path: Path) -> None:
    """gc runs all along in another process: with a grace of 60 s while a save is in flight,
    of 0 s (every folder no manifest names is an orphan: the removal path) while none is, as
    referencing steps are committed and retention deletes the steps that first wrote them."""
    stop, runs, no_save = tmp_path / "stop", tmp_path / "runs", tmp_path / "no-save"
    root = Path(small_config.storage.url)
    root.mkdir(parents=True)
    child = subprocess.Popen(
        [sys.executable, "-c", _GC_LOOP, str(root), str(runs), str(stop), str(no_save)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    states: dict[int, Any] = {}
    try:
        _wait_for_runs(runs, 0, child)  # gc is running before the first save
        with SyncCheckpointer(_with(small_config, 2)) as ckpt:
            for step in range(1, 8):
                no_save.unlink(missing_ok=True)
                _wait_for_runs(runs, _runs(runs) + 1, child)  # a whole gc run began after the unlink
                states[step] = fine_tune_state(step)
                ckpt.save(states[step], step=step).wait()
                if step > 1:  # as an incremental save would commit it: naming the latest step's bytes
                    reference(small_config, step, step - 1)  # (still "in flight": its temporary file is young)
                no_save.touch()
                _wait_for_runs(runs, _runs(runs) + 1, child)  # at least one eager gc between these commits
            assert ckpt.steps() == [6, 7]
    finally:
        stop.touch()
        _, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    assert _runs(runs, 1) > 0, "gc never met a folder holding only referenced objects"
    for step in (6, 7):
        assert_same(_load(small_config, step), states[step])
        manifest = _manifest(small_config, step)
        assert on_root(small_config, lambda s, m=manifest: verify_step(s, m)) == []
    assert _attempt_of(_manifest(small_config, 7)).startswith(step_dir(1))


def test_names_in_a_manifest_are_read_leniently(small_config: Config) -> None:
    frozen_chain(small_config, [1, 2])
    document = (Path(small_config.storage.url) / step_dir(2) / "manifest.json").read_bytes()
    objects = {o.name for o in _manifest(small_config, 2).stored_objects()}
    names = names_in_manifest(2, document)
    assert names == objects
    assert names_in_manifest(2, document, valid=True) == names
    unlisted = json.loads(document)
    unlisted["references"] = unlisted["references"][1:]  # a hand edit a reader refuses: still kept
    assert names_in_manifest(2, json.dumps(unlisted).encode()) == names
    newer = json.loads(document)
    newer.update(format_version=99, references=None, elsewhere={"x": sorted(names)})  # a future layout
    assert names_in_manifest(2, json.dumps(newer).encode()) == names
    assert names_in_manifest(2, document[:-10]) == frozenset()  # not JSON: names nothing itself
    kept = KeptNames()
    kept.hold_through(2)  # what the mark keeps for a manifest a reader refuses
    assert all(name in kept for name in objects)
    assert f"{step_dir(3)}/0123456789abcdef/rank-0/0.bin" not in kept and "elsewhere/0.bin" not in kept
    assert kept.holds_under(f"{step_dir(1)}/0123456789abcdef") and not kept.holds_under(
        f"{step_dir(3)}/0123456789abcdef"
    )
    assert names_in_manifest(2, b"[1]") == frozenset()


def test_names_of_fuzzed_manifests_cover_every_object_a_reader_would_load(
    small_config: Config, request: pytest.FixtureRequest
) -> None:
    """Whatever a stored manifest holds, reading its names never fails, and every object a
    reader accepting it would load is among them (so no deletion takes what a load needs)."""
    frozen_chain(small_config, [1, 2])
    doc = json.loads((Path(small_config.storage.url) / step_dir(2) / "manifest.json").read_text())
    doc.pop("crc32c")
    names = sorted(o["name"] for o in doc["references"] + doc["objects"])
    rng = random.Random(24)
    accepted = 0
    for _ in range(max(50, int(request.config.getoption("--fuzz-cases")) // 4)):
        mutated = mutate_document(doc, rng, extra=[*names, names[0].replace("000000000001", "000000000000")])
        data = sign_manifest(mutated) if rng.random() < 0.9 else mutate_bytes(sign_manifest(mutated), rng)
        found = names_in_manifest(2, data)
        assert isinstance(found, frozenset) and all(isinstance(n, str) for n in found)
        try:
            manifest = Manifest.from_json(data, "fuzzed")
        except CorruptCheckpointError:
            continue
        accepted += 1
        assert {o.name for o in manifest.stored_objects()} <= found
    assert accepted  # some mutations keep the manifest valid: the property was checked


def test_the_helper_makes_real_references(small_config: Config) -> None:
    """The fixture itself: step 2 owns only its adapter's object, names step 1's base."""
    start = time.monotonic()
    frozen_chain(small_config, [1, 2])
    second = _manifest(small_config, 2)
    assert second.references and len(second.objects) == 1
    assert second.total_bytes - second.own_bytes == sum(o.nbytes for o in second.references)
    assert time.monotonic() - start < 60


def _dedup(root: Path, keep_last: int | None) -> Config:
    return Config(
        storage={"url": str(root)},
        ram_budget="8MiB",
        upload={"chunk_size": "1MiB", "concurrency": 2, "dedup": True},
        retention={"keep_last": keep_last},
    )


_FROZEN = torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024)  # 1 MiB, never trained


def _frozen_state(step: int) -> dict[str, torch.Tensor]:
    return {"base": _FROZEN.clone(), "adapter": torch.full((4096,), float(step))}


class _CommitsDuringTheMark(LocalStorage):
    """gc's root, where a job commits a newer step while gc reads what to keep for ``folder``
    (after it listed the committed steps, before it read the newest's manifest): the job's
    retention deletes the manifest gc is about to read."""

    def __init__(self, root: str, folder: str, commit: Any) -> None:
        super().__init__(root)
        self.folder, self.commit, self.armed, self.done = folder, commit, False, False

    async def list_children(self, prefix: str = "") -> list[str]:
        if prefix == self.folder and not self.done:
            self.armed = True  # retire_attempt lists the folder, then asks what to keep
        return await super().list_children(prefix)

    async def read(self, name: str, *args: Any, **kwargs: Any) -> bytes:
        if self.armed and not self.done and name == f"{step_dir(2)}/manifest.json":
            self.done = True
            self.commit()  # on the job's own loop thread; this loop waits meanwhile
        return await super().read(name, *args, **kwargs)


def test_gc_whose_listed_manifest_vanishes_marks_again_and_keeps_the_newest_steps_base(tmp_path: Path) -> None:
    """The newest step's base stays when the step gc listed is deleted under it (retention of a
    newer commit) between gc's listing and its read; the report lists the folder as kept, not
    removed, and counts only the bytes it freed. Retention leaves nothing but what is named."""
    config = _dedup(tmp_path / "root", keep_last=1)
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(_frozen_state(1), step=1).wait()
        ckpt.save(_frozen_state(2), step=2).wait()
        (step2,) = {attempt_of_object(o.name) for o in ckpt.manifest(2).references or ()}
        assert step2 is not None and step2[0] == 1
        folder = attempt_prefix(*step2)
        (tmp_path / "root" / folder / "rank-0" / "7.bin").write_bytes(b"x" * 1000)  # what a crash left in it
        storage = _CommitsDuringTheMark(config.storage.url, folder, lambda: ckpt.save(_frozen_state(3), step=3).wait())
        report = asyncio.run(collect_garbage(storage, keep_last=1, grace_s=0.0))
        assert storage.done and ckpt.steps() == [3]
        assert_same(ckpt.load(step=3), _frozen_state(3))
    assert report.kept_referenced == [folder] and folder not in report.removed_incomplete
    assert report.freed_bytes == 1000  # the object no manifest names, nothing else
    _only_what_is_named(config)


def test_retention_of_incremental_saves_leaves_only_what_the_kept_step_names(tmp_path: Path) -> None:
    """``keep_last: 1`` with dedup: each save's retention deletes the step before it down to
    the objects the new step references (a save's pins go once its manifest names them), so
    the root never grows by a step's unreferenced objects between gc runs."""
    config = _dedup(tmp_path / "root", keep_last=1)
    with SyncCheckpointer(config) as ckpt:
        for step in range(1, 5):
            ckpt.save(_frozen_state(step), step=step).wait()
        assert ckpt.steps() == [4] and len(pins_for(config.storage.url)) == 0
    assert len(_only_what_is_named(config)) == 3  # the manifest, step 4's adapter, step 1's base
    assert_same(_load(config, 4), _frozen_state(4))


class _FailsAfter(LocalStorage):
    """A download's source whose objects of ``step`` fail to read once ``go`` is set (a
    damaged object, a reset connection), and a target that tells when ``name`` is written."""

    def __init__(self, root: str, step: int, go: asyncio.Event) -> None:
        super().__init__(root)
        self.step, self.go, self.wrote = step, go, asyncio.Event()

    async def read_into(self, name: str, offset: int, dest: Any) -> int:
        if name.startswith(step_dir(self.step) + "/"):
            await self.go.wait()
            raise OSError("connection reset by peer")
        return await super().read_into(name, offset, dest)

    async def write(self, name: str, data: Any, *, if_absent: bool = False) -> None:
        await super().write(name, data, if_absent=if_absent)
        if name.startswith(step_dir(1) + "/"):
            self.wrote.set()


def test_a_failed_download_never_removes_a_referenced_object_another_committed_copy_names(tmp_path: Path) -> None:
    """Downloads of steps 2 and 3 (both naming step 1's base) into one target at once: the one
    that fails after writing the base removes its own objects, not the base the committed copy
    of step 2 names; that copy loads."""
    source, target = tmp_path / "source", tmp_path / "target"
    with SyncCheckpointer(_dedup(source, keep_last=None)) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(_frozen_state(step), step=step).wait()

    async def main() -> tuple[Any, Any]:
        step2_done = asyncio.Event()
        failing = _FailsAfter(str(source), 3, step2_done)
        into = _FailsAfter(str(target), 0, asyncio.Event())
        third = asyncio.ensure_future(copy_step(failing, into, await read_manifest(failing, 3)))
        await asyncio.wait_for(into.wrote.wait(), 30)  # the failing copy wrote the base

        async def second() -> bool:
            try:
                return await copy_step(
                    LocalStorage(str(source)), LocalStorage(str(target)), await read_manifest(failing, 2)
                )
            finally:
                step2_done.set()

        return tuple(await asyncio.gather(second(), third, return_exceptions=True))  # type: ignore[return-value]

    copied, failed = asyncio.run(main())
    assert copied is True and isinstance(failed, OSError)
    target_config = _dedup(target, keep_last=None)
    assert_same(_load(target_config, 2), _frozen_state(2))
    _only_what_is_named(target_config)


class _ReadFails(LocalStorage):
    """A source root whose object ``name`` cannot be read (a network error mid-copy), once
    ``go`` is set."""

    def __init__(self, root: str, name: str, go: asyncio.Event) -> None:
        super().__init__(root)
        self.name, self.go = name, go

    async def read_into(self, name: str, offset: int, dest: memoryview) -> int:
        if name == self.name:
            await asyncio.wait_for(self.go.wait(), 30)
            raise OSError(5, "injected read error")
        return await super().read_into(name, offset, dest)


class _TellsWrites(LocalStorage):
    """A target that sets ``wrote`` once every one of ``names`` is written."""

    def __init__(self, root: str, names: set[str]) -> None:
        super().__init__(root)
        self.waiting, self.wrote = set(names), asyncio.Event()

    async def write(self, name: str, data: Any, *, if_absent: bool = False) -> None:
        await super().write(name, data, if_absent=if_absent)
        self.waiting.discard(name)
        if not self.waiting:
            self.wrote.set()


def test_a_failed_download_of_a_step_copied_before_keeps_what_a_later_copied_step_references(
    tmp_path: Path,
) -> None:
    """Steps 1 and 2 (2 references 1's base) downloaded into a target, where gc then deletes
    step 1's manifest (its base stays: step 2 names it). A second download of step 1 rewrites
    the same objects under the same names and fails on a read: its undo deletes only what no
    committed manifest names, so the target's step 2 still loads."""
    source, target = tmp_path / "source", tmp_path / "target"
    with SyncCheckpointer(_dedup(source, keep_last=None)) as ckpt:
        for step in (1, 2):
            ckpt.save(_frozen_state(step), step=step).wait()
        first = ckpt.manifest(1)
        referenced = {o.name for o in ckpt.manifest(2).references or ()}
    unread = next(o.name for o in first.objects if o.name not in referenced)

    async def main() -> None:
        src, dst = LocalStorage(str(source)), LocalStorage(str(target))
        for step in (1, 2):
            assert await copy_step(src, dst, await read_manifest(src, step))
        report = await collect_garbage(dst, keep_last=1, grace_s=0.0)
        assert report.deleted_steps == [1]
        again = _TellsWrites(str(target), referenced)  # the failing copy rewrites them first
        with pytest.raises(OSError, match="injected"):
            await copy_step(_ReadFails(str(source), unread, again.wrote), again, await read_manifest(src, 1))

    asyncio.run(main())
    assert referenced and all((target / name).exists() for name in referenced)
    target_config = _dedup(target, keep_last=None)
    assert_same(_load(target_config, 2), _frozen_state(2))


class _ManifestAlwaysGone(LocalStorage):
    """A root where step ``step``'s manifest is listed at every look and gone at every read
    (as if other processes committed and deleted steps faster than a mark can read them)."""

    def __init__(self, root: str, step: int) -> None:
        super().__init__(root)
        self.gone = f"{step_dir(step)}/manifest.json"

    async def read(self, name: str, *args: Any, **kwargs: Any) -> bytes:
        if name == self.gone:
            raise FileNotFoundError(name)
        return await super().read(name, *args, **kwargs)


def test_a_mark_that_never_settles_deletes_nothing_and_says_so(tmp_path: Path) -> None:
    config = _dedup(tmp_path / "root", keep_last=None)
    with SyncCheckpointer(config) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(_frozen_state(step), step=step).wait()
    before = _stored(config)
    storage = _ManifestAlwaysGone(config.storage.url, 3)
    with pytest.raises(StorageError, match="changed during each of 8 reads.*nothing was deleted"):
        asyncio.run(collect_garbage(storage, keep_last=1, grace_s=0.0))
    assert _stored(config) == before
    with pytest.raises(StorageError, match="nothing was deleted"):  # the victim's manifest goes first
        asyncio.run(apply_retention(storage, 1, 3, set()))
    assert _stored(config) == before - {f"{step_dir(1)}/manifest.json"}
    assert_same(_load(config, 3), _frozen_state(3))
