"""Storage backends that fail on cue and pickle, so that the upload process (which imports
them by module path) can run them: fault injection for ``upload.executor: process``."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from aiosnap.interop.singlefile import ArchiveStorage
from aiosnap.storage.base import BytesLike
from aiosnap.storage.local import LocalStorage


class DataFailsBelowStep(LocalStorage):
    """A local root whose data object writes fail (a full disk) for steps below ``step``."""

    def __init__(self, root: str, step: int) -> None:
        super().__init__(root)
        self.step = step

    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        if name.endswith(".bin") and int(name.split("/")[0]) < self.step:
            raise OSError(28, "No space left on device (injected)")
        await super().write(name, data, if_absent=if_absent)


class WedgedAfterManifest(LocalStorage):
    """The manifest write lands, then the upload process's loop freezes (a wedged helper)."""

    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        await super().write(name, data, if_absent=if_absent)
        if name.endswith("manifest.json"):
            import time

            time.sleep(60)  # noqa: ASYNC251 - wedges the upload process's loop on purpose


class CommitWaitsForRelease(ArchiveStorage):
    """A single-file checkpoint whose commit waits, in whichever process runs it, until the
    file ``release`` exists in ``gate``; it first writes ``gate/waiting`` holding its pid
    (every chunk has landed by then). The gate folder is not the checkpoint's, so listings
    of the checkpoint's folder see only what aiosnap put there."""

    def __init__(self, path: str, gate: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.gate = gate

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "gate": self.gate}

    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        if name.endswith("manifest.json"):
            gate = Path(self.gate)
            (gate / "waiting.tmp").write_text(str(os.getpid()))
            (gate / "waiting.tmp").rename(gate / "waiting")
            deadline = time.monotonic() + 60
            while not (gate / "release").exists() and time.monotonic() < deadline:  # noqa: ASYNC110 - a file
                await asyncio.sleep(0.01)
        await super().write(name, data, if_absent=if_absent)


class RankFaults(LocalStorage):
    """One rank's root in a multi-rank job, with a fault per step (``plan``: step -> action):
    ``hang_data``: the step's data objects never finish (the trainer then kills the helper);
    ``wedge_after_part``: the rank's part lands, then the upload process's loop freezes;
    ``slow_data``: each of the step's data objects takes :attr:`SLOW_S` seconds (a slow rank).
    A file ``<marks>/<action>-<rank>-<step>`` says the moment has come."""

    SLOW_S = 8.0

    def __init__(self, root: str, rank: int, plan: dict[str, str], marks: str) -> None:
        super().__init__(root)
        self.rank = rank
        self.plan = plan
        self.marks = marks

    def _mark(self, action: str, step: str) -> None:
        import pathlib

        pathlib.Path(self.marks, f"{action}-{self.rank}-{step}").touch()

    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        import asyncio
        import time

        step = name.split("/", 1)[0].lstrip("0") or "0"
        action = self.plan.get(step)
        if action == "hang_data" and name.endswith(".bin"):
            self._mark(action, step)
            await asyncio.sleep(3600)
        if action == "slow_data" and name.endswith(".bin"):
            await asyncio.sleep(self.SLOW_S)
        await super().write(name, data, if_absent=if_absent)
        if action == "wedge_after_part" and name.endswith(f"rank-{self.rank}.part.json"):
            self._mark(action, step)
            time.sleep(60)  # noqa: ASYNC251 - wedges the upload process's loop on purpose


class KillAt(LocalStorage):
    """Kills the process it runs in -- a rank (``upload.executor: thread``) or its upload
    helper (``process``) -- at ``point`` of the save of ``step``: ``data`` (as its first data
    object is written), ``part`` (its part landed), ``verdict`` (the verdict landed),
    ``manifest`` (the step's manifest landed). Disarmed (``step`` None), a plain root."""

    def __init__(self, root: str, step: int | None, point: str | None, *, in_helper: bool) -> None:
        import os

        super().__init__(root)
        self.step = step
        self.point = point
        self.in_helper = in_helper  # kill the upload helper only, not the trainer writing after it
        self.made_in = os.getpid()

    def _here(self, name: str, point: str) -> bool:
        import os

        if (os.getpid() != self.made_in) != self.in_helper:
            return False
        return self.point == point and self.step is not None and name.startswith(f"{self.step:012d}/")

    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        import os

        if self._here(name, "data") and name.endswith(".bin"):
            os._exit(9)
        await super().write(name, data, if_absent=if_absent)
        for point, suffix in (("part", ".part.json"), ("verdict", "/verdict"), ("manifest", "/manifest.json")):
            if self._here(name, point) and name.endswith(suffix):
                os._exit(9)
