"""Checkpoint URLs that aiosnap's storage does not serve, reached the way Lightning reaches
them: through fsspec (``http://``, ``https://``, ``memory://``, ``gs://`` with gcsfs, ...).

aiosnap serves local paths, ``file://`` and ``s3://`` itself (and schemes registered with
:func:`~aiosnap.storage.registry.register_scheme`); any other URL is fsspec's. Loading one
copies the file to a temporary file first (a stream of blocks, never the whole file in
memory), which the caller then reads like a local checkpoint: an aiosnap single file is
loaded verified (every tensor's crc32c), anything else with ``torch.load``.

Caller's thread (blocking).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..storage.registry import has_scheme

__all__ = ["fetched", "shown", "through_fsspec"]


def through_fsspec(url: str) -> bool:
    """True when ``url`` names a scheme that aiosnap's storage does not serve."""
    if "://" not in url:
        return False
    return not has_scheme(urlparse(url).scheme)


def shown(url: str) -> str:
    """``url`` fit for messages and logs: a password in it (``https://user:secret@host``)
    replaced by ``***``."""
    parsed = urlparse(url)
    if parsed.password is None:
        return url
    return parsed._replace(netloc=parsed.netloc.replace(f":{parsed.password}@", ":***@", 1)).geturl()


@contextlib.contextmanager
def fetched(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[Path]:
    """A temporary local copy of the file at ``url`` (removed when the block ends).
    FileNotFoundError when there is none."""
    from fsspec.core import url_to_fs

    filesystem, remote = url_to_fs(url, **(storage_options or {}))
    with tempfile.TemporaryDirectory(prefix="aiosnap-fetch-") as folder:
        local = Path(folder) / (Path(remote).name or "checkpoint")
        try:
            filesystem.get_file(remote, str(local))
        except FileNotFoundError:
            raise FileNotFoundError(f"Checkpoint file not found: {shown(url)}") from None
        if not local.is_file():  # a folder at the URL, or nothing copied
            raise FileNotFoundError(f"Checkpoint file not found: {shown(url)} (not a file)")
        yield local
