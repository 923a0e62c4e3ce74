"""A real S3 protocol server for the tests: moto in server mode, a separate process on
127.0.0.1 and a free port, started by a session fixture and stopped afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
def moto_server() -> Iterator[str]:
    """Yields the endpoint URL of a running moto server."""
    env = {**os.environ, **TEST_ENV}
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
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
