"""The storage protocol and the URL -> backend factory.

A backend is a small async interface over named objects (``/``-separated names relative
to the storage root). Every method runs on aiosnap's background loop thread. Conventions
every backend keeps:

- :meth:`Storage.write` is atomic: a reader sees the whole object or nothing.
- A missing object raises :class:`FileNotFoundError` (whatever the backend's own error).
- Other failures keep their original type (``OSError`` from a disk, for example), so they
  reach the user unchanged.
- When :meth:`Storage.write` or :meth:`Storage.read_into` returns or raises (cancellation
  included), no thread uses the buffer any more: the caller reuses it at once.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

from ..config import Config
from ..errors import ConfigError

__all__ = ["BytesLike", "ObjectInfo", "Storage", "complete_before_cancel", "roots_overlap", "storage_from_url"]

BytesLike = bytes | bytearray | memoryview
T = TypeVar("T")


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def complete_before_cancel(operation: Coroutine[Any, Any, T]) -> T:
    """Await ``operation``; if the caller is cancelled meanwhile, let the operation run to
    its end first (no buffer still in use by a thread, no file left open), then re-raise."""
    task = asyncio.ensure_future(operation)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # mark retrieved: the cancellation is what the caller reports
        raise


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: root-relative name, size in bytes, last modification (epoch s)."""

    name: str
    size: int
    mtime: float


class Storage(abc.ABC):
    """Async object storage rooted at one URL."""

    url: str
    settled_writes: bool = False
    """True when a :meth:`write` that returned, raised or was cancelled can have no effect
    later (local files: the rename happened or it did not). False for object stores, where
    a request abandoned mid-way may still land."""

    @abc.abstractmethod
    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        """Store ``data`` under ``name``, atomically and durably (replaces an old object).

        With ``if_absent``, raise :class:`FileExistsError` instead when ``name`` exists."""

    async def write_file(self, name: str, path: str) -> None:
        """Store the local file ``path`` under ``name`` (used for spooled chunks).

        This default reads the whole file into memory; the built-in backends stream it."""
        data = await asyncio.to_thread(_read_file, path)
        await self.write(name, data)

    @abc.abstractmethod
    async def read(self, name: str, *, limit: int | None = None) -> bytes:
        """The whole object (used for small objects such as manifests); with ``limit``, at
        most ``limit + 1`` bytes of it (so a caller can tell an object is too large without
        reading all of it)."""

    @abc.abstractmethod
    async def size(self, name: str) -> int:
        """The object's size in bytes (FileNotFoundError when it does not exist)."""

    @abc.abstractmethod
    async def read_into(self, name: str, offset: int, dest: memoryview) -> int:
        """Read up to ``len(dest)`` bytes from ``offset`` into ``dest``; returns bytes read
        (fewer only when the object ends early)."""

    @abc.abstractmethod
    async def exists(self, name: str) -> bool:
        """True when the object exists."""

    @abc.abstractmethod
    async def list_children(self, prefix: str = "") -> list[str]:
        """Names of the immediate children (objects or folders) under ``prefix``."""

    @abc.abstractmethod
    async def delete(self, name: str) -> None:
        """Delete one object; a missing object is not an error."""

    @abc.abstractmethod
    async def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix``; a missing prefix is not an error."""

    async def walk(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object under ``prefix`` (recursively), names relative to the root. Used by
        maintenance (``aiosnap ls --all``, ``aiosnap gc``), not by saves or loads."""
        raise NotImplementedError(f"{type(self).__name__} cannot list objects with sizes and times")

    async def stale_uploads(self, older_than: float) -> list[tuple[str, str]]:
        """Unfinished multipart uploads under the root started before ``older_than`` (epoch
        seconds), as (root-relative name, upload id). Backends without them have none."""
        return []

    async def abort_upload(self, name: str, upload_id: str) -> None:  # noqa: B027 - optional hook
        """Abort one unfinished multipart upload (one already gone is not an error)."""

    async def check_root(self) -> None:  # noqa: B027 - optional hook
        """Raise FileNotFoundError / NotADirectoryError when the root cannot be a checkpoint
        root (a local path that does not exist, or is a file); used by maintenance, where a
        typo in a path must not look like an empty root."""

    async def remove_empty_folder(self, prefix: str = "") -> None:  # noqa: B027 - optional hook
        """Remove the folder ``prefix`` (the root itself when empty) if nothing is left in
        it, for backends that have folders."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and other resources."""


def roots_overlap(a: Storage, b: Storage) -> bool:
    """True when one root lies inside the other (or they are the same root spelled two
    ways): what is written to one could then be read or deleted through the other."""
    from pathlib import Path

    if a.url.startswith("s3://") != b.url.startswith("s3://"):
        return False
    if a.url.startswith("s3://"):
        left, right = a.url[5:].strip("/").split("/"), b.url[5:].strip("/").split("/")
    else:
        left, right = list(Path(a.url).resolve().parts), list(Path(b.url).resolve().parts)
    shorter = min(len(left), len(right))
    return left[:shorter] == right[:shorter]


def storage_from_url(url: str, config: Config | None = None) -> Storage:
    """A backend for ``url``: a plain path (taken literally) or ``file://`` (local; the path
    percent-decoded), ``s3://bucket/prefix`` (S3, configured by ``config.s3``; aiobotocore
    is imported only then). A ``?`` or ``#`` in a URL is refused rather than silently cut
    off (two different URLs are never one root)."""
    parsed = urlparse(url)
    if not url.strip():
        raise ConfigError("storage.url: empty; name a folder (a path, file:///abs/path) or s3://bucket/prefix")
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and url[1:3] in (":\\", ":/")):
        from .local import LocalStorage

        return LocalStorage(url)
    if parsed.query or parsed.fragment or url.endswith(("?", "#")):
        raise ConfigError(
            f"storage.url: {url!r} has a '?' or '#', which a URL does not keep as part of the path; "
            "percent-encode it (%3F, %23) in a file:// URL, or give the folder as a plain path"
        )
    if parsed.scheme == "file":
        from .local import LocalStorage

        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"storage.url: file:// URL with a host is not supported: {url!r}")
        if not parsed.path.strip("/"):
            raise ConfigError(f"storage.url: {url!r} names no folder (use file:///abs/path)")
        return LocalStorage(unquote(parsed.path))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ConfigError(f"storage.url: {url!r} names no bucket (use s3://bucket/prefix)")
        from .s3 import S3Storage

        config = config or Config()
        return S3Storage(parsed.netloc, parsed.path.strip("/"), config.s3, concurrency=config.upload.concurrency)
    raise ConfigError(f"storage.url: unsupported scheme {parsed.scheme!r} in {url!r} (use a path, file:// or s3://)")
