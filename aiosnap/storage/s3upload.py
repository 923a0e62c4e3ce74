"""Uploads to S3 (:mod:`aiosnap.storage.s3`): PUTs, multipart uploads whose parts go
concurrently, and the parts of an object written in parts by several callers.

:class:`S3Uploader` sends each PUT or part with its CRC32C for the server to check (the
only checksum of the body: no SHA-256 payload signing, ``UNSIGNED-PAYLOAD``), through one
of ``s3.max_requests`` slots given out in the order the uploads began (a heartbeat or a
verdict, in the control lane, takes none). Objects above ``s3.multipart_threshold`` go as
multipart uploads; a failed one is aborted. A staging slab goes to aiohttp as a memoryview
of the arena (written to the socket whole, no copy in Python); a spooled file is mapped
and streams from the page cache. Runs on the loop thread of whoever owns the storage;
checksums of large bodies are computed on worker threads.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import mmap
import os
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any

from ..config import S3Config
from ..core.checksums import ALIGN, RangeChecksums, crc32c_b64, crc32c_combine, crc32c_of
from ..core.progress import report_sent
from ..errors import StorageError, first_error
from .base import PartRecord, check_spool_file, in_control_lane
from .s3session import ClientError, S3Session, error_code

__all__ = ["MIN_PART", "FileSource", "MemorySource", "OrderedSlots", "S3Uploader", "part_size_for"]

# slab bodies go to aiohttp as memoryviews, which it writes to the socket without blocking
# the loop (the event loop queues what the socket does not take at once); its hint to use a
# file object instead is about a copy we want to avoid
warnings.filterwarnings("ignore", "Sending a large body directly with raw bytes", ResourceWarning)

log = logging.getLogger("aiosnap")

MIN_PART = 5 * 1024 * 1024
_INLINE_CRC_BYTES = 64 * 1024
MAX_PARTS = 10_000


def part_size_for(size: int, wanted: int) -> int:
    """A part size within S3's limits: at least 5 MiB and at most 10,000 parts; a multiple
    of the checksum grid (1 MiB) when more than ``wanted`` is needed."""
    if wanted >= MIN_PART and wanted * MAX_PARTS >= size:
        return wanted
    return max(MIN_PART, math.ceil(size / MAX_PARTS / ALIGN) * ALIGN)


class OrderedSlots:
    """A semaphore whose waiters get a slot in ``priority`` order, lowest first (loop thread)."""

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._waiting: list[tuple[tuple[int, int], int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @asynccontextmanager
    async def slot(self, priority: tuple[int, int]) -> AsyncIterator[None]:
        await self._acquire(priority)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, priority: tuple[int, int]) -> None:
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._arrivals), granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._release()  # the slot came with the cancellation: pass it on
            raise

    def _release(self) -> None:
        while self._waiting:
            _, _, granted = heapq.heappop(self._waiting)
            if not granted.done():
                granted.set_result(None)
                return
        self._free += 1


class MemorySource:
    """Upload source: a buffer in RAM (a staging slab), sent as a memoryview of it: aiohttp
    writes it to the socket in one call, with no copy in Python. Its CRC32Cs come from
    ``checksums`` (computed once by the caller) or are computed here."""

    def __init__(self, view: memoryview, checksums: RangeChecksums | None) -> None:
        self.view = view
        self.size = view.nbytes
        self.checksums = checksums

    @contextmanager
    def body(self, start: int, end: int) -> Iterator[memoryview]:
        yield self.view[start:end]

    def checksum(self, start: int, end: int) -> int:
        if self.checksums is not None:
            return self.checksums.of(start, end)
        return crc32c_of(self.view[start:end])


class FileSource:
    """Upload source: a local file (a spooled chunk, at most a slab), mapped read-only and
    sent as memoryviews of the mapping: no read() copies, pages come from the page cache.
    Opened on a worker thread; :meth:`close` when the upload is over."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            self._map = mmap.mmap(f.fileno(), self.size, access=mmap.ACCESS_READ) if self.size else None
        self.view = memoryview(self._map) if self._map is not None else memoryview(b"")

    @contextmanager
    def body(self, start: int, end: int) -> Iterator[memoryview]:
        yield self.view[start:end]

    def checksum(self, start: int, end: int) -> int:
        return crc32c_of(self.view[start:end])

    def close(self) -> None:
        self.view.release()
        if self._map is not None:
            with suppress(BufferError):  # a closing connection still holds a slice:
                self._map.close()  # unmapped when that is collected


Source = MemorySource | FileSource


class S3Uploader:
    """The uploads of one S3 storage to ``bucket`` (``url``: how errors name it), its
    requests made through ``session``; ``key_of`` maps an object's name to its key."""

    def __init__(
        self, url: str, bucket: str, config: S3Config, session: S3Session, key_of: Callable[[str], str]
    ) -> None:
        self.url = url
        self.bucket = bucket
        self.config = config
        self.session = session
        self.key_of = key_of
        self.slots: OrderedSlots | None = None
        self._uploads = itertools.count()

    async def upload_file(
        self, name: str, path: str, expected: tuple[str, int] | None, conditions: dict[str, str] | None = None
    ) -> None:
        source = await asyncio.to_thread(FileSource, path)
        try:
            await self.upload(name, source, conditions or {}, expected=expected)
        finally:
            source.close()

    async def _send(
        self, what: str, order: int, source: Source, start: int, end: int, crc: int | None = None, **request: Any
    ) -> tuple[Any, int]:
        """One PUT or part upload of ``source[start:end]`` with its CRC32C (``crc`` when
        known; returned with the response); a fresh body view per attempt. Waits for one of
        the ``s3.max_requests`` slots, the upload begun first (``order``) served first."""
        if crc is None:
            crc = await asyncio.to_thread(source.checksum, start, end)
        checksum = crc32c_b64(crc)
        if in_control_lane():  # a heartbeat or verdict: never queued behind data parts
            return await self._request(what, source, start, end, checksum, request), crc
        if self.slots is None:
            self.slots = OrderedSlots(self.config.max_requests)
        async with self.slots.slot((order, start)):
            response = await self._request(what, source, start, end, checksum, request)
        report_sent(end - start)  # (progress of the write: once per request that succeeded)
        return response, crc

    async def _request(
        self, what: str, source: Source, start: int, end: int, checksum: str, request: dict[str, Any]
    ) -> Any:

        async def send(client: Any) -> Any:
            with source.body(start, end) as body:
                method = client.upload_part if "UploadId" in request else client.put_object
                return await method(
                    Bucket=self.bucket, Body=body, ContentLength=end - start, ChecksumCRC32C=checksum, **request
                )

        return await self.session.call(what, send)

    async def upload(
        self,
        name: str,
        source: Source,
        conditions: dict[str, str],
        *,
        expected: tuple[str, int] | None = None,
    ) -> None:
        """Upload ``source`` as ``name``; with ``expected`` (path, crc), refuse to let the
        object appear unless the bytes sent have that CRC32C."""
        key = self.key_of(name)
        order = next(self._uploads)
        if source.size <= self.config.multipart_threshold:
            small = in_control_lane() and source.size <= _INLINE_CRC_BYTES  # not behind the data's checksums
            crc = source.checksum(0, source.size) if small else await asyncio.to_thread(source.checksum, 0, source.size)
            if expected is not None:
                check_spool_file(expected[0], crc, expected[1], name)
            await self._send(f"PUT {name}", order, source, 0, source.size, crc, Key=key, **conditions)
        else:
            await self._multipart(name, key, order, source, conditions, expected)

    async def _multipart(
        self,
        name: str,
        key: str,
        order: int,
        source: Source,
        conditions: dict[str, str],
        expected: tuple[str, int] | None,
    ) -> None:
        size = source.size
        part = part_size_for(size, self.config.part_size)
        created = await self.session.call(
            f"create multipart upload of {name}",
            lambda c: c.create_multipart_upload(Bucket=self.bucket, Key=key, ChecksumAlgorithm="CRC32C"),
        )
        upload_id = created["UploadId"]
        limit = asyncio.Semaphore(self.config.part_concurrency)

        async def upload_part(number: int, start: int) -> dict[str, Any]:
            async with limit:
                response, crc = await self._send(
                    f"part {number} of {name}", order, source, start, min(start + part, size),
                    Key=key, UploadId=upload_id, PartNumber=number,
                )  # fmt: skip
            return {"PartNumber": number, "ETag": response["ETag"], "ChecksumCRC32C": crc32c_b64(crc), "crc": crc}

        try:
            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [
                        group.create_task(upload_part(number, start))
                        for number, start in enumerate(range(0, size, part), start=1)
                    ]
            except BaseExceptionGroup as group_error:
                raise (leaf := first_error(group_error)) from leaf.__cause__
            parts = [t.result() for t in tasks]
            if expected is not None:
                whole = 0
                for number, start in enumerate(range(0, size, part)):
                    whole = crc32c_combine(whole, parts[number]["crc"], min(part, size - start))
                check_spool_file(expected[0], whole, expected[1], name)
            for p in parts:
                del p["crc"]
            await self.session.call(
                f"complete multipart upload of {name}",
                lambda c: c.complete_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}, **conditions
                ),
            )
        except BaseException:
            await asyncio.shield(self.abort(name, key, upload_id))
            raise

    async def abort(self, name: str, key: str, upload_id: str) -> None:
        """Abort the multipart upload ``upload_id`` of ``name`` after a failure, which stays
        the one the caller sees (an abort that fails is only logged)."""
        try:
            await self.abort_upload(f"abort multipart upload of {name}", key, upload_id,
                                     deadline=min(30.0, self.config.retry_deadline))  # fmt: skip
        except Exception as exc:  # the original failure is what the caller must see
            log.warning("aiosnap: %s: could not abort the multipart upload of %s: %r", self.url, name, exc)

    async def abort_upload(self, what: str, key: str, upload_id: str, deadline: float | None = None) -> None:
        """Abort one multipart upload; one already gone (``NoSuchUpload``: completed, or an
        earlier attempt of this abort landed before its answer was lost) is success."""
        try:
            await self.session.call(
                what, lambda c: c.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id),
                deadline=deadline,
            )  # fmt: skip
        except StorageError as exc:
            if not isinstance(exc.__cause__, ClientError) or error_code(exc.__cause__) != "NoSuchUpload":
                raise

    # -- an object written in parts: one multipart upload, completed by whoever holds its id

    async def start_upload(self, name: str) -> str:
        """Begin a multipart upload of ``name``; its id."""
        key = self.key_of(name)
        created = await self.session.call(
            f"create multipart upload of {name}",
            lambda c: c.create_multipart_upload(Bucket=self.bucket, Key=key, ChecksumAlgorithm="CRC32C"),
        )
        return str(created["UploadId"])

    async def upload_part(self, name: str, token: str, number: int, offset: int, data: memoryview) -> PartRecord:
        response, crc = await self._send(
            f"part {number} of {name}", 0, MemorySource(memoryview(data).cast("B"), None), 0, len(data),
            Key=self.key_of(name), UploadId=token, PartNumber=number,
        )  # fmt: skip
        return {"PartNumber": number, "ETag": response["ETag"], "ChecksumCRC32C": crc32c_b64(crc)}

    async def complete_upload(self, name: str, token: str, parts: list[PartRecord]) -> None:
        """Complete the multipart upload ``token`` of ``name`` from its parts, in any order."""
        key = self.key_of(name)
        ordered = sorted(({k: p[k] for k in ("PartNumber", "ETag", "ChecksumCRC32C")} for p in parts),
                         key=lambda p: int(p["PartNumber"]))  # fmt: skip
        await self.session.call(
            f"complete multipart upload of {name}",
            lambda c: c.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=token, MultipartUpload={"Parts": ordered}
            ),
        )
