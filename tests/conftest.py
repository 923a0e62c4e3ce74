"""Shared fixtures: temporary checkpoint roots, a storage wrapper that fails on cue, models."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Config
from aiosnap.storage.base import BytesLike, Storage
from aiosnap.storage.local import LocalStorage


class FaultyStorage(Storage):
    """Wraps a real backend; writes whose name matches ``fail_when`` raise ``error``.

    ``delay`` seconds are slept before every write (a slow target), and ``gate`` (an
    asyncio.Event created lazily on the loop) can hold writes until a test opens it.
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
        self.fail_when = fail_when
        self.error = error
        self.delay = delay
        self.writes: list[str] = []
        self.held = False
        self._gate: asyncio.Event | None = None

    def hold(self) -> None:
        self.held = True

    def release(self, loop: asyncio.AbstractEventLoop) -> None:
        self.held = False
        if self._gate is not None:
            loop.call_soon_threadsafe(self._gate.set)

    async def write(self, name: str, data: BytesLike) -> None:
        if self.held:
            self._gate = self._gate or asyncio.Event()
            await self._gate.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail_when is not None and self.fail_when(name):
            assert self.error is not None
            raise self.error
        self.writes.append(name)
        await self.inner.write(name, data)

    async def read(self, name: str) -> bytes:
        return await self.inner.read(name)

    async def read_into(self, name: str, offset: int, dest: memoryview) -> int:
        return await self.inner.read_into(name, offset, dest)

    async def exists(self, name: str) -> bool:
        return await self.inner.exists(name)

    async def list_children(self, prefix: str = "") -> list[str]:
        return await self.inner.list_children(prefix)

    async def delete(self, name: str) -> None:
        await self.inner.delete(name)

    async def delete_prefix(self, prefix: str) -> None:
        await self.inner.delete_prefix(prefix)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def small_config(root: Path) -> Config:
    """Small chunks and budget so that every test crosses chunk boundaries."""
    return Config(storage={"url": str(root)}, ram_budget="1MiB", upload={"chunk_size": "64KiB", "concurrency": 4})


@pytest.fixture
def faulty(root: Path) -> FaultyStorage:
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
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
