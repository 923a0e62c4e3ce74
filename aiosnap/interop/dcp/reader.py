"""``aiosnap.dcp.StorageReader``: torch.distributed.checkpoint's storage reader on aiosnap.

``dcp.load(state_dict, storage_reader=StorageReader(url))`` loads a DCP checkpoint -- one
aiosnap's writer made, or torch's ``FileSystemWriter``, or any writer built on it -- from a
local folder or ``s3://bucket/prefix``, through aiosnap's backends (ranged reads, retries,
coalescing of neighbouring items into one request):

- ``.metadata`` is read only through the allow-list unpickler (:mod:`.metadata`): a crafted
  file runs no code and is a :class:`~aiosnap.errors.CorruptCheckpointError`;
- each tensor item's raw bytes are found in its ``torch.save`` archive (:mod:`.payloads`)
  and read straight into the tensor DCP's planner gives (when it is a contiguous CPU tensor
  of the stored dtype taking the whole chunk), else into a buffer and copied, a batch of at
  most the RAM budget at a time; with aiosnap's checksums file, every payload's crc32c is
  checked first;
- a pickled value reaches DCP's planner (which ``torch.load``\\ s it with
  ``weights_only=False``) only as plain data aiosnap decoded and re-pickled itself, unless
  ``allow_pickle=True``: a value that is more than plain data is
  :class:`~aiosnap.errors.PickleNotAllowedError` otherwise.

DCP calls ``read_metadata``, ``set_up_storage_reader``, ``prepare_local_plan``,
``prepare_global_plan`` and ``read_data`` from the thread that runs ``dcp.load``; the I/O runs
on the shared loop (:mod:`.runtime`).
"""

from __future__ import annotations

import asyncio
import io
import os
import uuid
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _TorchStorageReader
from torch.futures import Future

from ...config import Config
from ...core.aio import run_all
from ...core.tensorio import bytes_view
from ...errors import CheckpointReplacedError, ConfigError, CorruptCheckpointError, PickleNotAllowedError
from ...format.manifest import ByteRange
from ...load.fetch_runs import Range, Run, plan_runs, read_run
from ...storage.base import Storage
from ..torchpickle import DeviceValue, DtypeValue, SizeValue, contiguous_strides
from .location import CheckpointLocation
from .metadata import DcpMetadata, ItemKey, parse_metadata
from .payloads import NOT_PLAIN, Payload, item_payloads
from .runtime import runtime
from .torchmeta import to_torch
from .translate import read_metadata_bytes

__all__ = ["StorageReader"]


def _python(value: Any) -> Any:
    """A decoded plain value with torch's own dtypes, sizes and devices (to re-pickle)."""
    if isinstance(value, SizeValue):
        return torch.Size(value.items)
    if isinstance(value, DtypeValue):
        return getattr(torch, value.name)
    if isinstance(value, DeviceValue):
        return torch.device(value.name)
    if type(value) in (list, tuple):
        return type(value)(_python(v) for v in value)
    if type(value) in (dict, OrderedDict):
        found = type(value)((_python(k), _python(v)) for k, v in value.items())
        if getattr(value, "_metadata", None) is not None:
            found._metadata = _python(value._metadata)
        return found
    return value


@dataclass
class _Job:
    """One read: bytes ``[start, start + nbytes)`` of the payload into ``dest`` -- the
    target's own memory, or (``view`` given: the box as shape, strides and element offset
    in ``dest``, or the stored strided view and then the box) a buffer copied from."""

    request: ReadItem
    payload: Payload
    start: int
    nbytes: int
    dest: memoryview
    target: torch.Tensor
    dtype: torch.dtype
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None = None


class StorageReader(CheckpointLocation, _TorchStorageReader):
    """A DCP storage reader for ``url`` (a folder path, ``file://`` or ``s3://bucket/prefix``).

    ``config``: an :class:`aiosnap.Config` (or a dict of its fields) for the RAM budget,
    read concurrency and S3 settings. ``allow_pickle``: hand DCP values that are more than
    plain data (see the module). ``storage``: a backend to read through instead of the one
    ``url`` names.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        config: Config | dict[str, Any] | None = None,
        *,
        allow_pickle: bool = False,
        storage: Storage | None = None,
    ) -> None:
        CheckpointLocation.__init__(self, url, config, storage)
        self.allow_pickle = allow_pickle
        self.load_id = str(uuid.uuid4())
        self._meta: DcpMetadata | None = None
        self._payloads: dict[ItemKey, Payload] = {}
        self._metadata_bytes: bytes | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._point_at(checkpoint_id)
        self.load_id = str(uuid.uuid4())
        self._meta, self._payloads, self._metadata_bytes = None, {}, None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ConfigError("aiosnap.dcp.StorageReader: per-rank metadata (use_collectives=False) is not supported")
        storage = self.storage
        where = f"{storage.url}/.metadata"

        async def read() -> tuple[bytes, DcpMetadata, dict[ItemKey, Payload]]:
            data = await read_metadata_bytes(storage, storage.url)
            meta = parse_metadata(data, where)
            return data, meta, await item_payloads(storage, meta, where, concurrency=self.config.upload.concurrency)

        self._metadata_bytes, self._meta, self._payloads = runtime().run(read())
        metadata = to_torch(self._meta)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._meta is None:  # DCP may hand metadata read by another reader instance
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._meta is None:
            self.read_metadata()
        budget = self.config.ram_budget_bytes()
        batch: list[_Job] = []
        held = 0
        for request in plan.items:
            if request.type == LoadItemType.BYTE_IO:
                self._load_value(request, planner)
                continue
            job = self._job(request, planner)
            size = 0 if job.view is None else job.nbytes
            if batch and held + size > budget:
                self._run(batch, planner)
                batch, held = [], 0
            batch.append(job)
            held += size
        if batch:
            self._run(batch, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    # -- values ---------------------------------------------------------------------

    def _key(self, index: MetadataIndex) -> ItemKey:
        return index.fqn, None if index.offset is None else tuple(index.offset)

    def _load_value(self, request: ReadItem, planner: LoadPlanner) -> None:
        payload = self._payloads[self._key(request.storage_index)]
        if payload.value is NOT_PLAIN:
            if not self.allow_pickle:
                raise PickleNotAllowedError(
                    f"{self.url}: {request.storage_index.fqn!r} is a pickled object aiosnap does not decode as "
                    f"plain data ({payload.why[:300] or 'more than plain data'}); loading it can execute arbitrary "
                    "code: pass StorageReader(..., allow_pickle=True) only if you trust this checkpoint"
                )
            loc = self._located(request.storage_index)
            data = self._read_whole(loc[0], loc[1], loc[2], payload.item_crc32c)
        else:
            buffer = io.BytesIO()
            torch.save(_python(payload.value), buffer)
            data = buffer.getvalue()
        planner.load_bytes(request, io.BytesIO(data))

    def _located(self, index: MetadataIndex) -> tuple[str, int, int]:
        assert self._meta is not None
        loc = self._meta.locations[self._key(index)]
        return loc.relative_path, loc.offset, loc.length

    def _read_whole(self, file: str, offset: int, nbytes: int, crc: int | None) -> bytes:
        buffer = bytearray(nbytes)
        where = ByteRange.model_construct(object=file, offset=offset, nbytes=nbytes, crc32c=crc)
        run = plan_runs([Range(file, where, memoryview(buffer))])[0]
        self._read(read_run(self.storage, self.url, run))
        return bytes(buffer)

    def _read(self, reads: Coroutine[Any, Any, None]) -> None:
        """Run ``reads`` of data files; a file missing, short or damaged while ``.metadata``
        is no longer the one this load read is CheckpointReplacedError (an overwrite
        committed and removed the files of the version being read)."""
        try:
            runtime().run(reads)
        except (CorruptCheckpointError, FileNotFoundError) as exc:
            try:
                now: bytes | None = runtime().run(read_metadata_bytes(self.storage, self.storage.url))
            except Exception:
                now = None
            if now is not None and now != self._metadata_bytes:
                raise CheckpointReplacedError(
                    f"{self.url}: the checkpoint was replaced (a new save committed) while it was being loaded; "
                    "load again"
                ) from exc
            raise

    # -- tensors --------------------------------------------------------------------

    def _job(self, request: ReadItem, planner: LoadPlanner) -> _Job:
        """What to read for one tensor request, and where it goes."""
        assert self._meta is not None
        key = self._key(request.storage_index)
        payload = self._payloads[key]
        target = planner.resolve_tensor(request).detach()
        item = self._meta.items[key[0]]
        dtype = getattr(torch, item.dtype)  # type: ignore[union-attr]
        itemsize = dtype.itemsize
        chunk = next(c for c in item.chunks if c.offsets == key[1])  # type: ignore[union-attr]
        box_start, box_shape = tuple(request.storage_offsets), tuple(request.lengths)
        if not payload.contiguous:  # a strided view, as stored: the whole storage, then its view of it
            ref = payload.tensor
            assert ref is not None
            view = (ref.shape, ref.stride, ref.offset)
            return _Job(request, payload, 0, payload.nbytes, memoryview(bytearray(payload.nbytes)), target, dtype, view)
        strides = contiguous_strides(chunk.sizes)
        first = sum(o * s for o, s in zip(box_start, strides, strict=True))
        whole = box_start == (0,) * len(chunk.sizes) and box_shape == chunk.sizes
        if payload.crc32c is not None or whole:  # a checked payload is read whole (its crc32c covers all of it)
            start, nbytes, offset = 0, payload.nbytes, first
        else:
            last = (
                first + sum((n - 1) * s for n, s in zip(box_shape, strides, strict=True)) if all(box_shape) else first
            )
            start, nbytes, offset = first * itemsize, (last - first + 1) * itemsize, 0
        direct = whole and target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype
        if direct and not target.is_conj() and not target.is_neg():
            return _Job(request, payload, 0, payload.nbytes, bytes_view(target), target, dtype)
        view = (box_shape, strides, offset)
        return _Job(request, payload, start, nbytes, memoryview(bytearray(nbytes)), target, dtype, view)

    def _run(self, jobs: list[_Job], planner: LoadPlanner) -> None:
        """Read a batch (neighbouring ranges with one request, each checked), then copy
        what did not land in place and tell the planner."""
        ranges = []
        for job in jobs:
            if job.nbytes == 0:
                continue
            crc = job.payload.crc32c if job.start == 0 and job.nbytes == job.payload.nbytes else None
            where = ByteRange.model_construct(
                object=job.payload.file, offset=job.payload.offset + job.start, nbytes=job.nbytes, crc32c=crc
            )
            ranges.append(Range(job.request.storage_index.fqn, where, job.dest))
        runs = plan_runs(ranges)
        storage = self.storage
        gate_size = self.config.upload.concurrency

        async def read_all() -> None:
            gate = asyncio.Semaphore(gate_size)

            async def one(run: Run) -> None:
                async with gate:
                    await read_run(storage, self.url, run)

            await run_all(one(run) for run in runs)

        self._read(read_all())
        for job in jobs:
            if job.view is not None:
                shape, strides, offset = job.view
                source = torch.frombuffer(job.dest, dtype=job.dtype) if job.nbytes else torch.empty(0, dtype=job.dtype)
                source = source.as_strided(shape, strides, offset)
                if not job.payload.contiguous:  # the stored view of the whole chunk: now the box of it
                    for dim, (start, length) in enumerate(
                        zip(job.request.storage_offsets, job.request.lengths, strict=True)
                    ):
                        source = source.narrow(dim, start, length)
                with torch.no_grad():
                    job.target.copy_(source)
            planner.commit_tensor(job.request, job.target)
