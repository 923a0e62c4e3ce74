"""An export into one ``torch.save`` file (``torch.load`` reads it, ``weights_only=True``
too, with no aiosnap installed).

The file is laid out as ``torch.save`` writes one: a zip of stored records, each tensor's
bytes a record ``archive/data/<n>`` (64-byte aligned), then ``data.pkl`` -- the selection's
tree as plain Python values with every tensor rebuilt from its record by
``torch._utils._rebuild_tensor_v2``, pickled as ``torch.save`` pickles (protocol 2; the same
tensor twice is one storage) -- the small records and the zip directory. Pieces are written
at their offsets into a partial file beside the destination, which is fsynced and put in
place only if nothing is there (a crash leaves the partial file, never half a checkpoint at
the name). An ``s3://`` destination is assembled in a local file first -- in ``spool.dir``
within ``spool.budget`` when there is one, else in the system's temporary directory, within
its free space (a :class:`~aiosnap.errors.ConfigError` past either), unlinked as soon as it
is open so that a killed export leaves nothing -- then uploaded (multipart, streamed from
the file) only if nothing is at the destination (``If-None-Match: *``; a
:class:`FileExistsError` otherwise).
"""

from __future__ import annotations

import asyncio
import io
import os
import pickle
import secrets
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, cast

import torch

from ...config import Config
from ...core.durable import fsync_dir, publish_if_absent
from ...errors import ConfigError
from ...format.archive import Record, local_header, zip_directory
from ...handoff.spooldir import spool_budget_bytes
from ...load.decode import torch_dtype
from ...storage.base import Storage
from ...storage.registry import storage_from_url
from ..torchpickle import contiguous_strides
from .copier import DestObject, Piece, Slice
from .selection import Selection

__all__ = ["TorchSink"]

_ARCHIVE = "archive"
_LEGACY = torch.storage._dtype_to_storage_type_map()


class _Storage:
    __slots__ = ("dtype", "key", "numel")

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    """Stands for entry ``key`` in the decoded tree, pickled as torch.save pickles a tensor."""

    __slots__ = ("dtype", "key", "shape")

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.key, self.dtype, self.shape = key, dtype, shape


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _Tensor):
            stride = contiguous_strides(obj.shape)
            numel = 1
            for size in obj.shape:
                numel *= size
            if _LEGACY.get(obj.dtype) is None:
                storage = _Storage(obj.key, obj.dtype, numel * obj.dtype.itemsize)
                return torch._utils._rebuild_tensor_v3, (storage, 0, obj.shape, stride, False, OrderedDict(), obj.dtype)
            return torch._utils._rebuild_tensor_v2, (
                _Storage(obj.key, obj.dtype, numel),
                0,
                obj.shape,
                stride,
                False,
                OrderedDict(),
            )
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            legacy = _LEGACY.get(obj.dtype)
            kind = torch.UntypedStorage if legacy is None else getattr(torch, legacy)
            return ("storage", kind, obj.key, "cpu", obj.numel)
        return None


def _pickle(selection: Selection, allow_pickle: bool, where: str) -> bytes:
    stubs = {
        i: _Tensor(str(i), torch_dtype(e.dtype), tuple(e.shape)) for i, e in enumerate(selection.entries)
        if e.kind != "pickle"
    }  # fmt: skip
    decoder = selection.decoder(lambda index: cast(torch.Tensor, stubs[index]), allow_pickle, where)
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(decoder(selection.tree))
    return buffer.getvalue()


class TorchSink:
    """One ``torch.save`` file at ``url`` (see the module)."""

    def __init__(self, url: str, storage_config: Config, allow_pickle: bool) -> None:
        self.url = url
        self.config = storage_config
        self.allow_pickle = allow_pickle
        self.remote = "://" in url and not url.startswith("file://")
        self.path = Path(url).expanduser().absolute() if not self.remote else None
        self._fd: int | None = None
        self._partial: Path | None = None

    async def layout(self, selection: Selection, object_bytes: int) -> list[DestObject]:
        if self.path is not None and self.path.exists():
            raise FileExistsError(f"{self.url} exists; not replacing it (export elsewhere)")
        obj = DestObject(self.url)
        records: list[Record] = []
        position = 0
        for index, entry in enumerate(selection.entries):
            if entry.kind == "pickle":
                continue  # unpickled into data.pkl
            name = f"{_ARCHIVE}/data/{index}"
            header = local_header(name, entry.nbytes, position)
            records.append(Record(name, position, entry.nbytes))
            obj.segments += [header, Slice(index, 0, entry.nbytes)] if entry.nbytes else [header]
            position += len(header) + entry.nbytes
        small = [
            ("data.pkl", _pickle(selection, self.allow_pickle, self.url)),
            (".format_version", b"1"),
            (".storage_alignment", b"64"),
            ("byteorder", b"little"),
            ("version", b"3\n"),
        ]
        for short, data in small:
            name = f"{_ARCHIVE}/{short}"
            header = local_header(name, len(data), position)
            records.append(Record(name, position, len(data)))
            obj.segments += [header, data]
            position += len(header) + len(data)
        directory = zip_directory(records, position)
        obj.segments.append(directory)
        self._open(position + len(directory))
        return [obj]

    def _open(self, size: int) -> None:
        if self.path is not None:
            self._partial = self.path.with_name(f".{self.path.name}.aiosnap-export-{secrets.token_hex(8)}.partial")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self._partial, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o644)
            return
        folder = self._staging_folder(size)
        fd, name = tempfile.mkstemp(prefix="aiosnap-export-", suffix=".pt", dir=folder)
        self._fd, self._partial = fd, Path(name)
        if os.path.exists(f"/proc/self/fd/{fd}"):  # Linux: the open file needs no name
            os.remove(name)
            self._partial = Path(f"/proc/self/fd/{fd}")

    def _staging_folder(self, size: int) -> Path:
        """Where the ``size``-byte file of an ``s3://`` export is assembled (see the module)."""
        if self.config.spool.dir is not None:
            folder = Path(self.config.spool.dir).expanduser()
            folder.mkdir(parents=True, exist_ok=True)
            room, what = spool_budget_bytes(self.config.spool, folder), f"spool.budget in spool.dir {folder}"
        else:
            folder = Path(tempfile.gettempdir())
            room, what = shutil.disk_usage(folder).free, f"the free space of {folder} (set spool.dir)"
        if size > room:
            raise ConfigError(
                f"export to {self.url}: the file is assembled on local disk before its upload; "
                f"its {size} bytes exceed {what} ({room} bytes)"
            )
        return folder

    def _pwrite(self, data: memoryview, offset: int) -> None:
        assert self._fd is not None
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], offset + done)

    async def put(self, piece: Piece) -> None:
        await asyncio.to_thread(self._pwrite, piece.data, piece.offset)

    async def commit(self) -> None:
        assert self._fd is not None
        assert self._partial is not None
        if self.path is not None:
            await asyncio.to_thread(os.fsync, self._fd)
            self._close()
            await asyncio.to_thread(publish_if_absent, self._partial, self.path)
            await asyncio.to_thread(fsync_dir, self.path.parent)
            return
        parent, _, name = self.url.rstrip("/").rpartition("/")
        storage: Storage = storage_from_url(parent, self.config)
        try:
            if await storage.exists(name):  # the early answer; the upload's condition is the real one
                raise FileExistsError(f"{self.url} exists; not replacing it (export elsewhere)")
            try:
                await storage.write_file(name, str(self._partial), if_absent=True)
            except FileExistsError as exc:
                raise FileExistsError(f"{self.url}: appeared during the export; not replacing it") from exc
        finally:
            await storage.close()
            self._close()

    def _close(self) -> None:
        """Close the partial file; an unnamed one (``/proc/self/fd``) goes with it."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._partial is not None and self.path is None and not str(self._partial).startswith("/proc/"):
            self._partial.unlink(missing_ok=True)

    async def abort(self) -> None:
        self._close()
        if self.path is not None and self._partial is not None:
            self._partial.unlink(missing_ok=True)
