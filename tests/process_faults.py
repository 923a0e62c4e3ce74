"""Storage backends that fail on cue and pickle, so that the upload process (which imports
them by module path) can run them: fault injection for ``upload.executor: process``."""

from __future__ import annotations

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
