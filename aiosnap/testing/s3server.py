"""Real S3 protocol servers for the tests, each a separate process on 127.0.0.1 and a free
port, started by a session fixture and stopped afterwards:

- moto in server mode (quick to start; does not check request checksums);
- LocalStack's S3 without Docker, from its own virtualenv (``make test`` builds it): it
  rejects a PUT or part whose bytes do not match its ``x-amz-checksum-crc32c`` (400
  BadDigest), so a body path that sent wrong bytes fails there.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "aiosnap-test-key",
    "AWS_SECRET_ACCESS_KEY": "aiosnap-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@contextmanager
def moto_server(nice: int = 0) -> Iterator[str]:
    """Yields the endpoint URL of a running moto server (at CPU priority ``nice``: a
    benchmark's stand-in for a remote store should not take the measured process's CPU)."""
    env = {**os.environ, **TEST_ENV}
    niced = ["nice", "-n", str(nice)] if nice else []
    process = subprocess.Popen(
        [*niced, sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + 30
        url = None
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line and process.poll() is not None:
                raise RuntimeError(f"moto server exited with {process.returncode}")
            match = re.search(r"Running on (http://127\.0\.0\.1:\d+)", line)
            if match:
                url = match.group(1)
        if url is None:
            raise RuntimeError("moto server did not report its port within 30 s")
        while time.monotonic() < deadline:  # wait until it answers
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=1).close()  # noqa: S310 - loopback
                break
            except OSError:
                time.sleep(0.05)
        # moto logs every request: keep its pipe drained or the server blocks on a full pipe
        threading.Thread(target=process.stdout.read, daemon=True, name="moto-log").start()
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Terminate the server's process group (LocalStack starts helpers), then kill it."""
    for sig, wait in ((15, 3.0), (9, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue


def _start_localstack(python: str, home: str) -> tuple[subprocess.Popen[bytes], str] | None:
    """Start LocalStack on a free port and wait until it answers; None when it exited at
    once (another process took the port meanwhile: LocalStack needs a fixed port)."""
    port = _free_port()
    env = {
        **os.environ, **TEST_ENV,
        "SERVICES": "s3", "GATEWAY_LISTEN": f"127.0.0.1:{port}", "GATEWAY_SERVER": "hypercorn",
        "OVERRIDE_IN_DOCKER": "0", "FILESYSTEM_ROOT": os.path.join(home, "fs"), "DNS_ADDRESS": "0",
        "HOME": home, "TMPDIR": home, "LOCALSTACK_VOLUME_DIR": os.path.join(home, "volume"),
        "DISABLE_EVENTS": "1", "SKIP_SSL_CERT_DOWNLOAD": "1",
    }  # fmt: skip
    with open(os.path.join(home, "localstack.log"), "ab") as log:
        process = subprocess.Popen(
            [python, "-m", "localstack.runtime.main"], stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return None
        try:
            urllib.request.urlopen(url + "/_localstack/health", timeout=1).close()  # noqa: S310 - loopback
            return process, url
        except OSError:
            time.sleep(0.1)
    _stop(process)
    with open(os.path.join(home, "localstack.log"), "rb") as f:
        tail = f.read()[-2000:].decode(errors="replace")
    raise RuntimeError(f"LocalStack did not answer within 60 s; its output ends with:\n{tail}")


@contextmanager
def localstack_server(python: str) -> Iterator[str]:
    """Yields the endpoint URL of a LocalStack S3 server run by ``python`` (the interpreter
    of a virtualenv with ``localstack-core[runtime]``), in its own process group; its files
    live in a temporary folder, removed afterwards."""
    home = tempfile.mkdtemp(prefix="aiosnap-localstack-")
    try:
        for _ in range(3):
            started = _start_localstack(python, home)
            if started is not None:
                break
        else:
            raise RuntimeError(f"LocalStack exited at once three times; see {home}/localstack.log")
        process, url = started
        try:
            yield url
        finally:
            _stop(process)
    finally:
        shutil.rmtree(home, ignore_errors=True)
