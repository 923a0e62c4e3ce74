"""Admission.hold: while a rollback, purge or spool resume holds a root, no new save to it is
admitted, also one that was already waiting for a pending-save slot (third review of issue 24:
such a save took the step a resume was about to retire as its base)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from aiosnap import Config
from aiosnap.runtime.admission import Admission
from aiosnap.storage.local import LocalStorage


def _plan(step: int) -> Any:
    return SimpleNamespace(step=step, spec=SimpleNamespace(distributed=None))


async def test_a_save_waiting_for_a_slot_is_admitted_only_after_the_hold(tmp_path: Path) -> None:
    admission = Admission(Config(storage={"url": str(tmp_path)}, max_pending_saves=1))
    storage, other_root = LocalStorage(tmp_path / "a"), LocalStorage(tmp_path / "b")
    await admission.enter(_plan(1), storage)  # a save in flight holds the only slot
    waiting = asyncio.create_task(admission.enter(_plan(2), storage))
    await asyncio.sleep(0.05)
    order: list[str] = []
    async with admission.hold(storage):
        assert admission._pending is not None
        admission._pending.release()  # the save in flight ends while the root is held
        await asyncio.sleep(0.1)
        assert not waiting.done()  # the freed slot did not let the waiting save in
        order.append("hold ended")
    await asyncio.wait_for(waiting, 5)
    order.append("admitted")
    assert order == ["hold ended", "admitted"]
    admission._pending.release()
    async with admission.hold(storage):  # another root is not held
        await asyncio.wait_for(admission.enter(_plan(3), other_root), 5)
