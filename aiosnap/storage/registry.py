"""Choosing a storage backend by URL scheme, and comparing roots.

Backends register the schemes they serve; each is imported only when a URL of its scheme
is used (S3 pulls in aiobotocore).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlparse

from ..config import URL_SCHEMES, Config, redacted
from ..errors import ConfigError
from .base import Storage

__all__ = ["has_scheme", "register_scheme", "roots_overlap", "storage_from_url"]


def roots_overlap(a: Storage, b: Storage) -> bool:
    """True when one root lies inside the other (or they are the same root spelled two
    ways): what is written to one could then be read or deleted through the other."""
    if a.url.startswith("s3://") != b.url.startswith("s3://"):
        return False
    if a.url.startswith("s3://"):
        left, right = a.url[5:].strip("/").split("/"), b.url[5:].strip("/").split("/")
    else:
        left, right = list(Path(a.url).resolve().parts), list(Path(b.url).resolve().parts)
    shorter = min(len(left), len(right))
    return left[:shorter] == right[:shorter]


Factory = Callable[[str, str, Config], Storage]
"""Makes a backend from (the URL as given, its path part decoded, the config)."""

_SCHEMES: dict[str, Factory] = {}


def register_scheme(scheme: str, factory: Factory) -> None:
    """Serve ``scheme://`` URLs with ``factory`` (a custom backend's entry point); from
    then on ``storage.url`` may use the scheme in a config."""
    _SCHEMES[scheme] = factory
    URL_SCHEMES.add(scheme)


def has_scheme(scheme: str) -> bool:
    """True when ``scheme://`` URLs have a backend (``file``, ``s3``, registered ones)."""
    return scheme in _SCHEMES


def _local(url: str, path: str, config: Config) -> Storage:
    from .local import LocalStorage

    return LocalStorage(path)


def _s3(url: str, path: str, config: Config) -> Storage:
    bucket, _, prefix = path.partition("/")
    if not bucket:
        raise ConfigError(f"storage.url: {redacted(url)!r} names no bucket (use s3://bucket/prefix)")
    from .s3 import S3Storage

    return S3Storage(bucket, prefix.strip("/"), config.s3, concurrency=config.upload.concurrency)


register_scheme("file", _local)
register_scheme("s3", _s3)


def storage_from_url(url: str, config: Config | None = None) -> Storage:
    """A backend for ``url``: a plain path (taken literally) or ``file://`` (local; the path
    percent-decoded), ``s3://bucket/prefix``
    (S3, configured by ``config.s3``; aiobotocore is imported only then), or a scheme
    registered with :func:`register_scheme`. A ``?`` or ``#`` in a URL is refused rather than
    silently cut off (two different URLs are never one root)."""
    config = config or Config()
    if not url.strip():
        raise ConfigError("storage.url: empty; name a folder (a path, file:///abs/path) or s3://bucket/prefix")
    parsed = urlparse(url)
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and url[1:3] in (":\\", ":/")):
        return _local(url, url, config)  # a plain path (or a Windows drive), literally
    if parsed.query or parsed.fragment or url.endswith(("?", "#")):
        raise ConfigError(
            f"storage.url: {redacted(url)!r} has a '?' or '#', which a URL does not keep as part of the path; "
            "percent-encode it (%3F, %23) in a file:// URL, or give the folder as a plain path"
        )
    factory = _SCHEMES.get(parsed.scheme)
    if factory is None:
        known = ", ".join(f"{s}://" for s in sorted(_SCHEMES))
        raise ConfigError(
            f"storage.url: unsupported scheme {parsed.scheme!r} in {redacted(url)!r} (use a path or {known})"
        )
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"storage.url: file:// URL with a host is not supported: {redacted(url)!r}")
        if not parsed.path.strip("/"):
            raise ConfigError(f"storage.url: {redacted(url)!r} names no folder (use file:///abs/path)")
        return factory(url, unquote(parsed.path), config)
    return factory(url, parsed.netloc + parsed.path, config)
