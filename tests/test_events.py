"""Structured events: scopes always paired, figures on events and handles, pluggable handlers."""

from __future__ import annotations

import errno
import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from aiosnap import Config, SyncCheckpointer
from aiosnap.core.events import Event
from tests.conftest import FaultyStorage

pytestmark = pytest.mark.both_executors


class Recorder:
    """A callback handler (thread-safe: save events arrive on aiosnap's loop thread)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def sequence(self, op: str = "save") -> list[tuple[str, str | None]]:
        return [(e.kind, e.stage) for e in self.events if e.op == op]


def test_good_save_and_load_emit_paired_scopes_with_figures(small_config: Config) -> None:
    seen = Recorder()
    state = {"w": torch.randn(100_000), "b": torch.arange(10)}
    with SyncCheckpointer(small_config, event_handlers=[seen]) as ckpt:
        result = ckpt.save(state, step=4).wait()
        ckpt.load()
    assert seen.sequence("save") == [
        ("start", None), ("end", "capture"), ("end", "upload"), ("end", "commit"), ("end", None),
    ]  # fmt: skip
    saves = [e for e in seen.events if e.op == "save"]
    assert {e.step for e in saves} == {4} and {e.save_id for e in saves} == {result.save_id}
    assert all(e.rank == 0 and e.world_size == 1 and e.url == ckpt.url for e in saves)
    by_stage = {e.stage: e for e in saves if e.kind == "end"}
    assert by_stage["capture"].nbytes == by_stage["upload"].nbytes == result.nbytes == 400_080
    assert by_stage[None].seconds == pytest.approx(result.durable_s)
    assert by_stage["commit"].nbytes == len(Path(ckpt.url, "000000000004", "manifest.json").read_bytes())
    assert all(e.seconds is not None and e.seconds >= 0 for e in by_stage.values())

    # the figures on the handle
    assert 0 < result.blocked_s <= result.durable_s
    assert result.throughput == pytest.approx(result.nbytes / result.durable_s)
    assert 0 < result.ram_high_water <= 1024**2
    assert set(result.stage_seconds) == {"capture", "upload", "commit"}

    assert seen.sequence("load") == [("start", None), ("end", "fetch"), ("end", None)]
    load_end = seen.events[-1]
    assert load_end.step == 4 and load_end.nbytes == result.nbytes


def test_failed_save_ends_with_an_exception_event(small_config: Config, faulty: FaultyStorage) -> None:
    seen = Recorder()
    faulty.fail_when = lambda name: name.endswith("/3.bin")
    faulty.error = OSError(errno.ENOSPC, "No space left on device (injected)")
    ckpt = SyncCheckpointer(small_config, storage=faulty, event_handlers=[seen])
    handle = ckpt.save({"w": torch.randn(200_000)}, step=2)
    with pytest.raises(OSError):
        handle.wait(timeout=30)
    ckpt.flush_events()  # handlers run on their own thread
    kinds = seen.sequence()
    assert kinds[0] == ("start", None) and kinds[-1] == ("exception", None)
    assert ("end", None) not in kinds and ("end", "commit") not in kinds
    failure = seen.events[-1]
    assert failure.error_type == "OSError" and "No space left" in (failure.error or "")
    assert failure.exception is handle.future.exception()
    assert "exception" not in failure.to_dict()
    ckpt.close()  # reported at wait(): not raised again


def test_cancelled_save_still_closes_its_scope(small_config: Config, faulty: FaultyStorage) -> None:
    seen = Recorder()
    faulty.hold()  # the target never answers
    ckpt = SyncCheckpointer(small_config, storage=faulty, event_handlers=[seen])
    ckpt.save({"x": torch.ones(10)}, step=1)
    with pytest.raises(TimeoutError):
        ckpt.close(timeout=0.2)
    kinds = seen.sequence()
    assert kinds[0] == ("start", None) and kinds[-1] == ("exception", None)
    assert seen.events[-1].error_type == "CancelledError"
    assert [k for k, _ in kinds].count("start") == 1


def test_failed_load_is_a_scope_too(small_config: Config) -> None:
    seen = Recorder()
    with SyncCheckpointer(small_config, event_handlers=[seen]) as ckpt, pytest.raises(LookupError):
        ckpt.load(step=99)
    assert seen.sequence("load") == [("start", None), ("exception", None)]
    assert seen.events[-1].step == 99 and seen.events[-1].error_type == "CheckpointNotFoundError"


def test_spool_stage_is_reported(small_config: Config, tmp_path: Path) -> None:
    seen = Recorder()
    spool = {"dir": str(tmp_path / "spool"), "mode": "always", "budget": "8MiB"}
    config = Config(**{**small_config.model_dump(), "spool": spool})
    with SyncCheckpointer(config, event_handlers=[seen]) as ckpt:
        result = ckpt.save({"w": torch.randn(100_000)}, step=1).wait()
    assert ("end", "spool") in seen.sequence()
    spool_end = next(e for e in seen.events if e.stage == "spool")
    assert spool_end.nbytes == result.nbytes and result.spooled_chunks > 0
    assert result.spool_high_water is not None and 0 < result.spool_high_water <= 8 * 1024**2


def test_handler_errors_never_break_a_save(small_config: Config, caplog: pytest.LogCaptureFixture) -> None:
    def broken(event: Event) -> None:
        raise RuntimeError("handler bug")

    seen = Recorder()
    with (
        caplog.at_level(logging.WARNING, logger="aiosnap"),
        SyncCheckpointer(small_config, event_handlers=[broken, seen]) as ckpt,
    ):
        ckpt.save({"w": torch.ones(100)}, step=1).wait()
        ckpt.save({"w": torch.ones(100)}, step=2).wait()
        assert ckpt.steps() == [1, 2]
    assert ("end", None) in seen.sequence()  # later handlers still ran
    complaints = [r for r in caplog.records if "event handler" in r.getMessage()]
    assert len(complaints) == 1 and "handler bug" in complaints[0].getMessage()


def test_jsonl_and_logging_handlers_from_config(
    small_config: Config, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen = Recorder()
    events_file = tmp_path / "logs" / "events.jsonl"
    config = Config(**{**small_config.model_dump(), "events": {"log": True, "jsonl": str(events_file)}})
    with (
        caplog.at_level(logging.INFO, logger="aiosnap.events"),
        SyncCheckpointer(config, event_handlers=[seen]) as ckpt,
    ):
        ckpt.save({"w": torch.ones(1000)}, step=3).wait()
    lines = [json.loads(line) for line in events_file.read_text().splitlines()]
    assert [(d["kind"], d["stage"]) for d in lines] == seen.sequence()
    assert all(d["step"] == 3 and d["rank"] == 0 for d in lines)
    logged = [r for r in caplog.records if r.name == "aiosnap.events"]
    assert len(logged) == len(lines)
    assert logged[-1].aiosnap_event["kind"] == "end"  # type: ignore[attr-defined]
    assert "save step 3 done" in logged[-1].getMessage()

    quiet = Config(**{**small_config.model_dump(), "events": {"log": False}})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="aiosnap.events"), SyncCheckpointer(quiet) as ckpt:
        ckpt.save({"w": torch.ones(10)}, step=4).wait()
    assert not [r for r in caplog.records if r.name == "aiosnap.events"]


def test_process_group_info_is_the_group_aiosnap_uses(small_config: Config, tmp_path: Path) -> None:
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")  # registers the "fake" backend
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        group = dist.new_group(ranks=[0], backend="fake")  # aiosnap's own group; the default is gloo
        seen, default_seen = Recorder(), Recorder()
        with SyncCheckpointer(small_config, process_group=group, event_handlers=[seen]) as ckpt:
            ckpt.save({"w": torch.ones(10)}, step=1).wait()
        with SyncCheckpointer(small_config, event_handlers=[default_seen]) as ckpt:
            ckpt.save({"w": torch.ones(10)}, step=2).wait()
    finally:
        dist.destroy_process_group()
    assert {(e.backend, e.group_size, e.rank, e.world_size) for e in seen.events} == {("fake", 1, 0, 1)}
    assert {e.backend for e in default_seen.events} == {"gloo"}


def test_process_group_without_distributed_is_an_error(small_config: Config) -> None:
    with pytest.raises(ValueError, match="not initialised"):
        SyncCheckpointer(small_config, process_group=object())
    with pytest.raises(ValueError, match="outside world_size"):
        SyncCheckpointer(small_config, rank=2, world_size=2)
    with pytest.raises(TypeError, match="not callable"):
        SyncCheckpointer(small_config, event_handlers=["nope"])  # type: ignore[list-item]


def test_slow_handlers_do_not_hold_save_back(small_config: Config) -> None:
    gate = threading.Event()
    seen: list[Event] = []

    def stuck_on_capture(event: Event) -> None:
        if event.stage == "capture":
            gate.wait(20)  # released by the test only once save() has returned
        if event.stage is not None:
            seen.append(event)

    with SyncCheckpointer(small_config, event_handlers=[stuck_on_capture]) as ckpt:
        started = time.perf_counter()
        handle = ckpt.save({"w": torch.randn(10_000)}, step=1)
        returned = time.perf_counter() - started
        gate.set()
        handle.wait(30)
    assert returned < 10, f"save() waited {returned:.1f} s for an event handler"
    assert [e.stage for e in seen] == ["capture", "upload", "commit"]  # all delivered, in order


def test_a_leftover_discarded_before_its_resume_began_is_logged_once_not_an_event(
    small_config: Config, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A spool folder without a journal (the process stopped before anything was spooled)
    is discarded with one warning: no ``resume`` scope (it had no step, and no failure to
    report twice), no private exception name anywhere."""
    seen = Recorder()
    spool_dir = tmp_path / "spool"
    (spool_dir / "0123456789abcdef").mkdir(parents=True)  # a leftover save folder, no journal
    spool = {"dir": str(spool_dir), "mode": "always", "budget": "8MiB", "resume": True}
    config = Config(**{**small_config.model_dump(), "spool": spool})
    with caplog.at_level(logging.INFO, logger="aiosnap"), SyncCheckpointer(config, event_handlers=[seen]) as ckpt:
        ckpt.save({"w": torch.randn(1000)}, step=1).wait()
    assert not (spool_dir / "0123456789abcdef").exists()
    assert [e for e in seen.events if e.op == "resume"] == []
    discards = [r.getMessage() for r in caplog.records if "discarding spooled save" in r.getMessage()]
    assert len(discards) == 1 and "no journal" in discards[0], discards
    assert "_Discard" not in caplog.text and "step None" not in caplog.text
