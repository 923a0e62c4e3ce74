"""Fuzzing what is read back from storage and spool: real manifests and journals, mutated.

Two kinds of case. *Damage* (bytes flipped, fields changed, nothing else): every load either
returns the saved state bit-exact or raises a CorruptCheckpointError. *Forgery* (changed by
someone who may write the storage, checksums recomputed): every load returns or raises an
AiosnapError -- never another exception type, never pickled code run, never an allocation
larger than what is stored. ``make soak`` runs many more cases (``--fuzz-cases``).

And the differential fuzzer of ``save()`` (random states of every class of value, see
tests/state_fuzzing.py): a state is refused by ``save()`` on the caller's thread, exactly
when it holds what no format stores (or only pickle does, without the opt-in), or it loads
back as the caller held it, also into a state of the same structure and, for single files,
through ``torch.load`` as ``torch.save``'s file of the same state does.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import random
import shutil
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import AiosnapError, Config, CorruptCheckpointError, SyncCheckpointer
from aiosnap.core.names import MANIFEST_FILE, step_dir
from aiosnap.format.journal import JOURNAL
from aiosnap.handoff.spooldir import Spool
from aiosnap.load import fetch
from aiosnap.storage.local import LocalStorage
from aiosnap.transfer.resume import resume_spooled
from tests.conftest import assert_same
from tests.fuzzing import mutate_bytes, mutate_document, mutated_text, sign_manifest


class Counted:
    """Counts its unpickling: any count above zero means pickled code ran."""

    unpickled = 0

    def __setstate__(self, state: dict[str, Any]) -> None:
        Counted.unpickled += 1


def _state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(6, 5, generator=generator)
    odict: OrderedDict[str, Any] = OrderedDict(a=torch.arange(4), b=2)
    odict._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {
        "model": {"w": base, "view": base.t(), "b": torch.arange(9, dtype=torch.int16)},
        "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]},
        "odict": odict,
        "misc": [
            None,
            True,
            3,
            2.5,
            float("nan"),
            float("-inf"),
            "s",
            b"\x00raw",
            1 + 2j,
            torch.float16,
            torch.device("cpu"),
            torch.Size([2, 3]),
            (1, (2, "x")),
        ],
        "bf16": torch.randn(7, generator=generator).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
        "bait": torch.frombuffer(bytearray(pickle.dumps(Counted())), dtype=torch.uint8),  # attack material
        "big": torch.randn(40_000, generator=generator),  # several objects
    }


def _cases(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--fuzz-cases"))


def test_fuzzed_manifests_fail_cleanly(
    small_config: Config, root: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save(state, step=1).wait()
    path = root / step_dir(1) / MANIFEST_FILE
    original = path.read_bytes()
    document = json.loads(original)
    stored = sum(p.stat().st_size for p in root.rglob("*.bin"))
    largest = 0
    real_empty_for = fetch._empty_for

    def watched_empty_for(manifest: Any, index: int) -> torch.Tensor:
        nonlocal largest
        tensor = real_empty_for(manifest, index)
        largest = max(largest, tensor.numel() * tensor.element_size())
        return tensor

    monkeypatch.setattr(fetch, "_empty_for", watched_empty_for)
    rng = random.Random(20261130)
    outcomes: dict[str, int] = {}
    quiet = small_config.model_copy(update={"events": type(small_config.events)(log=False)})
    target = {"model": {"w": torch.zeros(6, 5), "b": torch.zeros(9, dtype=torch.int16)}}
    started = time.perf_counter()
    with SyncCheckpointer(quiet) as ckpt:
        expected = ckpt.load()
        for case in range(_cases(request)):
            forged = case % 2 == 1
            path.write_bytes(sign_manifest(mutate_document(document, rng)) if forged else mutated_text(document, rng))
            into = case % 4 >= 2
            try:
                result = ckpt.load({k: dict(v) for k, v in target.items()}) if into else ckpt.load()
            except AiosnapError as exc:
                damage_missed = not forged and not isinstance(exc, CorruptCheckpointError)
                outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
                if damage_missed:
                    raise AssertionError(f"case {case}: damage reported as {exc!r}") from exc
                continue
            outcomes["loaded"] = outcomes.get("loaded", 0) + 1
            if not forged and not into:
                assert_same(result, expected)
    elapsed = time.perf_counter() - started
    assert Counted.unpickled == 0, "a pickle was executed"
    assert largest <= stored, f"a load allocated {largest} bytes; only {stored} are stored"
    print(f"\nmanifest fuzz: {_cases(request)} cases in {elapsed:.1f} s: {dict(sorted(outcomes.items()))}")


def _mutate_journal(data: bytes, rng: random.Random, forged: bool) -> bytes:
    import crc32c

    if not forged and rng.random() < 0.5:
        return mutate_bytes(data, rng)
    lines = data.split(b"\n")[:-1]
    at = rng.randrange(len(lines))
    head, _, body = lines[at].partition(b" ")
    new_body = json.dumps(mutate_document(json.loads(body), rng)).encode()
    new_head = f"{crc32c.crc32c(new_body):08x}".encode() if forged else head
    lines[at] = new_head + b" " + new_body
    if rng.random() < 0.2:
        del lines[rng.randrange(len(lines))]
    return b"\n".join(lines) + b"\n"


def test_fuzzed_spool_journals_never_commit_a_broken_step(
    crashed_spool: tuple[Path, Path, Config, dict[str, Any]], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    spool_template, root_template, config, state = crashed_spool
    save_id = next(p.name for p in spool_template.iterdir() if p.is_dir())
    journal = (spool_template / save_id / JOURNAL).read_bytes()
    rng = random.Random(4)
    cases = max(1, _cases(request) // 4)
    outcomes: dict[str, int] = {}

    spool_dir, root = Path(str(config.spool.dir)), Path(config.storage.url)  # the journal names these

    def one(case: int) -> None:
        for folder, template in ((spool_dir, spool_template), (root, root_template)):
            shutil.rmtree(folder, ignore_errors=True)
            shutil.copytree(template, folder)
        forged = case % 2 == 1
        if case > 0:  # case 0: the journal as written, which must resume
            (spool_dir / save_id / JOURNAL).write_bytes(_mutate_journal(journal, rng, forged))
        spool = Spool.open(config.spool, min_bytes=64 * 1024)
        assert spool is not None
        storage = LocalStorage(root)
        try:
            report = asyncio.run(resume_spooled(spool, storage, concurrency=2, keep_last=1))  # never raises
        finally:
            spool.close()
        kind = next(k for k in ("resumed", "failed", "discarded", "skipped", "") if not k or getattr(report, k))
        outcomes[kind] = outcomes.get(kind, 0) + 1
        committed = sorted(p.parent.name for p in root.glob(f"*/{MANIFEST_FILE}"))
        if case == 0:
            assert report.resumed == [4], report
        if not report.resumed:
            assert committed == [], f"case {case}: nothing resumed, yet {committed} committed"
        if report.resumed:
            with SyncCheckpointer(config.model_copy(update={"spool": type(config.spool)()})) as reader:
                try:
                    restored = reader.load(step=report.resumed[0])
                except CorruptCheckpointError:
                    assert forged, f"case {case}: a damaged journal committed a broken step"
                    return
                if not forged:
                    assert_same(restored, state)

    started = time.perf_counter()
    for case in range(cases):
        one(case)
    print(f"\njournal fuzz: {cases} cases in {time.perf_counter() - started:.1f} s: {dict(sorted(outcomes.items()))}")
    assert outcomes.get("resumed", 0) < cases, "most mutations must be caught"


def _as_torch_saves(value: Any) -> Any:
    """What a single-file checkpoint's ``torch.load`` gives back for ``value``: Stateful
    values as an OrderedDict of their state dict (with its attributes)."""
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        state = value.state_dict()
        ordered = OrderedDict((k, _as_torch_saves(v)) for k, v in state.items())
        ordered.__dict__.update(getattr(state, "__dict__", {}))
        return ordered
    if type(value) in (dict, OrderedDict):
        out = type(value)((k, _as_torch_saves(v)) for k, v in value.items())
        if type(value) is OrderedDict:
            out.__dict__.update(value.__dict__)
        return out
    if type(value) in (list, tuple):
        return type(value)(_as_torch_saves(v) for v in value)
    return value


def test_fuzzed_states_load_back_exactly_or_are_refused_by_save(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The differential fuzzer of save(): random states drawn from every class of value
    (tests/state_fuzzing.py) into folders and single files, with pickles allowed and not.
    Either save() refuses the state on the caller's thread with an AiosnapError, and exactly
    when the draw holds something it must refuse (or a chain of containers too deep); or the
    save commits and loads back as the caller held it, its spool journal reads back as the
    manifest it committed, and a single file's torch.load agrees with torch.save's of the
    same state (with torch's default weights_only too, wherever torch.save's file loads so)."""
    from aiosnap import PickleNotAllowedError
    from aiosnap.interop.singlefile import ArchiveStorage
    from tests.state_fuzzing import (
        DEEP,
        PICKLED,
        REFUSED,
        StateDrawer,
        assert_exact,
        expected,
        journal_manifest,
        targets,
    )

    cases = max(40, _cases(request) // 25)
    drawer = StateDrawer(random.Random(20260214))
    outcomes: dict[str, int] = {}
    checkpointers = []
    for pickles in (False, True):
        config = Config(
            storage={"url": str(tmp_path / f"root-{pickles}")}, ram_budget="1MiB", upload={"chunk_size": "64KiB"},
            retention={"keep_last": 1}, events={"log": False}, pickle_values=pickles,
        )  # fmt: skip
        checkpointers.append(SyncCheckpointer(config))
    steps: dict[str, int] = {}
    started = time.perf_counter()
    try:
        for case in range(cases):
            pickles = case % 2 == 1
            single = case % 4 >= 2
            state, metadata, step_scale, draw = drawer.draw()
            path = tmp_path / f"single-{pickles}.pt"
            owner = checkpointers[pickles]
            target = owner.at(str(path), keep_last=1, storage=ArchiveStorage(path)) if single else owner
            key = f"{pickles}-{single}"
            step = steps[key] = steps.get(key, 0) + 1
            must_refuse = REFUSED in draw.kinds or (PICKLED in draw.kinds and not pickles)
            where = f"case {case} ({'single file' if single else 'folder'}, pickles {pickles}, {draw.notes})"
            before = target.steps()
            refusal: AiosnapError | None = None
            try:
                handle = target.save(state, step=step * step_scale, metadata=metadata)
            except AiosnapError as exc:  # anything else fails the test: never an untyped refusal
                refusal = exc
            if refusal is not None:
                too_deep = DEEP in draw.kinds and "nested deeper than" in str(refusal)
                assert must_refuse or too_deep, f"{where}: refused a state it can save: {refusal!r:.400}"
                assert target.steps() == before, f"{where}: a refused save left a step"
                outcomes[type(refusal).__name__] = outcomes.get(type(refusal).__name__, 0) + 1
                continue
            assert not must_refuse, f"{where}: accepted a state it must refuse"
            handle.wait(timeout=60)  # never a background failure: what save() accepts commits
            want = expected(state)
            assert_exact(target.load(allow_pickle=True), want, where)
            into = targets(state)  # and into a state of the same structure: in place, staged, copied
            assert_exact(expected(target.load(into, allow_pickle=True)), want, f"{where}, into a state")
            if metadata is not None:
                assert target.manifest().metadata == metadata, where
            if not single:  # what a crash after capture would commit from the spool
                journalled = journal_manifest(
                    tmp_path / "spool", state, step=step, metadata=metadata, pickle_values=pickles
                )
                assert journalled.tree == target.manifest().tree, f"{where}: the journal's tree differs"
            if PICKLED in draw.kinds:
                with pytest.raises(PickleNotAllowedError):
                    target.load()
            if single:  # the same file through torch.load, against torch.save of the same state
                reference = tmp_path / "reference.pt"
                try:
                    torch.save(_as_torch_saves(state), reference)
                except (KeyError, RuntimeError, pickle.PicklingError):  # torch.save has no storage for int3, say
                    outcomes["torch.save cannot"] = outcomes.get("torch.save cannot", 0) + 1
                else:
                    ours, theirs = torch.load(path, weights_only=False), torch.load(reference, weights_only=False)
                    assert_exact(ours, theirs, where, attributes=True)
                    try:
                        theirs = torch.load(reference)  # weights_only=True, torch's default
                    except pickle.UnpicklingError:
                        pass
                    else:
                        assert_exact(torch.load(path), theirs, f"{where}, weights_only", attributes=True)
            outcomes["loaded"] = outcomes.get("loaded", 0) + 1
            if single:
                target.close()
    finally:
        for ckpt in checkpointers:
            ckpt.close()
    print(f"\nstate fuzz: {cases} cases in {time.perf_counter() - started:.1f} s: {dict(sorted(outcomes.items()))}")
    assert outcomes.get("loaded", 0) >= cases // 4, "too few states were saved to prove anything"


def _spec_journal(path: Path, spec_doc: dict[str, Any], begin: dict[str, Any]) -> None:
    from aiosnap.format.journal import _line

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_line({**begin, "spec": spec_doc}) + _line({"kind": "captured"}))


def test_forged_save_specs_are_refused_with_a_journal_error(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A journal's save spec, forged (the line's checksum recomputed): every index of it is
    untrusted. A multi-rank-format spec (one process, ``rank_local=``) naming a written entry
    past the table raised a raw IndexError out of read_journal, and the checkpointer could
    not start; a shard box for an entry that does not exist, or an entry of 10^30 bytes, was
    accepted. Every forged spec is refused with a JournalError or makes a manifest that says
    what the spec says (the bytes it writes, the DTensor shards it names)."""
    import copy

    from aiosnap.format.journal import JournalError, begin_record, read_journal
    from aiosnap.trainer.plan import make_plan

    state = {"w": torch.randn(3000), "b": torch.arange(6), "rng": torch.get_rng_state(), "n": 7}
    made = make_plan(state, step=2, chunk_bytes=8192, rank_local=["rng"])
    begin = begin_record(made.spec, storage_url="/r", owner_url="/r", keep_last=None)
    spec = begin["spec"]
    path = tmp_path / made.spec.save_id / JOURNAL
    forged: list[Any] = [
        lambda s: s["distributed"].update(written=[0, 99]),
        lambda s: s["distributed"].update(written=[1, 0]),
        lambda s: s["distributed"].update(shards=[{"entry": 99, "offsets": [0], "global_shape": [4]}]),
        lambda s: s["distributed"].update(main_entries=99),
        lambda s: s["distributed"].update(local_values=[{"t": "tensor", "id": "x"}]),
        lambda s: s["entries"][0].update(nbytes=10**30),
        lambda s: s["entries"][1].update(nbytes=8),
        lambda s: s["chunks"][0]["pieces"][0].update(dst_offset=10**6),
        lambda s: s.update(rank=5),
        lambda s: s.update(tree={"t": "list", "items": [[]] * 3}),
    ]
    for change in forged:
        doc = copy.deepcopy(spec)
        change(doc)
        _spec_journal(path, doc, begin)
        with pytest.raises(JournalError):
            read_journal(path, made.spec.save_id)
    rng = random.Random(11)
    outcomes: dict[str, int] = {}
    for _ in range(max(100, _cases(request) // 10)):
        if rng.random() < 0.5:
            doc = mutate_document(spec, rng)
        else:  # the multi-rank part's indices, where the IndexError was
            doc = {**spec, "distributed": mutate_document(spec["distributed"], rng)}
        _spec_journal(path, doc, begin)
        try:
            journal = read_journal(path, made.spec.save_id)  # never another exception
        except JournalError:
            outcomes["refused"] = outcomes.get("refused", 0) + 1
            continue
        outcomes["read"] = outcomes.get("read", 0) + 1
        manifest, read_spec = journal.manifest, journal.spec
        assert read_spec.total_bytes == sum(span.nbytes for _, span in manifest.all_ranges())
        assert read_spec.distributed is not None
        sharded = {i for i, e in enumerate(manifest.entries) if e.kind == "sharded"}
        assert {s.entry for s in read_spec.distributed.shards} == sharded
    print(f"\nforged specs: {dict(sorted(outcomes.items()))}")
