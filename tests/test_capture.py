"""save() captures: what is saved is the state at the call, whatever training does next."""

from __future__ import annotations

import itertools
import mmap

import pytest
import torch
from aiosnap import Config, SyncCheckpointer
from aiosnap.core.arena import Arena
from aiosnap.core.budget import ByteBudget
from aiosnap.errors import UnsupportedStateError
from aiosnap.trainer.slabs import SlabPool
from tests.conftest import FaultyStorage


def test_tensors_mutated_after_save_returns_keep_old_values(small_config: Config, faulty: FaultyStorage) -> None:
    small = torch.arange(10, dtype=torch.float32)
    large = torch.randn(200_000)  # 800 KB: many 64 KiB chunks, more than the 1 MiB budget holds at once
    expected_small, expected_large = small.clone(), large.clone()
    faulty.delay = 0.01  # storage lags behind capture
    with SyncCheckpointer(small_config, storage=faulty) as ckpt:
        handle = ckpt.save({"small": small, "large": large}, step=1)
        small.add_(1)  # training goes on, in place
        large.mul_(-1)
        handle.wait()
        restored = ckpt.load()
    assert torch.equal(restored["small"], expected_small)
    assert torch.equal(restored["large"], expected_large)


def test_model_and_optimizer_mutated_by_training_after_save(small_config: Config) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 256)).sum().backward()
    optim.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    avg_before = optim.state_dict()["state"][0]["exp_avg"].clone()
    with SyncCheckpointer(small_config) as ckpt:
        handle = ckpt.save({"model": model, "optim": optim}, step=1)
        for _ in range(3):
            optim.zero_grad()
            model(torch.randn(8, 256)).sum().backward()
            optim.step()
        handle.wait()
        restored = ckpt.load()
    for key, value in before.items():
        assert torch.equal(restored["model"][key], value)
    assert torch.equal(restored["optim"]["state"][0]["exp_avg"], avg_before)
    assert not torch.equal(model.weight, before["weight"])  # training really did move on


async def test_the_pool_lends_the_lowest_free_slab_so_only_what_was_needed_at_once_is_resident() -> None:
    """Slabs come back in any order; lending the lowest free one keeps the slabs ever
    written (the resident part of the arena) to as many as were lent at once."""
    arena = Arena(64 * 1024, 8, shared=False)
    pool = SlabPool(arena, ByteBudget(arena.size, "ram_budget"))
    try:
        first = [await pool.acquire() for _ in range(3)]
        assert first == [0, 1, 2]
        pool.release(2)
        pool.release(0)
        assert [await pool.acquire(), pool.try_acquire()] == [0, 2]
        for slab in (0, 1, 2):
            pool.release(slab)
        for _ in range(20):  # save after save of a state of two slabs: the same two slabs
            pair = [await pool.acquire(), await pool.acquire()]
            assert pair == [0, 1]
            pool.release(pair[1])
            pool.release(pair[0])
        assert pool.budget.high_water == 3 * arena.slab_bytes
    finally:
        pool.close()
        arena.close()


def test_a_tensor_whose_storage_was_shrunk_is_refused_not_read_past_its_end(small_config: Config) -> None:
    """``untyped_storage().resize_(16)`` leaves the view as it was: capture memmoved its
    nbytes from a 16-byte allocation (heap bytes saved, or a crash)."""
    shrunk = torch.randn(1000)
    shrunk.untyped_storage().resize_(16)
    strided = torch.randn(100, 8)[:, ::2]  # a strided view: its extent is past numel (refused by the copier)
    strided.untyped_storage().resize_(100 * 8 * 4 - 8)
    with SyncCheckpointer(small_config) as ckpt:
        for name, tensor in (("shrunk", shrunk), ("view", strided)):
            with pytest.raises(UnsupportedStateError, match=f"{name}: its storage holds"):
                ckpt.save({"ok": torch.ones(2), name: tensor}, step=1)
        assert ckpt.steps() == []


def test_capture_checks_the_storage_again_when_it_copies() -> None:
    """Shrunk between the plan and the copy (another thread, while save() runs): refused by
    the copier, on both of its paths (one memmove per small piece, torch for the rest)."""
    from aiosnap.core.tensorio import host_address
    from aiosnap.trainer.capture import Copier
    from aiosnap.trainer.plan import make_plan

    small, large = torch.randn(64), torch.randn(300_000)
    plan = make_plan({"small": small, "large": large}, step=1, chunk_bytes=4 * 1024**2)
    assert host_address(small, small.nbytes) != 0
    small.untyped_storage().resize_(16)
    large.untyped_storage().resize_(16)
    assert host_address(small, small.nbytes) == 0 and host_address(small, 16) != 0
    slab = torch.empty(plan.chunks[0].nbytes, dtype=torch.uint8)
    with pytest.raises(UnsupportedStateError, match="small: its storage holds fewer bytes than its view"):
        Copier().copy(plan, plan.chunks[0], slab, None)
    small.untyped_storage().resize_(64 * 4)
    with pytest.raises(UnsupportedStateError, match="large: its storage holds fewer bytes than its view"):
        Copier().copy(plan, plan.chunks[0], slab, None)


async def test_a_held_slab_is_not_lent_again_until_every_hold_ends() -> None:
    arena = Arena(64 * 1024, 2, shared=False)
    pool = SlabPool(arena, ByteBudget(arena.size, "ram_budget"))
    try:
        slab = await pool.acquire()
        pool.hold(slab)
        pool.hold(slab)
        pool.release(slab)  # the transfer side is done with it, a second reader is not
        assert pool.try_acquire() == 1 and pool.try_acquire() is None
        pool.unhold(slab)
        assert pool.try_acquire() is None
        pool.unhold(slab)
        assert pool.try_acquire() == slab and pool.budget.used == arena.size
    finally:
        pool.close()
        arena.close()


async def test_pinning_registers_one_growing_extent_as_slabs_are_first_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registration arithmetic, with CUDA's runtime replaced by a recorder (this machine
    may have no GPU; tests/test_gpu.py pins for real): extents start where the last one
    ended, on page boundaries, and cover the slabs written, not the budget."""
    calls: list[tuple[str, int, int]] = []

    class Runtime:
        def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
            calls.append(("register", address, size))
            return 0

        def cudaHostUnregister(self, address: int) -> int:
            calls.append(("unregister", address, 0))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    arena = Arena(64 * 1024 + 64, 8, shared=False)  # slabs that are not whole pages
    pool = SlabPool(arena, ByteBudget(arena.size, "ram_budget"))
    base = pool.tensor(0).data_ptr()
    try:
        pool.ready(0)
        assert calls == []  # not pinned: nothing to register
        pool.pin()
        slabs = [await pool.acquire() for _ in range(3)]
        for slab in slabs:
            pool.ready_for(pool.tensor(slab)[10:])
        pool.ready(1)  # already covered
        extents = [(address - base, size) for kind, address, size in calls]
        assert [kind for kind, _, _ in calls] == ["register"] * 3
        assert extents[0][0] == 0
        for (start, size), (following, _) in itertools.pairwise(extents):
            assert following == start + size
        assert all(start % mmap.PAGESIZE == 0 and size % mmap.PAGESIZE == 0 for start, size in extents)
        end = extents[-1][0] + extents[-1][1]
        assert 3 * arena.slab_bytes <= end < 3 * arena.slab_bytes + mmap.PAGESIZE < arena.size
    finally:
        pool.close()
        arena.close()
    assert sorted(a for kind, a, _ in calls if kind == "unregister") == sorted(base + s for s, _ in extents)
