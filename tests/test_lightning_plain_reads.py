"""Issue 26, item 10: checkpoints read without the plugin's waiting, and URLs aiosnap does
not store. A plain ``torch.load`` of a path whose first save is in flight gets an error
that names aiosnap, the save and how to wait (not a bare ``EOFError``); after
``wait_for_checkpoint`` it gets the file. ``Trainer.fit(ckpt_path="http://...")`` with the
plugin resumes from an aiosnap file served by a real HTTP server, verified; other fsspec
URLs (``memory://``) are saved, loaded and removed by Lightning's own writer."""

from __future__ import annotations

import concurrent.futures
import functools
import io
import multiprocessing
import os
import re
import sys
import tempfile
import threading
import time
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("lightning")

from aiosnap import Config
from aiosnap.errors import (
    ChecksumMismatchError,
    ConfigError,
    CorruptCheckpointError,
    PickleNotAllowedError,
    PlainReadTimeoutError,
    StorageError,
)
from aiosnap.format.placeholder import MAX_PLACEHOLDER_BYTES, placeholder_bytes, placeholder_message
from aiosnap.integrations import inflight
from aiosnap.integrations.lightning import AiosnapCheckpointIO, checkpoint_storage, wait_for_checkpoint
from lightning.fabric.utilities.cloud_io import _load as lightning_load
from lightning.pytorch.callbacks import ModelCheckpoint
from tests.conftest import FaultyStorage
from tests.test_lightning import QUIET_LIGHTNING, LossLog, Regressor, loader, trainer

pytestmark = [QUIET_LIGHTNING]


@pytest.fixture
def config() -> Config:
    return Config(ram_budget="16MiB", upload={"chunk_size": "64KiB"})


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A folder served over HTTP on loopback (Python's http.server, which answers every
    request with the whole file: it has no Range support), and its URL; a few names
    misbehave (see ``do_GET``)."""
    folder = tmp_path / "served"
    folder.mkdir()

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            """``/status-<code>...``: that error; ``/short...``: a body shorter than its
            Content-Length; ``/unended...``: no Content-Length, the connection closed early."""
            name = self.path.split("?")[0].strip("/")
            if name.startswith("status-"):
                self.send_error(int(name[7:10]))
            elif name.startswith(("short", "unended")):
                body = b"PK\x03\x04" + bytes(4000)  # the start of a zip, cut short
                self.send_response(200)
                if name.startswith("short"):
                    self.send_header("Content-Length", str(2 * len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                super().do_GET()

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _held_commits(config: Config, **options: Any) -> tuple[AiosnapCheckpointIO, list[FaultyStorage]]:
    """A plugin (made with ``options``) whose commits wait until the test releases them."""
    made: list[FaultyStorage] = []

    def storage_for(url: str, cfg: Config) -> FaultyStorage:
        storage = FaultyStorage(checkpoint_storage(url, cfg))
        storage.hold_when = lambda name: name.endswith("manifest.json")
        made.append(storage)
        return storage

    return AiosnapCheckpointIO(config, storage_for=storage_for, **options), made


def _in_another_thread(read: Callable[[], Any]) -> Any:
    with concurrent.futures.ThreadPoolExecutor(1) as other:
        return other.submit(read).result(timeout=60)


def test_plain_torch_load_during_a_first_save_says_it_is_in_flight(tmp_path: Path, config: Config) -> None:
    plugin, held = _held_commits(config)
    path = tmp_path / "ckpt" / "epoch=0.ckpt"
    state = {"state_dict": {"w": torch.arange(1000.0)}, "global_step": 4}
    plugin.save_checkpoint(state, path)
    assert path.is_file()  # something at the path at once, as Lightning's checks need
    for read in (
        lambda: torch.load(path),
        lambda: torch.load(path, weights_only=False),
        lambda: torch.load(path, mmap=True),
        lambda: lightning_load(str(path)),  # LightningModule.load_from_checkpoint's reader
    ):
        with pytest.raises(ValueError, match=r"aiosnap: .*placeholder.*still running.*wait_for_checkpoint\(path\)"):
            _in_another_thread(read)  # not the thread that saved: it does not wait
    with pytest.raises(TimeoutError, match="still in flight"):
        wait_for_checkpoint(path, timeout=0.2)
    held[0].release(plugin._root()._loop.loop)
    wait_for_checkpoint(path, timeout=30)
    loaded = _in_another_thread(lambda: torch.load(path))
    assert torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"]) and loaded["global_step"] == 4
    plugin.teardown()


def _release_once_waiting(thread: int, plugin: AiosnapCheckpointIO, held: FaultyStorage) -> threading.Thread:
    """Release the held commit once ``thread`` is inside a plain read that waits for it."""

    def run() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(thread)
            while frame is not None and frame.f_code.co_name != "wait_for_own_save":
                frame = frame.f_back
            if frame is not None:
                break
            time.sleep(0.01)
        held.release(plugin._root()._loop.loop)

    releaser = threading.Thread(target=run, daemon=True)
    releaser.start()
    return releaser


def _released_later(plugin: AiosnapCheckpointIO, held: FaultyStorage) -> threading.Timer:
    """Release the held commit in 20 s if the test has not: a read that waits without bound
    (as before the waiting was opt-in and bounded) ends, and the test fails instead of hanging."""
    timer = threading.Timer(20, lambda: held.release(plugin._root()._loop.loop))
    timer.start()
    return timer


def test_plain_reads_by_the_saving_thread_wait_only_with_the_opt_in_and_not_forever(
    tmp_path: Path, config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    plugin, held = _held_commits(config)  # the default: plain reads never wait
    path = tmp_path / "final.ckpt"
    plugin.save_checkpoint({"w": torch.arange(1000.0), "epoch": 2}, path)
    timer = _released_later(plugin, held[0])
    with pytest.raises(ValueError, match="placeholder.*still running"):
        torch.load(path)  # at once, in the thread that saved: the placeholder's message
    timer.cancel()
    held[0].release(plugin._root()._loop.loop)
    plugin.teardown()

    with pytest.raises(ConfigError, match="plain_reads_timeout"):
        AiosnapCheckpointIO(config, plain_reads_wait=True, plain_reads_timeout=0)
    plugin, held = _held_commits(config, plain_reads_wait=True, plain_reads_timeout=0.3)
    plugin.save_checkpoint({"w": torch.zeros(3)}, path)  # a stuck commit
    timer = _released_later(plugin, held[0])
    with pytest.raises(PlainReadTimeoutError, match=f"{re.escape(str(path))}: .* not committed after 0.3 s"):
        torch.load(path)
    timer.cancel()
    assert [r.getMessage() for r in caplog.records if "waits" in r.getMessage()] == [
        f"aiosnap: a read of {path} by the thread that saved it waits (up to 0.3 s) for that save to commit "
        "(AiosnapCheckpointIO(plain_reads_wait=True))"
    ]
    held[0].release(plugin._root()._loop.loop)
    plugin.teardown()


def test_a_plain_read_by_the_thread_that_saved_waits_for_the_save(tmp_path: Path, config: Config) -> None:
    plugin, held = _held_commits(config, plain_reads_wait=True)
    path = tmp_path / "final.ckpt"
    plugin.save_checkpoint({"w": torch.arange(1000.0), "epoch": 2}, path)
    releaser = _release_once_waiting(threading.get_ident(), plugin, held[0])
    loaded = torch.load(path)  # waits (the commit is held until it does), then reads the checkpoint
    releaser.join(timeout=60)
    assert loaded["epoch"] == 2 and torch.equal(loaded["w"], torch.arange(1000.0))
    plugin.save_checkpoint({"w": torch.zeros(3), "epoch": 3}, path)  # a second save: the old file until then
    assert torch.load(path)["epoch"] == 3  # waited again: the new version
    named_in_bytes = tmp_path / "bytes.ckpt"
    plugin.save_checkpoint({"epoch": 4}, named_in_bytes)
    releaser = _release_once_waiting(threading.get_ident(), plugin, held[1])
    with open(os.fsencode(named_in_bytes), "rb") as f:  # a path given as bytes waits too
        assert torch.load(f)["epoch"] == 4
    releaser.join(timeout=60)
    plugin.teardown()
    with open(tmp_path / "other.txt", "w") as f:  # writes never wait; nor do reads of other paths
        f.write("x")
    assert (tmp_path / "other.txt").read_text() == "x"


def _plain_load_error(path: str) -> str:
    try:
        torch.load(path)
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_a_forked_child_of_the_thread_that_saved_does_not_wait(tmp_path: Path, config: Config) -> None:
    plugin, held = _held_commits(config, plain_reads_wait=True)
    path = tmp_path / "x.ckpt"
    plugin.save_checkpoint({"w": torch.ones(3)}, path)
    forked = multiprocessing.get_context("fork")
    with forked.Pool(1) as pool:  # what a DataLoader worker is
        answer = pool.apply_async(_plain_load_error, (str(path),)).get(timeout=60)
    assert "placeholder" in answer  # its copy of the save never ends: it must not wait for it
    taken, done = threading.Event(), threading.Event()

    def hold_the_lock() -> None:  # as the loop thread does when a save settles while the trainer forks
        with inflight._lock:
            taken.set()
            done.wait(timeout=60)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    taken.wait(timeout=60)
    try:
        pool = forked.Pool(1)  # forked while another thread holds the lock
    finally:
        done.set()
        holder.join(timeout=60)
    with pool:
        assert "placeholder" in pool.apply_async(_plain_load_error, (str(path),)).get(timeout=30)
        assert pool.apply_async(wait_for_checkpoint, (str(path), 30)).get(timeout=30) is None  # not its saves
    held[0].release(plugin._root()._loop.loop)
    plugin.teardown()


def test_trainer_save_checkpoint_then_torch_load(tmp_path: Path, config: Config) -> None:
    def slow(url: str, cfg: Config) -> FaultyStorage:
        return FaultyStorage(checkpoint_storage(url, cfg), delay=0.3)  # in flight for a while

    fit = trainer(1, AiosnapCheckpointIO(config, storage_for=slow, plain_reads_wait=True), [], tmp_path)
    fit.fit(Regressor(), loader())
    fit.save_checkpoint(tmp_path / "model.ckpt")  # what Lightning's own test_correct_step_and_epoch does
    assert torch.load(tmp_path / "model.ckpt", weights_only=True)["global_step"] == 4
    assert Regressor.load_from_checkpoint(tmp_path / "model.ckpt").hparams.width == 32
    fit.strategy.checkpoint_io.teardown()


def test_a_placeholder_left_by_a_stopped_process(tmp_path: Path, config: Config) -> None:
    path = tmp_path / "last.ckpt"
    path.write_bytes(placeholder_bytes(pid=4242, started=0.0))  # that process was killed mid first save
    with pytest.raises(ValueError, match=r"process 4242, started 1970-01-01 00:00:00 UTC"):
        torch.load(path)
    plugin = AiosnapCheckpointIO(config)
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoint.*process 4242"):
        plugin.load_checkpoint(path)
    plugin.save_checkpoint({"w": torch.ones(3)}, path)  # the path works on
    assert torch.equal(plugin.load_checkpoint(path)["w"], torch.ones(3))
    plugin.teardown()


def test_a_failed_first_save_takes_its_placeholder_away(tmp_path: Path, config: Config) -> None:
    def broken(url: str, cfg: Config) -> FaultyStorage:
        failing = FaultyStorage(checkpoint_storage(url, cfg), fail_when=lambda n: n.endswith(".bin"))
        failing.error = OSError(5, "EIO")
        return failing

    plugin = AiosnapCheckpointIO(config, storage_for=broken)
    path = tmp_path / "x.ckpt"
    plugin.save_checkpoint({"w": torch.ones(3)}, path)
    wait_for_checkpoint(path, timeout=30)  # does not raise the failure: Lightning hears of it
    assert not path.exists()
    with pytest.raises(OSError, match="EIO"):
        plugin.teardown()


@given(st.binary(max_size=600) | st.builds(lambda cut: placeholder_bytes(1)[:cut], st.integers(0, 700)))
@settings(max_examples=200, deadline=None)
def test_anything_but_a_whole_placeholder_is_no_placeholder(data: bytes) -> None:
    whole = placeholder_bytes(1)
    assert (placeholder_message(data) is not None) == (data == whole)


def test_an_aiosnap_file_whose_end_is_damaged_is_refused_not_read_unverified(tmp_path: Path, config: Config) -> None:
    plugin = AiosnapCheckpointIO(config)
    path = tmp_path / "w.ckpt"
    plugin.save_checkpoint({"w": torch.arange(1000.0)}, path)
    wait_for_checkpoint(path)
    whole = path.read_bytes()
    comment = len(whole) - whole.rindex(b"aiosnap-archive ")
    # a byte of the trailer's comment, of its length field, of the end record's signature, of the
    # manifest record's name in the central directory: torch.load reads on without it, unchecked
    for at in (-1, -comment + 3, -comment - 2, -comment - 22, whole.rindex(b"manifest.json") - len(whole)):
        damaged = bytearray(whole)
        damaged[at] ^= 0xFF
        damaged[damaged.find(torch.tensor([123.0]).numpy().tobytes())] ^= 0x01  # and one bit of one float
        path.write_bytes(bytes(damaged))
        with pytest.raises(CorruptCheckpointError, match=re.escape(str(path))):  # damaged, or a checksum
            plugin.load_checkpoint(path)
    torch.save({"w": torch.ones(2)}, path)  # a torch.save file still loads
    assert torch.equal(plugin.load_checkpoint(path)["w"], torch.ones(2))
    torch.save([torch.ones(2)], path)  # but no more than an aiosnap file when it is no checkpoint dict
    with pytest.raises(TypeError, match=f"{re.escape(str(path))}: holds a list, not a Lightning checkpoint dict"):
        plugin.load_checkpoint(path)
    plugin.teardown()


def test_a_compressed_entry_is_never_expanded_to_tell_a_placeholder(tmp_path: Path) -> None:
    # a small file shaped like a placeholder whose message entry is LZMA: 8 MiB once expanded
    whole = zipfile.ZipFile(io.BytesIO(placeholder_bytes(1)))
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w") as archive:
        for info in whole.infolist():
            data = whole.read(info) + (b" " * 8 * 1024**2 if info.filename.endswith("byteorder") else b"")
            archive.writestr(info.filename, data, compress_type=zipfile.ZIP_LZMA)
    assert len(bomb.getvalue()) < MAX_PLACEHOLDER_BYTES
    tracemalloc.start()
    try:
        assert placeholder_message(bomb.getvalue()) is None  # only stored entries are read
        assert tracemalloc.get_traced_memory()[1] < 1024**2
    finally:
        tracemalloc.stop()


def test_fit_resumes_from_a_checkpoint_served_over_http(
    tmp_path: Path, config: Config, served: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, url = served
    torch.manual_seed(0)
    straight = LossLog()
    trainer(4, None, [straight], tmp_path / "plain").fit(Regressor(), loader())
    torch.manual_seed(0)
    keep = ModelCheckpoint(dirpath=folder, filename="half", save_top_k=-1, every_n_epochs=2)
    trainer(2, AiosnapCheckpointIO(config), [keep], tmp_path).fit(Regressor(), loader())
    downloads = tmp_path / "tmp"
    downloads.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(downloads))

    resumed = LossLog()
    trainer(4, AiosnapCheckpointIO(config, allow_pickle=True), [resumed], tmp_path).fit(
        Regressor(), loader(), ckpt_path=f"{url}/half.ckpt"
    )
    assert sorted(resumed.losses) == [s for s in sorted(straight.losses) if s > 8]
    assert all(resumed.losses[s] == straight.losses[s] for s in resumed.losses)
    assert os.listdir(downloads) == []  # the copy it loaded from is gone

    plugin = AiosnapCheckpointIO(config)
    plugin.save_checkpoint({"w": torch.ones(2), "odd": {1, 2}}, folder / "pickled.ckpt")
    wait_for_checkpoint(folder / "pickled.ckpt")  # the server reads the file: nothing of ours waits there
    with pytest.raises(PickleNotAllowedError):  # a pickled object in it: only with the opt-in
        plugin.load_checkpoint(f"{url}/pickled.ckpt")
    assert AiosnapCheckpointIO(config, allow_pickle=True).load_checkpoint(f"{url}/pickled.ckpt")["odd"] == {1, 2}
    with pytest.raises(FileNotFoundError, match="missing.ckpt") as missing:
        plugin.load_checkpoint(url.replace("http://", "http://user:s3cret@") + "/missing.ckpt")
    assert "s3cret" not in str(missing.value) and "user:***@" in str(missing.value)  # no password in messages
    plugin.save_checkpoint({"w": torch.arange(20_000.0)}, folder / "w.ckpt")
    wait_for_checkpoint(folder / "w.ckpt")
    assert torch.equal(plugin.load_checkpoint(f"{url}/w.ckpt")["w"], torch.arange(20_000.0))
    data = bytearray((folder / "w.ckpt").read_bytes())
    data[data.find(torch.tensor([123.0]).numpy().tobytes())] ^= 0x01  # one bit of one float
    (folder / "w.ckpt").write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError):  # read verified, unlike torch.load
        plugin.load_checkpoint(f"{url}/w.ckpt")
    data[-30] ^= 0xFF  # and its trailer damaged too: never read unverified instead
    (folder / "w.ckpt").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="w.ckpt.*damaged"):
        plugin.load_checkpoint(f"{url}/w.ckpt")
    torch.save({"w": torch.ones(2)}, folder / "plain.pt")  # not aiosnap's: torch.load, weights only
    assert torch.equal(plugin.load_checkpoint(f"{url}/plain.pt")["w"], torch.ones(2))
    plugin.teardown()


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def test_failed_downloads_say_so_and_no_message_shows_a_secret(
    served: tuple[Path, str], config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    folder, url = served
    host = url.removeprefix("http://")
    (folder / "pending.ckpt").write_bytes(placeholder_bytes(4242))  # a first save in flight there
    cases: list[tuple[str, type[BaseException], str]] = [
        (f"http://alice:S3CRET@{host}/pending.ckpt", FileNotFoundError, re.escape("alice:***@")),
        (f"http://ghp_S3CRET@{host}/missing.ckpt", FileNotFoundError, re.escape("http://***@")),  # a token
        (
            f"http://{host}/missing.ckpt?X-Amz-Signature=S3CRET&X-Amz-Date=1",
            FileNotFoundError,
            re.escape("missing.ckpt?***"),
        ),
        (f"http://alice:S3CRET@{host}/status-500.ckpt", StorageError, "downloading .*status-500.ckpt.*500"),
        (f"http://{host}/status-403.ckpt?token=S3CRET", StorageError, "downloading .*status-403.ckpt.*403"),
        (f"http://alice:S3CRET@{host}/short.ckpt", StorageError, "downloading .*short.ckpt"),
        (
            f"http://{host}/unended.ckpt#S3CRET",
            CorruptCheckpointError,
            "downloaded from .*" + re.escape("unended.ckpt#***"),
        ),
    ]
    plugin = AiosnapCheckpointIO(config)
    for where, error, says in cases:
        with pytest.raises(error, match=says) as raised:
            plugin.load_checkpoint(where)
        assert not any("S3CRET" in str(e) for e in _chain(raised.value)), where
    assert not any("S3CRET" in r.getMessage() for r in caplog.records)
    plugin.teardown()


def test_urls_aiosnap_does_not_store_go_through_fsspec(config: Config) -> None:
    plugin = AiosnapCheckpointIO(config)
    url = "memory://aiosnap-test/run/epoch=0.ckpt"
    plugin.save_checkpoint({"w": torch.ones(4), "global_step": 2}, url, storage_options=None)
    assert plugin.load_checkpoint(url)["global_step"] == 2
    plugin.remove_checkpoint(url)
    plugin.teardown()
    with pytest.raises(FileNotFoundError, match="epoch=0.ckpt"):
        plugin.load_checkpoint(url)
    plugin.teardown()
