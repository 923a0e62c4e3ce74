"""S3 and S3-compatible storage through aiobotocore (imported only for ``s3://`` URLs).

Runs on aiosnap's background loop thread. One long-lived client per storage, its
connection pool sized to ``s3.max_requests + upload.concurrency``. botocore's own
retries are off: every request goes through :meth:`S3Storage._call`, which bounds each
attempt by ``s3.request_timeout`` (a stalled body never hangs) and retries throttling,
5xx, connection resets and timeouts with exponential backoff and full jitter until
``s3.retry_deadline``, then raises :class:`~aiosnap.errors.StorageUnavailableError`
chained to the last botocore/aiohttp error. Reads resume where a broken body stopped.

Objects above ``s3.multipart_threshold`` are uploaded as multipart uploads whose parts go
concurrently; a failed multipart upload is aborted. A staging slab goes to aiohttp as a
memoryview of the arena (written to the socket whole, no copy in Python); a spooled file
streams from disk. Each PUT and part carries its CRC32C for the server to check, and that
CRC is the only checksum of the body (no SHA-256 payload signing: ``UNSIGNED-PAYLOAD``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import mmap
import os
import random
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager, suppress
from typing import Any, TypeVar

try:
    import aiobotocore.session
    import aiohttp
    from aiobotocore.config import AioConfig
    from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, ResponseStreamingError
    from botocore.exceptions import ConnectionError as BotoConnectionError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("s3:// storage needs aiobotocore: pip install 'aiosnap[s3]'") from exc

from ..config import S3Config
from ..core.checksums import ALIGN, RangeChecksums, crc32c_b64, crc32c_combine, crc32c_of
from ..core.names import check_object_name
from ..core.progress import report_sent
from ..errors import StorageError, StorageUnavailableError, first_error
from .base import BytesLike, ObjectInfo, PartRecord, ScatterTarget, Storage, check_spool_file, in_control_lane

__all__ = ["S3Storage"]

# slab bodies go to aiohttp as memoryviews, which it writes to the socket without blocking
# the loop (the event loop queues what the socket does not take at once); its hint to use a
# file object instead is about a copy we want to avoid
warnings.filterwarnings("ignore", "Sending a large body directly with raw bytes", ResourceWarning)

log = logging.getLogger("aiosnap")
T = TypeVar("T")

MIN_PART = 5 * 1024 * 1024
_INLINE_CRC_BYTES = 64 * 1024
MAX_PARTS = 10_000
BACKOFF_BASE = 0.1
BACKOFF_CAP = 5.0
RETRYABLE_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
}  # fmt: skip
RETRYABLE_ERRORS = (
    HTTPClientError, BotoConnectionError, ResponseStreamingError, aiohttp.ClientError, TimeoutError, ConnectionError,
)  # fmt: skip


def part_size_for(size: int, wanted: int) -> int:
    """A part size within S3's limits: at least 5 MiB and at most 10,000 parts; a multiple
    of the checksum grid (1 MiB) when more than ``wanted`` is needed."""
    if wanted >= MIN_PART and wanted * MAX_PARTS >= size:
        return wanted
    return max(MIN_PART, math.ceil(size / MAX_PARTS / ALIGN) * ALIGN)


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def is_retryable(exc: BaseException) -> bool:
    """Throttling, 5xx, resets and timeouts are worth another attempt."""
    if isinstance(exc, ClientError):
        return _code(exc) in RETRYABLE_CODES or _status(exc) >= 500 or _status(exc) == 429
    return isinstance(exc, RETRYABLE_ERRORS)


class _OrderedSlots:
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


class _MemorySource:
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


class _FileSource:
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


_Source = _MemorySource | _FileSource


class S3Storage(Storage):
    """Objects live under ``s3://bucket/prefix/``; names map to keys below the prefix."""

    def __init__(self, bucket: str, prefix: str, config: S3Config, *, concurrency: int = 8) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.config = config
        self.concurrency = concurrency
        self.conditional_writes = config.conditional_commit
        self._client: Any = None
        self._stack: AsyncExitStack | None = None
        self._lock: asyncio.Lock | None = None
        self._slots: _OrderedSlots | None = None
        self._uploads = itertools.count()

    def __getstate__(self) -> dict[str, Any]:
        """Its settings only: an upload process rebuilds it, with a client of its own."""
        return {"bucket": self.bucket, "prefix": self.prefix, "config": self.config, "concurrency": self.concurrency}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["bucket"], state["prefix"], state["config"], concurrency=state["concurrency"])  # type: ignore[misc]

    # -- plumbing -------------------------------------------------------------------------

    async def _get_client(self) -> Any:
        if self._client is not None:
            return self._client
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if self._client is None:
                cfg = self.config
                session = aiobotocore.session.AioSession(profile=cfg.profile)
                aio_config = AioConfig(
                    # every body carries a CRC32C the server checks: no SHA-256 of it too
                    s3={"addressing_style": cfg.addressing_style, "payload_signing_enabled": False},
                    # botocore's check refuses memoryview bodies (aiohttp takes them whole)
                    parameter_validation=False,
                    max_pool_connections=cfg.max_requests + self.concurrency + 4,
                    retries={"total_max_attempts": 1},  # retries are ours (deadline-bounded)
                    connect_timeout=min(10.0, cfg.request_timeout),
                    read_timeout=cfg.request_timeout,
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                kwargs: dict[str, Any] = {"config": aio_config}
                if cfg.endpoint_url:
                    kwargs["endpoint_url"] = cfg.endpoint_url
                if cfg.region:
                    kwargs["region_name"] = cfg.region
                if cfg.access_key_id is not None and cfg.secret_access_key is not None:
                    kwargs["aws_access_key_id"] = cfg.access_key_id.get_secret_value()
                    kwargs["aws_secret_access_key"] = cfg.secret_access_key.get_secret_value()
                    if cfg.session_token is not None:
                        kwargs["aws_session_token"] = cfg.session_token.get_secret_value()
                stack = AsyncExitStack()
                self._client = await stack.enter_async_context(session.create_client("s3", **kwargs))
                self._stack = stack
        return self._client

    async def connect(self) -> None:
        await self._get_client()  # ~0.3 s: botocore loads and parses the S3 service model

    def _key(self, name: str) -> str:
        name = check_object_name(name.rstrip("/")) if name else ""
        return f"{self.prefix}/{name}" if self.prefix and name else (self.prefix or name)

    async def _call(self, what: str, request: Callable[[Any], Awaitable[T]], *, deadline: float | None = None) -> T:
        """Run ``request(client)`` with a per-attempt timeout and deadline-bounded retries."""
        client = await self._get_client()
        loop = asyncio.get_running_loop()
        budget = self.config.retry_deadline if deadline is None else deadline
        give_up = loop.time() + budget
        attempt = 0
        while True:
            attempt += 1
            try:
                async with asyncio.timeout(self.config.request_timeout):
                    return await request(client)
            except Exception as exc:
                if not is_retryable(exc):
                    raise self._translate(exc, what) from exc
                remaining = give_up - loop.time()
                if remaining <= 0:
                    raise StorageUnavailableError(
                        f"{self.url}: {what} failed {attempt} time(s) within the {budget:g} s retry deadline; "
                        f"last error: {type(exc).__name__}: {exc}"
                    ) from exc
                delay = min(remaining, random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2**attempt)))  # noqa: S311
                log.debug("aiosnap: %s: %s: %s; retry %d in %.2f s", self.url, what, type(exc).__name__, attempt, delay)
                await asyncio.sleep(delay)

    def _translate(self, exc: Exception, what: str) -> Exception:
        if isinstance(exc, ClientError):
            status, code = _status(exc), _code(exc)
            if code not in ("NoSuchBucket", "NoSuchUpload") and (status == 404 or code in ("NoSuchKey", "NotFound")):
                return FileNotFoundError(f"{self.url}: {what}: no such object")
            if status == 412 or code == "PreconditionFailed":
                return FileExistsError(f"{self.url}: {what}: the object already exists")
            message = exc.response.get("Error", {}).get("Message", "")
            return StorageError(f"{self.url}: {what}: {code or status}: {message}")
        if isinstance(exc, BotoCoreError):  # no credentials, a bad endpoint, ...: not worth a retry
            return StorageError(f"{self.url}: {what}: {type(exc).__name__}: {exc}")
        return exc

    # -- the protocol ---------------------------------------------------------------------

    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        await self._upload(name, _MemorySource(memoryview(data).cast("B"), None), self._absent(if_absent))

    def _absent(self, if_absent: bool) -> dict[str, str]:
        """The request conditions of an ``if_absent`` write (none where the server is said
        to lack conditional writes: ``s3.conditional_commit``)."""
        return {"IfNoneMatch": "*"} if if_absent and self.config.conditional_commit else {}

    async def write_checksummed(self, name: str, data: memoryview, checksums: RangeChecksums) -> None:
        await self._upload(name, _MemorySource(data, checksums), {})

    async def write_file(self, name: str, path: str, *, if_absent: bool = False) -> None:
        await self._upload_file(name, path, None, self._absent(if_absent))

    async def write_file_verified(self, name: str, path: str, crc: int) -> None:
        # the CRC32Cs of the PUT or parts are computed anyway: combined, they check the file
        # before the object can appear (before the PUT, or before completing the upload)
        await self._upload_file(name, path, (path, crc))

    async def _upload_file(
        self, name: str, path: str, expected: tuple[str, int] | None, conditions: dict[str, str] | None = None
    ) -> None:
        source = await asyncio.to_thread(_FileSource, path)
        try:
            await self._upload(name, source, conditions or {}, expected=expected)
        finally:
            source.close()

    async def _send(
        self, what: str, order: int, source: _Source, start: int, end: int, crc: int | None = None, **request: Any
    ) -> tuple[Any, int]:
        """One PUT or part upload of ``source[start:end]`` with its CRC32C (``crc`` when
        known; returned with the response); a fresh body view per attempt. Waits for one of
        the ``s3.max_requests`` slots, the upload begun first (``order``) served first."""
        if crc is None:
            crc = await asyncio.to_thread(source.checksum, start, end)
        checksum = crc32c_b64(crc)
        if in_control_lane():  # a heartbeat or verdict: never queued behind data parts
            return await self._request(what, source, start, end, checksum, request), crc
        if self._slots is None:
            self._slots = _OrderedSlots(self.config.max_requests)
        async with self._slots.slot((order, start)):
            response = await self._request(what, source, start, end, checksum, request)
        report_sent(end - start)  # (progress of the write: once per request that succeeded)
        return response, crc

    async def _request(
        self, what: str, source: _Source, start: int, end: int, checksum: str, request: dict[str, Any]
    ) -> Any:

        async def send(client: Any) -> Any:
            with source.body(start, end) as body:
                method = client.upload_part if "UploadId" in request else client.put_object
                return await method(
                    Bucket=self.bucket, Body=body, ContentLength=end - start, ChecksumCRC32C=checksum, **request
                )

        return await self._call(what, send)

    async def _upload(
        self, name: str, source: _Source, conditions: dict[str, str], *, expected: tuple[str, int] | None = None
    ) -> None:
        """Upload ``source`` as ``name``; with ``expected`` (path, crc), refuse to let the
        object appear unless the bytes sent have that CRC32C."""
        key = self._key(name)
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
        source: _Source,
        conditions: dict[str, str],
        expected: tuple[str, int] | None,
    ) -> None:
        size = source.size
        part = part_size_for(size, self.config.part_size)
        created = await self._call(
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
            await self._call(
                f"complete multipart upload of {name}",
                lambda c: c.complete_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}, **conditions
                ),
            )
        except BaseException:
            await asyncio.shield(self._abort(name, key, upload_id))
            raise

    async def _abort(self, name: str, key: str, upload_id: str) -> None:
        try:
            await self._abort_upload(f"abort multipart upload of {name}", key, upload_id,
                                     deadline=min(30.0, self.config.retry_deadline))  # fmt: skip
        except Exception as exc:  # the original failure is what the caller must see
            log.warning("aiosnap: %s: could not abort the multipart upload of %s: %r", self.url, name, exc)

    async def _abort_upload(self, what: str, key: str, upload_id: str, deadline: float | None = None) -> None:
        """Abort one multipart upload; one already gone (``NoSuchUpload``: completed, or an
        earlier attempt of this abort landed before its answer was lost) is success."""
        try:
            await self._call(
                what, lambda c: c.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id),
                deadline=deadline,
            )  # fmt: skip
        except StorageError as exc:
            if not isinstance(exc.__cause__, ClientError) or _code(exc.__cause__) != "NoSuchUpload":
                raise

    # -- an object written in parts: one multipart upload, completed by whoever holds its id

    def part_size_for(self, size: int) -> int:
        return part_size_for(size, self.config.part_size)

    async def start_upload(self, name: str) -> str:
        key = self._key(name)
        created = await self._call(
            f"create multipart upload of {name}",
            lambda c: c.create_multipart_upload(Bucket=self.bucket, Key=key, ChecksumAlgorithm="CRC32C"),
        )
        return str(created["UploadId"])

    async def upload_part(self, name: str, token: str, number: int, offset: int, data: memoryview) -> PartRecord:
        response, crc = await self._send(
            f"part {number} of {name}", 0, _MemorySource(memoryview(data).cast("B"), None), 0, len(data),
            Key=self._key(name), UploadId=token, PartNumber=number,
        )  # fmt: skip
        return {"PartNumber": number, "ETag": response["ETag"], "ChecksumCRC32C": crc32c_b64(crc)}

    async def complete_upload(self, name: str, token: str, parts: list[PartRecord]) -> None:
        key = self._key(name)
        ordered = sorted(({k: p[k] for k in ("PartNumber", "ETag", "ChecksumCRC32C")} for p in parts),
                         key=lambda p: int(p["PartNumber"]))  # fmt: skip
        await self._call(
            f"complete multipart upload of {name}",
            lambda c: c.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=token, MultipartUpload={"Parts": ordered}
            ),
        )

    async def read(self, name: str, *, limit: int | None = None) -> bytes:
        key = self._key(name)
        window = {} if limit is None else {"Range": f"bytes=0-{limit}"}

        async def get(c: Any) -> bytes:
            try:
                response = await c.get_object(Bucket=self.bucket, Key=key, **window)
            except ClientError as exc:
                if window and _status(exc) == 416:  # an empty object has no byte 0
                    return b""
                raise
            async with response["Body"] as body:
                data: bytes = await body.read()
            return data

        return await self._call(f"GET {name}", get)

    async def size(self, name: str) -> int:
        key = self._key(name)
        response = await self._call(f"HEAD {name}", lambda c: c.head_object(Bucket=self.bucket, Key=key))
        return int(response["ContentLength"])

    async def read_into(self, name: str, offset: int, dest: memoryview) -> int:
        return await self.read_scatter(name, offset, [dest])

    async def read_scatter(self, name: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """One ranged GET for all of ``buffers`` (a retry resumes after the bytes received)."""
        key = self._key(name)
        target = ScatterTarget(buffers)
        wanted = target.size
        got = 0
        if wanted == 0:
            return 0

        async def get(c: Any) -> None:
            nonlocal got
            try:
                response = await c.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={offset + got}-{offset + wanted - 1}"
                )
            except ClientError as exc:
                if _status(exc) == 416:  # the range starts past the end: a short object
                    return
                raise
            async with response["Body"] as body:
                while got < wanted:
                    n = await body.readinto(target.window(got))
                    if n == 0:
                        return
                    got += n

        await self._call(f"GET {name} bytes {offset}+{wanted}", get)
        return got

    async def exists(self, name: str) -> bool:
        key = self._key(name)
        try:
            await self._call(f"HEAD {name}", lambda c: c.head_object(Bucket=self.bucket, Key=key))
        except FileNotFoundError:
            return False
        return True

    async def _pages(self, prefix: str, delimiter: str | None) -> AsyncIterator[dict[str, Any]]:
        """Every ListObjectsV2 page below ``prefix`` (each request retried by :meth:`_call`)."""
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if delimiter:
                kwargs["Delimiter"] = delimiter
            if token:
                kwargs["ContinuationToken"] = token
            page = await self._call(f"LIST {prefix or '/'}", lambda c: c.list_objects_v2(**kwargs))  # noqa: B023 - awaited in this iteration
            yield page
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    async def _list(self, prefix: str, delimiter: str | None) -> tuple[list[str], list[str]]:
        """Keys and common prefixes (both relative to ``prefix``) below ``prefix``."""
        keys: list[str] = []
        folders: list[str] = []
        async for page in self._pages(prefix, delimiter):
            keys.extend(item["Key"][len(prefix) :] for item in page.get("Contents", []))
            folders.extend(item["Prefix"][len(prefix) :].rstrip("/") for item in page.get("CommonPrefixes", []))
        return keys, folders

    def _folder(self, prefix: str) -> str:
        key = self._key(prefix)
        return f"{key}/" if key else ""

    async def list_children(self, prefix: str = "") -> list[str]:
        keys, folders = await self._list(self._folder(prefix), "/")
        return sorted(set(keys) | set(folders))

    async def walk(self, prefix: str = "") -> list[ObjectInfo]:
        root = self._folder("")
        return [
            ObjectInfo(item["Key"][len(root) :], int(item["Size"]), item["LastModified"].timestamp())
            async for page in self._pages(self._folder(prefix), None)
            for item in page.get("Contents", [])
        ]

    async def stale_uploads(self, older_than: float) -> list[tuple[str, str]]:
        folder = self._folder("")
        found: list[tuple[str, str]] = []
        marker: dict[str, str] = {}
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": folder, **marker}
            page = await self._call("LIST multipart uploads", lambda c: c.list_multipart_uploads(**kwargs))  # noqa: B023
            for upload in page.get("Uploads", []):
                if upload["Initiated"].timestamp() < older_than:
                    found.append((upload["Key"][len(folder) :], upload["UploadId"]))
            if not page.get("IsTruncated"):
                return found
            marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    async def abort_upload(self, name: str, upload_id: str) -> None:
        await self._abort_upload(f"ABORT {name}", f"{self._folder('')}{name}", upload_id)

    async def delete(self, name: str) -> None:
        key = self._key(name)
        await self._call(f"DELETE {name}", lambda c: c.delete_object(Bucket=self.bucket, Key=key))

    async def delete_prefix(self, prefix: str) -> None:
        if not prefix:
            raise ValueError("refusing to delete the whole storage root")
        folder = self._folder(prefix)
        keys, _ = await self._list(folder, None)
        await self._delete_keys([folder + k for k in keys], f"under {prefix}")

    async def delete_many(self, names: Sequence[str]) -> None:
        await self._delete_keys([self._key(name) for name in names], f"{len(names)} objects")

    async def _delete_keys(self, keys: list[str], what: str) -> None:
        for start in range(0, len(keys), 1000):
            objects = [{"Key": k} for k in keys[start : start + 1000]]
            response = await self._call(
                f"DELETE {len(objects)} objects ({what})",
                lambda c: c.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}),  # noqa: B023
            )
            if response.get("Errors"):
                first = response["Errors"][0]
                raise StorageError(f"{self.url}: deleting {what}: {first.get('Code')}: {first.get('Message')}")

    async def close(self) -> None:
        if self._stack is not None:
            stack, self._stack, self._client = self._stack, None, None
            await stack.aclose()
