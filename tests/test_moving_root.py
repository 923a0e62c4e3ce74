"""Reading a root that another process changes meanwhile: it commits a newer step and its
retention (``keep_last: 1``) deletes the one being looked up or loaded. ``load_latest()`` then
loads the newer step (never None, never "no committed checkpoint", never "corrupt"); a load of
an explicit step that is deleted under it is "not found", not "corrupt". The other process is
played by real file moves on the real root, at the exact request where the race bites (a real
second process hits it in a few of thousands of tries). Also: a "not committed" answer costs
one request (the steps that are committed are listed only for a person to read), and
``load_latest`` returns the step that it loaded itself, whatever other threads load meanwhile.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import CheckpointNotFoundError, Config, CorruptCheckpointError, SyncCheckpointer
from aiosnap.catalog.steps import committed_save_id, latest_committed, manifest_of
from aiosnap.core.names import manifest_name, step_dir
from aiosnap.storage.local import LocalStorage
from tests.conftest import FaultyStorage


class _MovingRoot(FaultyStorage):
    """A real local root where "another process" commits step 2 and deletes step 1 right
    after the request that ``when(op, name)`` picks (once); every request is counted."""

    def __init__(
        self, root: Path, newer: Path, when: Callable[[str, str], bool], then: Callable[[], None] | None = None
    ) -> None:
        super().__init__(LocalStorage(root))
        self.root, self.newer, self.when = root, newer, when
        self.then = then or self._commit_2_and_retain_1
        self.requests: dict[str, int] = {}
        self.moved = False

    def _commit_2_and_retain_1(self) -> None:
        shutil.move(self.newer / step_dir(2), self.root / step_dir(2))  # committed elsewhere, whole
        shutil.rmtree(self.root / step_dir(1))  # its retention: keep_last 1

    def _after(self, op: str, name: str) -> None:
        self.requests[op] = self.requests.get(op, 0) + 1
        if not self.moved and self.when(op, name):
            self.moved = True
            self.then()

    async def list_children(self, prefix: str = "") -> list[str]:
        found = await super().list_children(prefix)
        self._after("list", prefix)
        return found

    async def exists(self, name: str) -> bool:
        found = await super().exists(name)
        self._after("exists", name)
        return found

    async def read(self, name: str, *, limit: int | None = None) -> bytes:
        data = await super().read(name, limit=limit)
        self._after("read", name)
        return data


def _two_roots(tmp_path: Path) -> tuple[Path, Path]:
    """``root`` holds step 1 (all 1.0); ``newer`` holds step 2 (all 2.0), to be moved in."""
    root, newer = tmp_path / "root", tmp_path / "newer"
    for folder, step in ((root, 1), (newer, 2)):
        with SyncCheckpointer({"storage": {"url": str(folder)}, "ram_budget": "1MiB"}) as ckpt:
            ckpt.save({"w": torch.full((64,), float(step))}, step=step).wait()
    return root, newer


RACES = {
    "after the listing": lambda op, name: op == "list",
    "between the HEAD and the GET of the manifest": lambda op, name: op == "exists",
    "after the manifest was read, before the data": lambda op, name: op == "read" and name == manifest_name(1),
}


@pytest.mark.parametrize("race", list(RACES))
def test_load_latest_loads_the_newer_step_when_retention_deletes_the_one_it_found(tmp_path: Path, race: str) -> None:
    root, newer = _two_roots(tmp_path)
    moving = _MovingRoot(root, newer, RACES[race])
    state = {"w": torch.zeros(64)}
    with SyncCheckpointer({"storage": {"url": str(root)}, "ram_budget": "1MiB"}, storage=moving) as ckpt:
        assert ckpt.load_latest(state) == 2
        assert moving.moved and ckpt.loaded_step == 2
    assert torch.equal(state["w"], torch.full((64,), 2.0))


def test_a_step_deleted_while_it_loads_is_not_found_not_corrupt(tmp_path: Path) -> None:
    root, newer = _two_roots(tmp_path)
    moving = _MovingRoot(root, newer, RACES["after the manifest was read, before the data"])
    with (
        SyncCheckpointer({"storage": {"url": str(root)}, "ram_budget": "1MiB"}, storage=moving) as ckpt,
        pytest.raises(CheckpointNotFoundError, match=r"step 1 .*removed while .*the committed steps are 2$"),
    ):
        ckpt.load({"w": torch.zeros(64)}, step=1)
    assert moving.moved


@pytest.mark.parametrize("step", [None, 1])
def test_a_step_damaged_while_it_loads_stays_damaged(tmp_path: Path, step: int | None) -> None:
    """Its data gone and its manifest garbage: no removal, a damaged checkpoint (never "not
    found", never another step)."""
    root, newer = _two_roots(tmp_path)

    def damage() -> None:
        for data in (root / step_dir(1)).rglob("*.bin"):
            data.unlink()
        (root / manifest_name(1)).write_text("{ not json")

    moving = _MovingRoot(root, newer, RACES["after the manifest was read, before the data"], damage)
    with (
        SyncCheckpointer({"storage": {"url": str(root)}, "ram_budget": "1MiB"}, storage=moving) as ckpt,
        pytest.raises(CorruptCheckpointError, match="data object .* is missing"),
    ):
        ckpt.load({"w": torch.zeros(64)}, step=step)
    assert moving.moved


async def test_the_latest_is_looked_up_again_when_the_listing_changed(tmp_path: Path) -> None:
    root, newer = _two_roots(tmp_path)
    moving = _MovingRoot(root, newer, RACES["after the listing"])
    assert await latest_committed(moving) == 2
    assert moving.requests["list"] == 2  # the second listing differs: the first was out of date
    assert (await manifest_of(moving, None)).step == 2
    root, newer = _two_roots(tmp_path / "again")
    moving = _MovingRoot(root, newer, RACES["between the HEAD and the GET of the manifest"])
    assert (await manifest_of(moving, None)).step == 2  # step 1's manifest went after its HEAD


async def test_a_root_without_commits_is_listed_twice_at_most(tmp_path: Path) -> None:
    (tmp_path / "root" / step_dir(3) / "0123456789abcdef").mkdir(parents=True)  # a crashed save
    counted = _MovingRoot(tmp_path / "root", tmp_path, lambda op, name: False)
    assert await latest_committed(counted) is None
    assert counted.requests == {"list": 2, "exists": 2}  # the same listing twice, no manifest either time


async def test_not_committed_costs_one_request_and_survives_a_failing_listing(tmp_path: Path) -> None:
    root, newer = _two_roots(tmp_path)
    counted = _MovingRoot(root, newer, lambda op, name: False)
    assert await committed_save_id(counted, 5) is None
    assert counted.requests == {}  # one read, which failed (not found): no listing, no HEADs

    class ListingFails(_MovingRoot):
        async def list_children(self, prefix: str = "") -> list[str]:
            raise OSError("LIST throttled")

    failing = ListingFails(root, newer, lambda op, name: False)
    assert await committed_save_id(failing, 5) is None  # the answer needs no listing
    with pytest.raises(CheckpointNotFoundError, match=r"step 5 has no committed checkpoint in .*could not be listed"):
        await manifest_of(failing, 5)  # a person's message: the list is left out, the error stays


def test_load_latest_returns_the_step_it_loaded_whatever_other_threads_load(tmp_path: Path) -> None:
    """Thread B's load of step 1 finishes right after thread A's load of the latest (2) set
    the checkpointer's ``loaded_step``: A still gets 2, the step whose values its state holds."""
    a_loaded, b_done = threading.Event(), threading.Event()

    class Interleaved(SyncCheckpointer):
        @property
        def _loaded_step(self) -> int | None:
            return self.__dict__.get("_step")

        @_loaded_step.setter
        def _loaded_step(self, step: int | None) -> None:
            self.__dict__["_step"] = step
            if threading.current_thread().name == "A" and step is not None:
                a_loaded.set()
                assert b_done.wait(30)  # B's load completes here

    config = Config(storage={"url": str(tmp_path / "root")}, ram_budget="1MiB")
    with SyncCheckpointer(config) as ckpt:
        for step in (1, 2):
            ckpt.save({"w": torch.full((4,), float(step))}, step=step).wait()
    got: dict[str, Any] = {}
    with Interleaved(config) as ckpt:

        def thread_a() -> None:
            state = {"w": torch.zeros(4)}
            got["step"], got["values"] = ckpt.load_latest(state), state["w"].tolist()

        def thread_b() -> None:
            assert a_loaded.wait(30)
            ckpt.load({"w": torch.zeros(4)}, step=1)
            b_done.set()

        threads = [threading.Thread(target=thread_b), threading.Thread(target=thread_a, name="A")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert got == {"step": 2, "values": [2.0] * 4}
