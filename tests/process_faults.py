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
