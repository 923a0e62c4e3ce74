"""Checkpoint URLs that aiosnap's storage does not serve, reached the way Lightning reaches
them: through fsspec (``http://``, ``https://``, ``memory://``, ``gs://`` with gcsfs, ...).

aiosnap serves local paths, ``file://`` and ``s3://`` itself (and schemes registered with
:func:`~aiosnap.storage.registry.register_scheme`); any other URL is fsspec's. Loading one
copies the file to a temporary file first (a stream of blocks, never the whole file in
memory), which the caller then reads like a local checkpoint: an aiosnap single file is
loaded verified (every tensor's crc32c), anything else with ``torch.load``. A download that
fails is a :class:`~aiosnap.errors.StorageError` naming the URL, and a downloaded file that
``torch.load`` cannot read a :class:`~aiosnap.errors.CorruptCheckpointError` naming it; a
URL is always shown without its credentials (:mod:`aiosnap.core.redact`).

Caller's thread (blocking).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

from ..core.redact import scrubbed as scrubbed_of
from ..core.redact import shown_url
from ..errors import AiosnapError, CorruptCheckpointError, StorageError
from ..storage.registry import has_scheme

__all__ = ["fetched", "scrubbed", "shown", "through_fsspec", "unreadable_download_named"]

_T = TypeVar("_T")


def through_fsspec(url: str) -> bool:
    """True when ``url`` names a scheme that aiosnap's storage does not serve."""
    if "://" not in url:
        return False
    return not has_scheme(urlparse(url).scheme)


def shown(path: Any) -> str:
    """A checkpoint path or URL as Lightning gave it, fit for messages and logs: without
    its credentials (:func:`~aiosnap.core.redact.shown_url`)."""
    return shown_url(path if isinstance(path, (str, os.PathLike)) else str(path))


def scrubbed(text: str, path: Any) -> str:
    """``text`` (another library's message) without the credentials of ``path``."""
    return scrubbed_of(text, path if isinstance(path, (str, os.PathLike)) else str(path))


@contextlib.contextmanager
def fetched(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[Path]:
    """A temporary local copy of the file at ``url`` (removed when the block ends).
    FileNotFoundError when there is none; StorageError naming ``url`` when the download
    fails (an HTTP error status, a body cut short)."""
    from fsspec.core import url_to_fs

    filesystem, remote = url_to_fs(url, **(storage_options or {}))
    with tempfile.TemporaryDirectory(prefix="aiosnap-fetch-") as folder:
        local = Path(folder) / (Path(remote).name or "checkpoint")
        failure: Exception | None = None
        try:
            filesystem.get_file(remote, str(local))
        except FileNotFoundError:
            failure = FileNotFoundError(f"Checkpoint file not found: {shown(url)}")
        except Exception as exc:  # aiohttp's, fsspec's, OSError: whatever the backend raises
            failure = StorageError(f"downloading {shown(url)} failed: {type(exc).__name__}: {scrubbed(str(exc), url)}")
        if failure is not None:
            raise failure  # outside the handler: the original, which may quote the URL whole, is not chained
        if not local.is_file():  # a folder at the URL, or nothing copied
            raise FileNotFoundError(f"Checkpoint file not found: {shown(url)} (not a file)")
        yield local


def unreadable_download_named(url: str, load: Callable[[], _T]) -> _T:
    """``load()`` of a file downloaded from ``url``; what ``torch.load`` raises when the file
    is no readable checkpoint (cut short without the server saying so, say) becomes a
    CorruptCheckpointError naming ``url``. aiosnap's own errors, FileNotFoundError, TypeError
    and an unpickling refusal pass as they are."""
    try:
        return load()
    except (AiosnapError, FileNotFoundError):
        raise
    except (OSError, EOFError, RuntimeError) as exc:
        raise CorruptCheckpointError(
            f"the file downloaded from {shown(url)} is not a checkpoint torch.load can read (cut short on the "
            f"way?): {type(exc).__name__}: {scrubbed(str(exc), url)}"
        ) from exc
