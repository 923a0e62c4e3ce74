"""S3 and S3-compatible storage through aiobotocore (imported only for ``s3://`` URLs).

Runs on aiosnap's background loop thread. :class:`S3Storage` is the object protocol
(names map to keys below the URL's prefix); it composes the client and its retries
(:class:`~.s3session.S3Session`: one long-lived client, each attempt bounded by
``s3.request_timeout``, throttling, 5xx, resets and timeouts retried with backoff and full
jitter until ``s3.retry_deadline``, then :class:`~aiosnap.errors.StorageUnavailableError`)
and the uploads (:class:`~.s3upload.S3Uploader`: PUTs and multipart uploads with a CRC32C
per request for the server to check, concurrent parts, a failed multipart upload aborted,
slab bodies sent as memoryviews of the arena, spooled files mapped). Reads resume where a
broken body stopped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from ..config import S3Config
from ..core.checksums import RangeChecksums
from ..core.names import check_object_name
from ..errors import StorageError
from .base import BytesLike, ObjectInfo, PartRecord, ScatterTarget, Storage
from .s3session import ClientError, S3Session, http_status
from .s3upload import MIN_PART, MemorySource, S3Uploader, part_size_for
from .s3upload import OrderedSlots as _OrderedSlots

__all__ = ["MIN_PART", "S3Storage", "part_size_for"]


class S3Storage(Storage):
    """Objects live under ``s3://bucket/prefix/``; names map to keys below the prefix."""

    def __init__(self, bucket: str, prefix: str, config: S3Config, *, concurrency: int = 8) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.config = config
        self.concurrency = concurrency
        self.conditional_writes = config.conditional_commit
        self._session = S3Session(self.url, config, concurrency)
        self._uploader = S3Uploader(self.url, bucket, config, self._session, self._key)

    def __getstate__(self) -> dict[str, Any]:
        """Its settings only: an upload process rebuilds it, with a client of its own."""
        return {"bucket": self.bucket, "prefix": self.prefix, "config": self.config, "concurrency": self.concurrency}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["bucket"], state["prefix"], state["config"], concurrency=state["concurrency"])  # type: ignore[misc]

    @property
    def _slots(self) -> _OrderedSlots | None:
        """The request slots of the uploads (made at the first data request)."""
        return self._uploader.slots

    @_slots.setter
    def _slots(self, slots: _OrderedSlots | None) -> None:
        self._uploader.slots = slots

    async def connect(self) -> None:
        await self._session.client()  # ~0.3 s: botocore loads and parses the S3 service model

    def _key(self, name: str) -> str:
        name = check_object_name(name.rstrip("/")) if name else ""
        return f"{self.prefix}/{name}" if self.prefix and name else (self.prefix or name)

    # -- the protocol ---------------------------------------------------------------------

    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        source = MemorySource(memoryview(data).cast("B"), None)
        await self._uploader.upload(name, source, self._absent(if_absent))

    def _absent(self, if_absent: bool) -> dict[str, str]:
        """The request conditions of an ``if_absent`` write (none where the server is said
        to lack conditional writes: ``s3.conditional_commit``)."""
        return {"IfNoneMatch": "*"} if if_absent and self.config.conditional_commit else {}

    async def write_checksummed(self, name: str, data: memoryview, checksums: RangeChecksums) -> None:
        await self._uploader.upload(name, MemorySource(data, checksums), {})

    async def write_file(self, name: str, path: str, *, if_absent: bool = False) -> None:
        await self._uploader.upload_file(name, path, None, self._absent(if_absent))

    async def write_file_verified(self, name: str, path: str, crc: int) -> None:
        # the CRC32Cs of the PUT or parts are computed anyway: combined, they check the file
        # before the object can appear (before the PUT, or before completing the upload)
        await self._uploader.upload_file(name, path, (path, crc))

    async def _abort(self, name: str, key: str, upload_id: str) -> None:
        """Abort a failed multipart upload of ``name`` (see :meth:`S3Uploader.abort`)."""
        await self._uploader.abort(name, key, upload_id)

    # -- an object written in parts: one multipart upload, completed by whoever holds its id

    def part_size_for(self, size: int) -> int:
        return part_size_for(size, self.config.part_size)

    async def start_upload(self, name: str) -> str:
        return await self._uploader.start_upload(name)

    async def upload_part(self, name: str, token: str, number: int, offset: int, data: memoryview) -> PartRecord:
        return await self._uploader.upload_part(name, token, number, offset, data)

    async def complete_upload(self, name: str, token: str, parts: list[PartRecord]) -> None:
        await self._uploader.complete_upload(name, token, parts)

    async def read(self, name: str, *, limit: int | None = None) -> bytes:
        key = self._key(name)
        window = {} if limit is None else {"Range": f"bytes=0-{limit}"}

        async def get(c: Any) -> bytes:
            try:
                response = await c.get_object(Bucket=self.bucket, Key=key, **window)
            except ClientError as exc:
                if window and http_status(exc) == 416:  # an empty object has no byte 0
                    return b""
                raise
            async with response["Body"] as body:
                data: bytes = await body.read()
            return data

        return await self._session.call(f"GET {name}", get)

    async def size(self, name: str) -> int:
        key = self._key(name)
        response = await self._session.call(f"HEAD {name}", lambda c: c.head_object(Bucket=self.bucket, Key=key))
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
                if http_status(exc) == 416:  # the range starts past the end: a short object
                    return
                raise
            async with response["Body"] as body:
                while got < wanted:
                    n = await body.readinto(target.window(got))
                    if n == 0:
                        return
                    got += n

        await self._session.call(f"GET {name} bytes {offset}+{wanted}", get)
        return got

    async def exists(self, name: str) -> bool:
        key = self._key(name)
        try:
            await self._session.call(f"HEAD {name}", lambda c: c.head_object(Bucket=self.bucket, Key=key))
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
            page = await self._session.call(f"LIST {prefix or '/'}", lambda c: c.list_objects_v2(**kwargs))  # noqa: B023 - awaited in this iteration
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
            page = await self._session.call("LIST multipart uploads", lambda c: c.list_multipart_uploads(**kwargs))  # noqa: B023
            for upload in page.get("Uploads", []):
                if upload["Initiated"].timestamp() < older_than:
                    found.append((upload["Key"][len(folder) :], upload["UploadId"]))
            if not page.get("IsTruncated"):
                return found
            marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    async def abort_upload(self, name: str, upload_id: str) -> None:
        await self._uploader.abort_upload(f"ABORT {name}", f"{self._folder('')}{name}", upload_id)

    async def delete(self, name: str) -> None:
        key = self._key(name)
        await self._session.call(f"DELETE {name}", lambda c: c.delete_object(Bucket=self.bucket, Key=key))

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
            response = await self._session.call(
                f"DELETE {len(objects)} objects ({what})",
                lambda c: c.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}),  # noqa: B023
            )
            if response.get("Errors"):
                first = response["Errors"][0]
                raise StorageError(f"{self.url}: deleting {what}: {first.get('Code')}: {first.get('Message')}")

    async def close(self) -> None:
        await self._session.close()
