"""The transfer side on its own: what closing does to the saves it cancels.

An upload process whose trainer died closes with ``abandoned=True``: the attempts it
cancels stay in place, because the next trainer may resume the same spooled save into the
same attempt folder meanwhile (removing them deleted a step that had just been committed).
A normal close removes a cancelled attempt's data, as ever."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from aiosnap import Config
from aiosnap.core.arena import Arena
from aiosnap.handoff.contract import SlabChunk, TransferOutcome
from aiosnap.storage.local import LocalStorage
from aiosnap.trainer.capture import Copier
from aiosnap.trainer.plan import make_plan
from aiosnap.transfer.local import LocalTransfer
from tests.conftest import FaultyStorage


class _Listener:
    def __init__(self) -> None:
        self.outcomes: dict[str, TransferOutcome] = {}

    def preflight(self, save_id: str, latest: int | None, error: BaseException | None) -> None:
        pass

    def done_with(self, save_id: str, index: int, pieces: list[int] | None) -> None:
        pass

    def sent(self, save_id: str, index: int, nbytes: int) -> None:
        pass

    def stage_ended(self, save_id: str, stage: str, nbytes: int, seconds: float) -> None:
        pass

    def finished(self, save_id: str, outcome: TransferOutcome) -> None:
        self.outcomes[save_id] = outcome


@pytest.mark.parametrize("abandoned", [True, False])
async def test_closing_after_the_trainer_died_leaves_cancelled_attempts_in_place(
    tmp_path: Path, abandoned: bool
) -> None:
    chunk = 64 * 1024
    plan = make_plan({"a": torch.ones(chunk // 4), "b": torch.full((chunk // 4,), 2.0)}, step=5, chunk_bytes=chunk)
    assert len(plan.chunks) == 2
    arena = Arena(chunk, 2, shared=False)
    copier = Copier()
    for index, planned in enumerate(plan.chunks):
        copier.copy(plan, planned, torch.frombuffer(arena.view(index), dtype=torch.uint8), None)
    storage = FaultyStorage(LocalStorage(tmp_path))
    storage.hold_when = lambda name: name.endswith("/1.bin")  # chunk 0 lands, chunk 1 waits
    listener = _Listener()
    transfer = LocalTransfer(Config(storage={"url": str(tmp_path)}), arena, listener)
    transfer.open_root(str(tmp_path), storage)
    transfer.begin(plan.save_id, str(tmp_path), None, plan.spec)
    for index, planned in enumerate(plan.chunks):
        transfer.staged(SlabChunk(plan.save_id, index, index, planned.nbytes))
    transfer.captured(plan.save_id)
    landed = tmp_path / plan.chunks[0].object_name
    for _ in range(200):
        if landed.exists():
            break
        await asyncio.sleep(0.02)
    assert landed.exists()
    await transfer.close(abandoned=abandoned)
    assert not listener.outcomes[plan.save_id].committed
    assert landed.exists() == abandoned, "an orphaned upload process must not remove what it cancelled"
    arena.close()
