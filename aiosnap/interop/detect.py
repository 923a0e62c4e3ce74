"""Which checkpoint a URL names, told by its content: an aiosnap root, an aiosnap single
file, a DCP folder, a ``torch.save`` file -- each opened as a storage whose steps and
manifests the rest of aiosnap reads alike (foreign ones read-only, their manifests
translated: :mod:`aiosnap.interop.foreign`).

Other formats plug in with :func:`register_detector` (safetensors, say): a detector is a
coroutine ``detect(url, config) -> Storage | None`` tried before the built-in ones. Runs on
the caller's loop.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence

from ..config import Config
from ..storage.base import Storage
from ..storage.registry import storage_from_url
from .dcp.api import checkpoint_storage, is_dcp_checkpoint
from .dcp.metadata import METADATA_FILE
from .safetensors.layout import INDEX_FILE
from .safetensors.reader import SafetensorsFolder
from .singlefile import ArchiveStorage, is_archive
from .torchfile import is_torch_file, torch_file_storage

__all__ = ["Detector", "describe", "open_checkpoint", "register_detector"]

Detector = Callable[[str, Config], Awaitable[Storage | None]]
_DETECTORS: list[Detector] = []


def register_detector(detector: Detector) -> None:
    """Try ``detector`` first on every URL :func:`open_checkpoint` is given."""
    _DETECTORS.append(detector)


def describe(storage: Storage) -> str:
    """What kind of checkpoint ``storage`` is, for messages."""
    translator = getattr(storage, "translator", None)
    if translator is not None:
        return str(translator.kind)
    if isinstance(storage, SafetensorsFolder):
        return "a safetensors folder"
    return "an aiosnap single-file checkpoint" if storage.single_file else "an aiosnap checkpoint root"


def _local_file(path: str) -> Storage:
    if is_archive(path):
        return ArchiveStorage(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if is_torch_file(head):
        return torch_file_storage(path)
    return ArchiveStorage(path)  # holds no step: listing it says so


def _local(url: str, settings: Config) -> Storage:
    path = os.path.expanduser(url)
    if os.path.isfile(path):
        return _local_file(url)
    if is_dcp_checkpoint(path):
        return checkpoint_storage(url, settings)
    if os.path.isdir(path) and looks_like_safetensors(os.listdir(path)):
        return SafetensorsFolder(storage_from_url(url, settings))
    return storage_from_url(url, settings)


def looks_like_safetensors(names: Sequence[str]) -> bool:
    """Whether a folder holding ``names`` is a safetensors folder: an index file or
    ``*.safetensors`` files, and no aiosnap step folders."""
    has_steps = any(name.isdigit() and len(name) >= 12 for name in names)
    return not has_steps and (INDEX_FILE in names or any(name.endswith(".safetensors") for name in names))


async def open_checkpoint(url: str, config: Config | None = None) -> Storage:
    """The storage of the checkpoint at ``url`` (see the module)."""
    settings = config or Config()
    for detector in _DETECTORS:
        found = await detector(url, settings)
        if found is not None:
            return found
    if "://" not in url:
        return _local(url, settings)
    storage = storage_from_url(url, settings)
    if url.startswith("s3://"):
        if await storage.exists(METADATA_FILE):
            await storage.close()
            return checkpoint_storage(url, settings)
        if await storage.exists(INDEX_FILE) and looks_like_safetensors(await storage.list_children("")):
            return SafetensorsFolder(storage)
        parent, _, name = url.rstrip("/").rpartition("/")
        if name and parent.count("/") >= 2:  # s3://bucket/.../name: maybe one object, a torch.save file
            folder = storage_from_url(parent, settings)
            try:
                if await folder.exists(name):
                    head = bytearray(4)
                    await folder.read_into(name, 0, memoryview(head))
                    if is_torch_file(bytes(head)):
                        await storage.close()
                        return torch_file_storage(url, settings)
            finally:
                await folder.close()
    return storage
