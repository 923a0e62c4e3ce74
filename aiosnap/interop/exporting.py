"""``aiosnap.export``: one entry point for every conversion, the command line's too.

``to="safetensors"`` (the default) writes Hugging Face shards and their index
(:mod:`aiosnap.interop.safetensors.api`), from an aiosnap root or file (multi-rank
included), a DCP folder or a ``torch.save`` file; ``to="aiosnap"`` from a safetensors folder
imports it (every range checksummed on the way in); ``to="aiosnap" | "dcp" | "torch"`` from
anything else runs the converter (:mod:`aiosnap.interop.convert`). Runs on the caller's
thread and blocks until the export is committed.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..config import Config, load_config
from ..storage.registry import storage_from_url
from .convert import ExportResult
from .convert import export as convert
from .detect import looks_like_safetensors
from .safetensors.export import ExportReport

__all__ = ["FORMATS", "export"]

FORMATS = ("safetensors", "aiosnap", "dcp", "torch")
"""What ``to`` may be."""

_HF_ONLY = (
    "max_shard_size",
    "dtype",
    "names",
    "strip",
    "prefix",
    "metadata",
    "overwrite",
    "dest_step",
    "process_group",
)
"""Options of safetensors exports and imports only."""


def export(
    src: str,
    dest: str,
    *,
    to: str = "safetensors",
    step: int | None = None,
    paths: Sequence[str] | None = None,
    config: Config | Mapping[str, Any] | str | Path | None = None,
    allow_pickle: bool = False,
    progress: Callable[[int, int], None] | None = None,
    **safetensors: Any,
) -> ExportResult | ExportReport:
    """Write the checkpoint at ``src`` (local or ``s3://``) to ``dest`` in the format ``to``.

    ``step``: which step of an aiosnap source (the latest by default); ``paths``: glob
    patterns of the key paths to take (``["model/*"]``); ``config``: a
    :class:`~aiosnap.Config`, a dict or a YAML file (RAM budget, concurrency, S3);
    ``allow_pickle``: a source's pickled objects may be unpickled to be written in another
    format; ``progress(done, total)`` hears the bytes written (``total`` 0 while unknown).
    The safetensors options (``max_shard_size``, ``dtype``, ``names``, ``strip``,
    ``prefix``, ``metadata``, ``overwrite``, ``dest_step``, ``process_group``) are those of
    :func:`aiosnap.interop.safetensors.api.export`. Returns what was written: an
    :class:`~aiosnap.interop.convert.ExportResult`, or for safetensors exports and imports
    an :class:`~aiosnap.interop.safetensors.export.ExportReport`."""
    if to not in FORMATS:
        raise ValueError(f"to={to!r}: choose one of {', '.join(FORMATS)}")
    unknown = sorted(set(safetensors) - set(_HF_ONLY))
    if unknown:
        raise TypeError(f"export() got unexpected keyword argument(s) {', '.join(unknown)}")
    settings = _settings(config)
    if to == "safetensors" or (to == "aiosnap" and is_safetensors_folder(src, settings)):
        from .safetensors.api import export as hf_export

        if allow_pickle:
            raise ValueError("allow_pickle: a safetensors export or import holds tensors only")
        written = [0]

        def told(nbytes: int) -> None:
            written[0] += nbytes
            if progress is not None:
                progress(written[0], 0)

        return hf_export(src, dest, to=to, step=step, paths=paths, config=settings, progress=told, **safetensors)
    given = [name for name in _HF_ONLY if name in safetensors]
    if given:
        raise ValueError(f"{', '.join(given)}: option(s) of to='safetensors' exports (and imports) only, not to={to!r}")
    return convert(src, dest, to=to, step=step, paths=paths, config=settings, allow_pickle=allow_pickle,
                   progress=progress)  # fmt: skip


def _settings(config: Config | Mapping[str, Any] | str | Path | None) -> Config:
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, Path)):
        return load_config(config)
    return Config(**dict(config or {}))


def is_safetensors_folder(url: str, config: Config | None = None) -> bool:
    """Whether ``url`` is a folder of safetensors files and no aiosnap root (no step
    folders): an index file, or ``*.safetensors`` files. Caller's thread (not a loop's)."""
    if "://" not in url:
        path = Path(url).expanduser()
        return path.is_dir() and looks_like_safetensors(os.listdir(path))
    return asyncio.run(_remote_is_hf(url, config or Config()))


async def _remote_is_hf(url: str, config: Config) -> bool:
    storage = storage_from_url(url, config)
    try:
        return looks_like_safetensors(await storage.list_children(""))
    finally:
        await storage.close()
