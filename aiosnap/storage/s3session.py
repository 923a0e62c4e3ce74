"""The client and the retries of an S3 storage (:mod:`aiosnap.storage.s3`).

:class:`S3Session` holds one long-lived aiobotocore client, made on first use, its
connection pool sized to ``s3.max_requests + upload.concurrency``. botocore's own retries
are off: every request goes through :meth:`S3Session.call`, which bounds each attempt by
``s3.request_timeout`` (a stalled body never hangs) and retries throttling, 5xx, connection
resets and timeouts with exponential backoff and full jitter until ``s3.retry_deadline``,
then raises :class:`~aiosnap.errors.StorageUnavailableError` chained to the last
botocore/aiohttp error; other errors are translated to aiosnap's (a missing object to
FileNotFoundError, a failed condition to FileExistsError). Runs on the loop thread of
whoever owns the storage.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
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
from ..errors import StorageError, StorageUnavailableError

__all__ = ["ClientError", "S3Session", "error_code", "http_status", "is_retryable"]

log = logging.getLogger("aiosnap")
T = TypeVar("T")

BACKOFF_BASE = 0.1
BACKOFF_CAP = 5.0
RETRYABLE_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
}  # fmt: skip
RETRYABLE_ERRORS = (
    HTTPClientError, BotoConnectionError, ResponseStreamingError, aiohttp.ClientError, TimeoutError, ConnectionError,
)  # fmt: skip


def http_status(exc: ClientError) -> int:
    """The HTTP status of a botocore error (0 when it has none)."""
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def error_code(exc: ClientError) -> str:
    """The S3 error code of a botocore error ("" when it has none)."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def is_retryable(exc: BaseException) -> bool:
    """Throttling, 5xx, resets and timeouts are worth another attempt."""
    if isinstance(exc, ClientError):
        return error_code(exc) in RETRYABLE_CODES or http_status(exc) >= 500 or http_status(exc) == 429
    return isinstance(exc, RETRYABLE_ERRORS)


class S3Session:
    """The client of one S3 storage (``url``: how errors name it) and its retry loop."""

    def __init__(self, url: str, config: S3Config, concurrency: int) -> None:
        self.url = url
        self.config = config
        self.concurrency = concurrency
        self._client: Any = None
        self._stack: AsyncExitStack | None = None
        self._lock: asyncio.Lock | None = None

    async def client(self) -> Any:
        """The client, made on first use (botocore loads and parses the S3 service model)."""
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

    async def call(self, what: str, request: Callable[[Any], Awaitable[T]], *, deadline: float | None = None) -> T:
        """Run ``request(client)`` with a per-attempt timeout and deadline-bounded retries."""
        client = await self.client()
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
                    raise self.translate(exc, what) from exc
                remaining = give_up - loop.time()
                if remaining <= 0:
                    raise StorageUnavailableError(
                        f"{self.url}: {what} failed {attempt} time(s) within the {budget:g} s retry deadline; "
                        f"last error: {type(exc).__name__}: {exc}"
                    ) from exc
                delay = min(remaining, random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2**attempt)))  # noqa: S311
                log.debug("aiosnap: %s: %s: %s; retry %d in %.2f s", self.url, what, type(exc).__name__, attempt, delay)
                await asyncio.sleep(delay)

    def translate(self, exc: Exception, what: str) -> Exception:
        """The aiosnap error for a request's error that is not worth a retry."""
        if isinstance(exc, ClientError):
            status, code = http_status(exc), error_code(exc)
            if code not in ("NoSuchBucket", "NoSuchUpload") and (status == 404 or code in ("NoSuchKey", "NotFound")):
                return FileNotFoundError(f"{self.url}: {what}: no such object")
            if status == 412 or code == "PreconditionFailed":
                return FileExistsError(f"{self.url}: {what}: the object already exists")
            message = exc.response.get("Error", {}).get("Message", "")
            return StorageError(f"{self.url}: {what}: {code or status}: {message}")
        if isinstance(exc, BotoCoreError):  # no credentials, a bad endpoint, ...: not worth a retry
            return StorageError(f"{self.url}: {what}: {type(exc).__name__}: {exc}")
        return exc

    async def close(self) -> None:
        """Close the client and its connections (a later call makes a new one)."""
        if self._stack is not None:
            stack, self._stack, self._client = self._stack, None, None
            await stack.aclose()
