"""Shared fixtures: temporary checkpoint roots, a storage wrapper that fails on cue, models."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Config, SyncCheckpointer
from aiosnap.cli import main as cli_main
from aiosnap.format.journal import JOURNAL
from aiosnap.format.spec import SaveSpec
from aiosnap.format.values import key_text
from aiosnap.storage.base import BytesLike, ObjectInfo, Storage
from aiosnap.storage.local import LocalStorage


class FaultyStorage(Storage):
    """Wraps a real backend; writes whose name matches ``fail_when`` raise ``error``.

    ``delay`` seconds are slept before every write (a slow target), and ``gate`` (an
    asyncio.Event created lazily on the loop) can hold writes until a test opens it.
    ``lose_answer_when``: the write lands, then ``error`` is raised (an answer lost on the
    way back); ``hang_after_write_when``: the write lands, then never returns (until
    cancelled). ``read_error``: raised by every read. ``delete_delay``: seconds slept before
    every delete.
    """

    def __init__(
        self,
        inner: Storage,
        *,
        fail_when: Callable[[str], bool] | None = None,
        error: BaseException | None = None,
        delay: float = 0.0,
    ) -> None:
        self.inner = inner
        self.url = inner.url
        self.settled_writes = inner.settled_writes
        self.conditional_writes = inner.conditional_writes
        self.single_file = inner.single_file
        self.fail_when = fail_when
        self.error = error
        self.delay = delay
        self.writes: list[str] = []
        self.held = False
        self._gate: asyncio.Event | None = None
        self.hold_when: Callable[[str], bool] | None = None  # only these writes wait for release()
        self.lose_answer_when: Callable[[str], bool] | None = None
        self.hang_after_write_when: Callable[[str], bool] | None = None
        self.read_error: BaseException | None = None
        self.delete_delay = 0.0
        self.read_requests = 0  # read_into and read_scatter calls
        self.read_bytes = 0  # bytes they asked for

    def hold(self) -> None:
        """Writes wait from now on until :meth:`release`."""
        self._gate = None
        self.held = True

    def release(self, loop: asyncio.AbstractEventLoop) -> None:
        """Let held writes (and later ones) through; ``loop`` is the one they wait on."""
        self.held = False
        self.hold_when = None
        gate = self._gate
        if gate is not None:
            loop.call_soon_threadsafe(gate.set)

    def attempt_started(self, spec: SaveSpec) -> None:
        self.inner.attempt_started(spec)

    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        if self.held or (self.hold_when is not None and self.hold_when(name)):
            self._gate = self._gate or asyncio.Event()
            await self._gate.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail_when is not None and self.fail_when(name):
            assert self.error is not None
            raise self.error
        self.writes.append(name)
        await self.inner.write(name, data, if_absent=if_absent)
        if self.lose_answer_when is not None and self.lose_answer_when(name):
            assert self.error is not None
            raise self.error
        if self.hang_after_write_when is not None and self.hang_after_write_when(name):
            await asyncio.Event().wait()

    async def read(self, name: str, *, limit: int | None = None) -> bytes:
        if self.read_error is not None:
            raise self.read_error
        return await self.inner.read(name, limit=limit)

    async def size(self, name: str) -> int:
        return await self.inner.size(name)

    async def read_into(self, name: str, offset: int, dest: memoryview) -> int:
        self.read_requests += 1
        self.read_bytes += len(dest)
        return await self.inner.read_into(name, offset, dest)

    def reading(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.inner.reading()

    async def close(self) -> None:
        await self.inner.close()

    async def read_scatter(self, name: str, offset: int, buffers: Sequence[memoryview]) -> int:
        self.read_requests += 1
        self.read_bytes += sum(len(b) for b in buffers)
        return await self.inner.read_scatter(name, offset, buffers)

    async def exists(self, name: str) -> bool:
        return await self.inner.exists(name)

    async def list_children(self, prefix: str = "") -> list[str]:
        return await self.inner.list_children(prefix)

    async def delete(self, name: str) -> None:
        await asyncio.sleep(self.delete_delay)
        await self.inner.delete(name)

    async def delete_prefix(self, prefix: str) -> None:
        await asyncio.sleep(self.delete_delay)
        await self.inner.delete_prefix(prefix)

    async def remove_empty_folder(self, prefix: str = "") -> None:
        await self.inner.remove_empty_folder(prefix)

    async def walk(self, prefix: str = "") -> list[ObjectInfo]:
        return await self.inner.walk(prefix)

    # objects written in parts: ``fail_when`` sees ``<name>#part<number>`` and ``<name>#complete``

    def part_size_for(self, size: int) -> int:
        return self.inner.part_size_for(size)

    async def start_upload(self, name: str) -> str:
        return await self.inner.start_upload(name)

    async def upload_part(self, name: str, token: str, number: int, offset: int, data: memoryview) -> dict[str, Any]:
        await self._maybe_fail(f"{name}#part{number}")
        return await self.inner.upload_part(name, token, number, offset, data)

    async def complete_upload(self, name: str, token: str, parts: list[dict[str, Any]]) -> None:
        await self._maybe_fail(f"{name}#complete")
        await self.inner.complete_upload(name, token, parts)

    async def abort_upload(self, name: str, upload_id: str) -> None:
        await self.inner.abort_upload(name, upload_id)

    async def _maybe_fail(self, what: str) -> None:
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail_when is not None and self.fail_when(what):
            assert self.error is not None
            raise self.error
        self.writes.append(what)


_REPOSITORY = str(Path(__file__).resolve().parent.parent)
# child processes (ranks, upload helpers, scripts) import this checkout's tests.* helpers too,
# whatever their working directory and however the workers of pytest-xdist were started
os.environ["PYTHONPATH"] = os.pathsep.join([_REPOSITORY, *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.fixture(autouse=True)
def _deterministic_mode_left_as_found() -> Iterator[None]:
    """Lightning's ``Trainer(deterministic=True)`` turns torch's deterministic algorithms on
    for the whole process: put the mode back, so no test runs in another's."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(before, warn_only=warn_only)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test`` runs two workers, ``--dist loadgroup``): every test
    that talks to LocalStack runs in one worker, so one LocalStack server starts, not two
    (it takes 20 s and several hundred MiB)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_localstack = callspec is not None and callspec.params.get("s3_server") == "localstack"
        if on_localstack or "localstack" in item.name or "localstack_endpoint" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("localstack"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-cases", type=int, default=2000, help="cases per fuzz test (make soak raises it)")
    parser.addoption("--soak-rounds", type=int, default=12, help="saves per in-process soak (make soak raises it)")
    parser.addoption("--soak-kills", type=int, default=1, help="child trainers killed per spool mode in the soak")


CliRunner = Callable[..., subprocess.CompletedProcess[str]]
"""The type of the ``aiosnap`` fixture: ``aiosnap("ls", root)`` returns exit code, stdout, stderr."""


@pytest.fixture
def aiosnap(capsys: pytest.CaptureFixture[str]) -> CliRunner:
    """The CLI's entry point in this process (what the console script calls), captured."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        code = cli_main(list(args))
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, captured.out, captured.err)

    return run


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def small_config(root: Path, upload_executor: str) -> Config:
    """Small chunks and budget so that every test crosses chunk boundaries."""
    return Config(storage={"url": str(root)}, ram_budget="1MiB", upload={"chunk_size": "64KiB", "concurrency": 4})


@pytest.fixture
def faulty(root: Path, upload_executor: str) -> FaultyStorage:
    if upload_executor == "process":
        pytest.skip("storage wrappers that fail on cue live in the trainer's process (thread executor only)")
    return FaultyStorage(LocalStorage(root))


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Structural, bit-exact equality (types included: tuples stay tuples)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        )
        assert (
            a.contiguous().view(-1).view(torch.uint8).equal(b.contiguous().view(-1).view(torch.uint8))
            if a.numel()
            else True
        ), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {[key_text(k) for k in a]} != {[key_text(k) for k in b]}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{key_text(k)}")  # any key: an int of 5,000 digits too
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _copy_if_there(source: str, destination: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.copy2(source, destination)


@pytest.fixture
def crashed_spool(tmp_path: Path) -> tuple[Path, Path, Config, dict[str, Any]]:
    """What a crash leaves of a real save caught mid-upload with ``spool.mode: always``:
    chunks 0 and 1 landed, 2 and 3 still on the spool disk, the journal saying so. Returns
    copies of the spool and of the storage root as they were (restore them to the config's
    paths to play the crash), the config and the state saved as step 4."""
    root, spool_dir = tmp_path / "ckpt", tmp_path / "spool"
    config = Config(
        storage={"url": str(root)},
        ram_budget="1MiB",
        upload={"chunk_size": "64KiB", "concurrency": 2, "executor": "thread"},  # its storage wrapper
        spool={"dir": str(spool_dir), "mode": "always", "resume": False},
        retention={"keep_last": 1},
    )
    state = {"w": torch.randn(60_000, generator=torch.Generator().manual_seed(3)), "n": 5}
    store = FaultyStorage(LocalStorage(root))
    store.hold_when = lambda name: not name.endswith(("/0.bin", "/1.bin"))
    ckpt = SyncCheckpointer(config, storage=store)
    ckpt.save(state, step=4)
    folder = next(p for p in spool_dir.iterdir() if p.is_dir())
    deadline = time.monotonic() + 10
    while (folder / JOURNAL).read_text().count('"landed"') < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    spool_copy, root_copy = tmp_path / "spool-template", tmp_path / "root-template"
    # a landed chunk's spool file is deleted right after its journal record: it may go while
    # it is copied (a crash, too, can come before or after that deletion)
    shutil.copytree(spool_dir, spool_copy, ignore=shutil.ignore_patterns("LOCK"), copy_function=_copy_if_there)
    shutil.copytree(root, root_copy)
    with pytest.raises(TimeoutError):
        ckpt.close(timeout=0.1)
    return spool_copy, root_copy, config, state


# --- S3: a real protocol server (moto) and a fault-injecting proxy in front of it ---------


LOCALSTACK_PYTHON = os.environ.get("TEST_LOCALSTACK_PYTHON") or str(
    Path(__file__).resolve().parent.parent / ".venv-localstack" / "bin" / "python"
)


@pytest.fixture(scope="session")
def s3_test_credentials() -> Iterator[None]:
    """The test servers' credentials in the environment, for aiosnap and boto3 alike."""
    from aiosnap.testing.s3server import TEST_ENV

    saved = {k: os.environ.get(k) for k in TEST_ENV}
    os.environ.update(TEST_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def moto_endpoint(s3_test_credentials: None) -> Iterator[str]:
    from aiosnap.testing.s3server import moto_server

    with moto_server() as url:
        yield url


@pytest.fixture(scope="session")
def localstack_endpoint(s3_test_credentials: None) -> Iterator[str]:
    from aiosnap.testing.s3server import localstack_server

    if not os.path.exists(LOCALSTACK_PYTHON):
        message = f"LocalStack's virtualenv is missing ({LOCALSTACK_PYTHON}); `make test` builds it"
        if os.environ.get("TEST_REQUIRE_LOCALSTACK"):
            pytest.fail(message)
        pytest.skip(message)
    with localstack_server(LOCALSTACK_PYTHON) as url:
        yield url


@pytest.fixture
def s3_server(request: pytest.FixtureRequest) -> str:
    """Which server: moto, or (modules marked ``both_servers``) LocalStack as well."""
    return str(getattr(request, "param", "moto"))


@pytest.fixture
def s3_endpoint(s3_server: str, request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{s3_server}_endpoint"))


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh, empty bucket on the test server."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_client(s3_endpoint: str) -> Any:
    """A plain boto3 client, to look at the server behind aiosnap's back."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint)


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[Any]:
    from aiosnap.testing.faultproxy import FaultProxy

    port = int(s3_endpoint.rsplit(":", 1)[1])
    fault_proxy = FaultProxy(port)
    yield fault_proxy
    fault_proxy.close()


def s3_config(endpoint: str, bucket: str, prefix: str = "run", **s3: Any) -> Config:
    """Small chunks and parts (5 MiB is S3's minimum part) so tests cross every boundary."""
    settings = {
        "endpoint_url": endpoint,
        "addressing_style": "path",
        "multipart_threshold": "6MiB",
        "part_size": "5MiB",
        "retry_deadline": 20,
        "request_timeout": 10,
        **s3,
    }
    return Config(
        storage={"url": f"s3://{bucket}/{prefix}"},
        ram_budget="64MiB",
        upload={"chunk_size": "12MiB", "concurrency": 4},
        s3=settings,
    )


# --- both executors: modules marked `both_executors` run each test with upload.executor
#     thread and process (an AIOSNAP_* variable, so every Config of the test takes it)


@pytest.fixture(autouse=True)
def upload_executor(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    mode = str(getattr(request, "param", "thread"))
    if mode == "process":
        monkeypatch.setenv("AIOSNAP_UPLOAD__EXECUTOR", "process")
    return mode


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "s3_server" in metafunc.fixturenames and metafunc.definition.get_closest_marker("both_servers"):
        moto_only = metafunc.definition.get_closest_marker("moto_only") is not None
        metafunc.parametrize("s3_server", ["moto"] if moto_only else ["moto", "localstack"], indirect=True)
    if "upload_executor" in metafunc.fixturenames and metafunc.definition.get_closest_marker("both_executors"):
        thread_only = metafunc.definition.get_closest_marker("thread_only") is not None
        metafunc.parametrize("upload_executor", ["thread"] if thread_only else ["thread", "process"], indirect=True)


def damage_entry(config: Config, path: str, at: int = 0, mask: int = 0xFF) -> None:
    """Flip the bits ``mask`` of byte ``at`` of entry ``path`` in the latest step of the local
    root ``config`` names (a disk that rotted after the commit)."""
    with SyncCheckpointer(config) as ckpt:
        manifest = ckpt.manifest()
    where = next(e for e in manifest.entries if e.path == path).ranges[0]
    target = Path(config.storage.url) / where.object
    data = bytearray(target.read_bytes())
    data[where.offset + at] ^= mask
    target.write_bytes(bytes(data))


def rot_after_writing(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Local files named ``name`` get a byte flipped right after aiosnap wrote them (a disk
    that rots what it was given): through ``durable.write_file``, which every spool write uses."""
    from aiosnap.core import durable

    real_write = durable.write_file

    def write_then_rot(path: Path, data: memoryview | bytes, *, sync: bool = True) -> None:
        real_write(path, data, sync=sync)
        if path.name == name:
            with open(path, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 0xFF]))

    monkeypatch.setattr(durable, "write_file", write_then_rot)


def count_fresh_tensors(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The entries a load reads into tensors of its own (rather than the caller's), listed
    as the load makes them."""
    from aiosnap.load import fetch

    made: list[str] = []
    real = fetch._empty_for

    def counting(manifest: Any, index: int) -> torch.Tensor:
        made.append(manifest.entries[index].path)
        return real(manifest, index)

    monkeypatch.setattr(fetch, "_empty_for", counting)
    return made
