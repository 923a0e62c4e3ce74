"""ByteBudget: byte-weighted, FIFO-fair, bounded, cancellation-safe."""

from __future__ import annotations

import asyncio

import pytest
from aiosnap.core.budget import ByteBudget


async def test_reserve_and_release_track_high_water() -> None:
    budget = ByteBudget(100)
    async with budget.reserve(60):
        assert budget.used == 60
        async with budget.reserve(40):
            assert budget.used == 100
    assert budget.used == 0 and budget.high_water == 100


async def test_request_larger_than_budget_fails_at_once() -> None:
    with pytest.raises(ValueError, match="exceeds the whole budget"):
        await ByteBudget(10, "ram_budget").acquire(11)


async def test_fifo_a_large_waiter_is_not_starved_by_small_ones() -> None:
    budget = ByteBudget(100)
    await budget.acquire(90)
    order: list[str] = []

    async def take(name: str, n: int) -> None:
        await budget.acquire(n)
        order.append(name)

    big = asyncio.create_task(take("big", 80))
    await asyncio.sleep(0)
    small = asyncio.create_task(take("small", 5))  # would fit now, but must queue behind big
    await asyncio.sleep(0.01)
    assert order == [] and not budget.try_acquire(1)
    budget.release(90)
    await asyncio.gather(big, small)
    assert order == ["big", "small"] and budget.used == 85


async def test_cancelled_waiter_gives_way() -> None:
    budget = ByteBudget(10)
    await budget.acquire(10)
    waiter = asyncio.create_task(budget.acquire(8))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    budget.release(10)
    assert budget.try_acquire(10)
    assert budget.used == 10


def test_over_release_is_a_bug() -> None:
    with pytest.raises(RuntimeError):
        ByteBudget(10).release(1)
