"""A TCP proxy on 127.0.0.1 between aiosnap and the S3 test server, injecting faults.

Runs its own event loop in a daemon thread. Faults are switched on and off by the test:
- ``reset_every`` / ``reset_after_bytes``: every Nth connection is reset (RST) once more
  than that many request bytes went through it, i.e. mid-body;
- ``stall_every``: every Nth connection stops forwarding (without closing) once more than
  ``reset_after_bytes`` request bytes went through it: a body that hangs mid-way (at most
  ``stall_limit`` of them, when set: a strict period can starve a retry pattern forever);
- ``rate_bytes_per_s``: a cap on throughput in each direction (token bucket);
- ``slowdown_requests``: the next N connections get ``503 SlowDown`` without reaching the server.

:func:`capped_proxy_process` runs a rate cap alone in a process of its own
(``python -m aiosnap.testing.faultproxy``), for benchmarks: the proxy's copying then holds
no GIL and no CPU time of the process being measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator


def _slowdown_response() -> bytes:
    body = (
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
        b"<Message>Please reduce your request rate.</Message><RequestId>fault-proxy</RequestId></Error>"
    )
    head = (
        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    return head + body


class _Bucket:
    """Token bucket shared by the connections of one direction (proxy loop only)."""

    def __init__(self) -> None:
        self.rate: float | None = None
        self._tokens = 0.0
        self._stamp = time.monotonic()

    async def take(self, n: int) -> None:
        if self.rate is None:
            return
        now = time.monotonic()
        self._tokens = min(self.rate * 0.05, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        self._tokens -= n
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / self.rate)


class FaultProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.reset_every = 0
        self.stall_every = 0
        self.stall_limit: int | None = None
        self.stalls = 0
        self.reset_after_bytes = 256 * 1024
        self.slowdown_requests = 0
        self.resets = 0
        self.slowdowns = 0
        self._up = _Bucket()
        self._down = _Bucket()
        self._counter = itertools.count(1)
        self._stall_over: asyncio.Event  # made on the proxy's loop thread
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fault-proxy")
        self._thread.start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_rate(self, bytes_per_s: float | None) -> None:
        self._up.rate = self._down.rate = bytes_per_s

    def clear(self) -> None:
        """Stop injecting faults; connections stalled so far are dropped (RST), as a
        server that stopped answering eventually does."""
        self.reset_every = 0
        self.stall_every = 0
        self.stall_limit = None
        self.slowdown_requests = 0
        self.set_rate(None)
        self._loop.call_soon_threadsafe(self._unstall)

    def _unstall(self) -> None:
        self._stall_over.set()
        self._stall_over = asyncio.Event()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stall_over = asyncio.Event()
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.run_until_complete(asyncio.sleep(0))  # let transports finish closing
        self._loop.close()

    def close(self) -> None:
        def stop() -> None:
            self._server.close()
            self._loop.stop()

        self._loop.call_soon_threadsafe(stop)
        self._thread.join(10)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        number = next(self._counter)
        if self.slowdown_requests > 0:
            self.slowdown_requests -= 1
            self.slowdowns += 1
            await client_r.readuntil(b"\r\n\r\n")
            client_w.write(_slowdown_response())
            await client_w.drain()
            client_w.close()
            return
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_w.close()
            return
        doomed = self.reset_every > 0 and number % self.reset_every == 0
        stalled = self.stall_every > 0 and number % self.stall_every == 0
        stalled = stalled and (self.stall_limit is None or self.stalls < self.stall_limit)
        up = asyncio.ensure_future(self._pump(client_r, server_w, self._up, doomed, stalled))
        down = asyncio.ensure_future(self._pump(server_r, client_w, self._down, False, False))
        try:
            done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            if up in done and up.result() == "reset":
                self.resets += 1
                for writer in (client_w, server_w):
                    sock = writer.get_extra_info("socket")
                    if sock is not None:  # linger 0: close sends RST, as a dropped connection does
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
        finally:  # also when the proxy shuts down with this connection still open
            for task in (up, down):
                task.cancel()
            for writer in (client_w, server_w):
                if not writer.transport.is_closing():
                    writer.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bucket: _Bucket, doomed: bool, stalled: bool
    ) -> str:
        sent = 0
        try:
            while True:
                data = await reader.read(64 * 1024)
                if not data:
                    return "eof"
                if doomed and sent + len(data) > self.reset_after_bytes:
                    return "reset"
                if stalled and sent + len(data) > self.reset_after_bytes:
                    self.stalls += 1
                    await self._stall_over.wait()  # hold the connection open, forward nothing
                    return "reset"
                await bucket.take(len(data))
                writer.write(data)
                await writer.drain()
                sent += len(data)
        except (ConnectionError, OSError):
            return "error"


@contextlib.contextmanager
def capped_proxy_process(target_port: int, bytes_per_s: float | None, nice: int = 0) -> Iterator[str]:
    """Yields the URL of a proxy to ``target_port`` capped at ``bytes_per_s`` each way,
    running in a child process at CPU priority ``nice``; stops it (bounded) on exit.
    Caller's thread."""
    niced = ["nice", "-n", str(nice)] if nice else []
    command = [*niced, sys.executable, "-m", "aiosnap.testing.faultproxy", str(target_port), str(bytes_per_s or 0)]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the proxy process did not start (exit status {process.poll()})")
        yield f"http://127.0.0.1:{int(line)}"
    finally:
        if process.stdin is not None:
            process.stdin.close()  # the proxy stops when its stdin closes
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv: list[str]) -> int:
    """``python -m aiosnap.testing.faultproxy TARGET_PORT BYTES_PER_S`` (0: no cap): prints
    its port, proxies until its stdin closes."""
    target_port, rate = int(argv[0]), float(argv[1])
    proxy = FaultProxy(target_port)
    proxy.set_rate(rate or None)
    print(proxy.port, flush=True)
    try:
        sys.stdin.read()
    finally:
        proxy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
