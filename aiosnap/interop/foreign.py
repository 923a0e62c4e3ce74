"""A checkpoint of another format seen as a read-only aiosnap root holding one step.

:class:`ForeignStorage` wraps the storage that holds a foreign checkpoint (a DCP folder, a
``torch.save`` file) and a :class:`Translator` for its format. The translator reads the
format's own metadata and makes a :class:`~aiosnap.format.manifest.Manifest` of it (marked
``foreign``; ranges without a recorded checksum have ``crc32c`` None) whose data objects
are *virtual names* -- ``<step>/<save id>/<file>`` -- for byte ranges of the real files. So
the whole load machinery runs unchanged on it: in-place and partial loads, resharding into
DTensors, the staging slabs and RAM budget, ``verify``, ``info`` and the converter. Nothing
is ever written or deleted through it.

Coroutines run on the loop of whoever owns the storage (a checkpointer's background loop,
the CLI's). The translation is redone when the format's metadata changes (an overwrite),
and reused while it is the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core.names import MANIFEST_FILE, manifest_name, step_dir
from ..errors import CheckpointNotFoundError
from ..format.manifest import Manifest, Span
from ..storage.base import BytesLike, ObjectInfo, Storage

__all__ = ["STEP", "ForeignStorage", "Translation", "Translator", "VirtualObject"]

STEP = 0
"""The step a foreign checkpoint is presented as (its formats have no step of their own)."""


@dataclass(frozen=True)
class VirtualObject:
    """Bytes ``[start, start + size)`` of object ``name`` of the inner storage."""

    name: str
    start: int
    size: int


@dataclass(frozen=True)
class Translation:
    """One version of a foreign checkpoint: its manifest, where each of the manifest's
    objects really is, and what identifies the version (its metadata's digest)."""

    manifest: Manifest
    objects: dict[str, VirtualObject]
    version: bytes
    integrity: list[tuple[str, Span]] = field(default_factory=list)
    """Spans of the manifest's objects, with their crc32c, that loading does not read but
    :meth:`ForeignStorage.integrity_spans` offers verify (each with what it covers)."""


class Translator(Protocol):
    """A foreign format (see :mod:`aiosnap.interop.dcp.translate`)."""

    kind: str
    """What the checkpoint is, for messages: ``"a DCP checkpoint"``."""
    marker: str
    """The inner object whose presence makes the checkpoint exist (DCP: ``.metadata``)."""

    async def translate(self, inner: Storage, previous: Translation | None) -> Translation:
        """The checkpoint as it is now (``previous`` again when it has not changed)."""
        ...


def _read_only(url: str) -> PermissionError:
    return PermissionError(errno.EROFS, f"{url} is a checkpoint of another format, read-only to aiosnap")


class ForeignStorage(Storage):
    """A read-only aiosnap root of one step over a foreign checkpoint (see the module)."""

    read_only = True

    def __init__(self, inner: Storage, translator: Translator, url: str | None = None) -> None:
        self.inner = inner
        self.translator = translator
        self.url = url or inner.url
        self._translation: Translation | None = None
        self._lock: asyncio.Lock | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner, "translator": self.translator, "url": self.url}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["inner"], state["translator"], state["url"])  # type: ignore[misc]

    async def translation(self) -> Translation:
        """The checkpoint's current translation (the metadata is read each time, the rest
        redone only when it changed)."""
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            self._translation = await self.translator.translate(self.inner, self._translation)
            return self._translation

    async def integrity_spans(self, step: int) -> list[tuple[str, Span]]:
        translation = await self.translation()
        return translation.integrity if translation.manifest.step == step else []

    async def translated_manifest(self, step: int) -> Manifest:
        found = (await self.translation()).manifest
        if found.step != step:
            raise CheckpointNotFoundError(
                f"{self.url} is {self.translator.kind}: it holds step {found.step}, not {step}"
            )
        return found

    async def _object(self, name: str) -> VirtualObject:
        translation = self._translation or await self.translation()
        found = translation.objects.get(name)
        if found is None:
            translation = await self.translation()  # a newer version may name it
            found = translation.objects.get(name)
        if found is None:
            raise FileNotFoundError(f"{self.url}: no object {name!r} in {self.translator.kind}")
        return found

    async def read(self, name: str, *, limit: int | None = None) -> bytes:
        if name == manifest_name(STEP):  # there is no manifest.json: read_manifest asks translated_manifest
            raise FileNotFoundError(f"{self.url} is {self.translator.kind}; its manifest is translated, not stored")
        found = await self._object(name)
        size = found.size if limit is None else min(found.size, limit + 1)
        buffer = bytearray(size)
        got = await self.read_into(name, 0, memoryview(buffer))
        return bytes(buffer[:got])

    async def size(self, name: str) -> int:
        found = await self._object(name)
        real = await self.inner.size(found.name)
        return max(0, min(found.size, real - found.start))

    async def read_into(self, name: str, offset: int, dest: memoryview) -> int:
        return await self.read_scatter(name, offset, [dest])

    async def read_scatter(self, name: str, offset: int, buffers: Sequence[memoryview]) -> int:
        found = await self._object(name)
        room = max(0, found.size - offset)
        fitting: list[memoryview] = []
        for buffer in buffers:  # never past the virtual object's end
            view = memoryview(buffer).cast("B")[:room]
            fitting.append(view)
            room -= len(view)
        return await self.inner.read_scatter(found.name, found.start + offset, fitting)

    def reading(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.inner.reading()

    async def exists(self, name: str) -> bool:
        if name == manifest_name(STEP):
            return await self.inner.exists(self.translator.marker)
        try:
            await self._object(name)
        except FileNotFoundError:
            return False
        except Exception:  # a damaged checkpoint: loads say why
            return False
        return True

    async def list_children(self, prefix: str = "") -> list[str]:
        if not await self.inner.exists(self.translator.marker):
            return []
        wanted = prefix.strip("/")
        if wanted == "":
            return [step_dir(STEP)]
        return [MANIFEST_FILE] if wanted == step_dir(STEP) else []

    async def walk(self, prefix: str = "") -> list[ObjectInfo]:
        return []  # nothing of aiosnap's own is incomplete here

    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        raise _read_only(self.url)

    async def delete(self, name: str) -> None:
        raise _read_only(self.url)

    async def delete_prefix(self, prefix: str) -> None:
        raise _read_only(self.url)

    async def check_root(self) -> None:
        await self.inner.check_root()
        if not await self.inner.exists(self.translator.marker):
            raise FileNotFoundError(f"{self.url}: {self.translator.kind} without its {self.translator.marker}")

    async def connect(self) -> None:
        await self.inner.connect()

    async def close(self) -> None:
        await self.inner.close()
