"""aiosnap's events for DCP saves through its writer (see :mod:`aiosnap.core.events`).

Each rank's ``write_data`` emits ``start`` and then an ``upload`` stage ``end`` (its bytes
and seconds) or an ``exception``; the coordinator's ``finish`` emits a ``commit`` stage
``end`` and one ``end`` for the whole checkpoint (or an ``exception``). Handlers come from
the writer's ``config.events`` (the ``aiosnap.events`` logger, a JSON-lines file); events
are delivered by their dispatcher thread before the call returns (at most 10 s).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from ...config import Config
from ...core.events import EventBus, EventHandler, JsonlHandler, LoggingHandler, ProcessGroupInfo

__all__ = ["save_events"]


def _handlers(config: Config) -> list[EventHandler]:
    handlers: list[EventHandler] = []
    if config.events.log:
        handlers.append(LoggingHandler())
    if config.events.jsonl is not None:
        handlers.append(JsonlHandler(config.events.jsonl))
    return handlers


def _group(rank: int) -> ProcessGroupInfo:
    try:
        return ProcessGroupInfo.of(None, None, None)
    except ValueError:
        return ProcessGroupInfo(rank=rank, world_size=rank + 1)


@contextlib.contextmanager
def save_events(config: Config, url: str, save_id: str, rank: int, stage: str, whole: bool) -> Iterator[dict[str, Any]]:
    """Around one stage of a DCP save (``upload`` on every rank, ``commit`` on the
    coordinator; ``whole``: also the checkpoint's own ``end``). The caller puts the bytes
    it handled in the yielded dict's ``nbytes``."""
    handlers = _handlers(config)
    if not handlers:
        yield {}
        return
    bus = EventBus(handlers, _group(rank), url)
    figures: dict[str, Any] = {"nbytes": None}
    started = time.perf_counter()
    if stage == "upload":
        bus.emit("start", "save", None, save_id=save_id)
    try:
        yield figures
    except BaseException as exc:
        bus.emit("exception", "save", None, save_id=save_id, exception=exc)
        raise
    else:
        seconds = time.perf_counter() - started
        bus.emit("end", "save", None, stage=stage, save_id=save_id, nbytes=figures["nbytes"], seconds=seconds)
        if whole:
            bus.emit("end", "save", None, save_id=save_id, nbytes=figures.get("total"))
    finally:
        bus.close(timeout=10)
