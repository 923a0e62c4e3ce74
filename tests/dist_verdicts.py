"""Scenarios of :mod:`test_rank_verdicts`: ranks, upload helpers and coordinators that stop,
slow down or lose a race, and what every rank is told. Run by :mod:`dist_child` (which looks
scenarios up here too), one rank per process.

Each returns, per step it tried, ``[outcome, seconds]``: ``"committed"`` or ``"Type: message"``
and the time from ``save()`` to the verdict on this rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import torch

from dist_child import arange, config


def _outcome(handle: Any, started: float, timeout: float = 60) -> list[Any]:
    try:
        handle.wait(timeout=timeout)
        found = "committed"
    except Exception as exc:
        found = f"{type(exc).__name__}: {exc}"
    return [found, time.monotonic() - started]


def _state(step: int, rank: int) -> dict[str, Any]:
    """Two tensors of known values (each rank writes one of them) and a rank-local value."""
    return {"w": arange([128, 64], base=float(step)), "v": arange([128, 64], base=-float(step)), "me": rank}


def _matches(loaded: dict[str, Any], step: int, rank: int) -> bool:
    expected = _state(step, rank)
    return bool(
        torch.equal(loaded["w"], expected["w"]) and torch.equal(loaded["v"], expected["v"]) and loaded["me"] == rank
    )


def _step_of(name: str) -> int | None:
    head = name.split("/", 1)[0]
    return int(head) if head.isdigit() else None


async def _until(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _verify_all(ckpt: Any, rank: int) -> dict[str, bool]:
    return {str(s): _matches(ckpt.load(step=s), s, rank) for s in ckpt.steps()}


def slow_coordinator_and_retention(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """keep_last 1 and four saves in flight, the follower's looks at step 1 so slow that
    retention has removed it by then; then a coordinator whose upload outlasts the
    follower's old deadline (commit_timeout + grace after its part); then, one save in flight
    at most, a coordinator whose retention takes longer than a heartbeat timeout while its
    next save waits for a slot (the follower, one save further, must not take it for stopped)."""
    import aiosnap
    from aiosnap.storage.local import LocalStorage

    root = Path(params["root"])
    flags: dict[str, Any] = {}

    class Slow(LocalStorage):
        async def _slow_look(self, name: str) -> None:
            if rank == 1 and name == "000000000001/manifest.json" and flags.get("part1") and not flags.get("looked"):
                flags["looked"] = True  # its first look after delivering: retention was quicker
                await _until(lambda: not (root / name).exists() and any(root.glob("*/manifest.json")), 15)

        async def exists(self, name: str) -> bool:
            await self._slow_look(name)
            return await super().exists(name)

        async def read(self, name: str, *, limit: int | None = None) -> bytes:
            await self._slow_look(name)
            return await super().read(name, limit=limit)

        async def delete_prefix(self, prefix: str) -> None:
            if rank == 0 and _step_of(prefix) == 11:
                await asyncio.sleep(params["retention_delay"])  # a slow store, a large step
            await super().delete_prefix(prefix)

        async def write(self, name: str, data: Any, *, if_absent: bool = False) -> None:
            if rank == 0 and _step_of(name) == 10 and name.endswith(".bin"):
                await asyncio.sleep(params["coordinator_delay"])  # a slow coordinator
            await super().write(name, data, if_absent=if_absent)
            if rank == 1 and name.startswith("000000000001/") and name.endswith(".part.json"):
                flags["part1"] = True

    cfg = config(str(root), commit_timeout=params["commit_timeout"], **params.get("timers", {}))
    cfg.update(retention={"keep_last": 1}, max_pending_saves=4)
    # whole saves: this test times each rank's part of four pipelined saves; an incremental
    # save waits for the saves before it to commit (its base), which the slow looks delay
    cfg["upload"] = {**cfg["upload"], "dedup": False}
    result: dict[str, Any] = {}
    with aiosnap.SyncCheckpointer(cfg, storage=Slow(str(root))) as ckpt:
        started = time.monotonic()
        handles = [(s, ckpt.save(_state(s, rank), step=s, rank_local=["me"])) for s in (1, 2, 3, 4)]
        for step, handle in handles:
            result[str(step)] = _outcome(handle, started)
        for step in (10, 11):
            started = time.monotonic()
            result[str(step)] = _outcome(ckpt.save(_state(step, rank), step=step, rank_local=["me"]), started)
    cfg.update(max_pending_saves=1)
    with aiosnap.SyncCheckpointer(cfg, storage=Slow(str(root))) as ckpt:
        started = time.monotonic()
        handles = [(s, ckpt.save(_state(s, rank), step=s, rank_local=["me"])) for s in (20, 21)]
        for step, handle in handles:
            result[str(step)] = _outcome(handle, started)
        # a follower's wait ends when it sees the commit; the coordinator's, after its retention
        torch.distributed.barrier()  # (which may remove step 20 while a follower lists or loads it)
        result["steps"] = ckpt.steps()
        result["loads"] = _verify_all(ckpt, rank)
    return result


def vanish_after_save(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """Step 1 commits; rank ``victim`` is killed (``how``: "kill") or stopped ("stop": a
    wedged process, SIGKILLed by the other rank once it has its verdict) right after its
    ``save()`` of step 2 returned (its spool, mode always, keeps the captured save)."""
    import signal

    import aiosnap

    victim = params["victim"]
    cfg = config(params["root"], commit_timeout=params["commit_timeout"], **params.get("timers", {}))
    if rank == victim:
        cfg["spool"] = {"dir": f"{work}/spool-{rank}", "mode": "always"}
    ckpt = aiosnap.SyncCheckpointer(cfg)
    ckpt.save(_state(1, rank), step=1, rank_local=["me"]).wait(timeout=40)
    started = time.monotonic()
    handle = ckpt.save(_state(2, rank), step=2, rank_local=["me"])
    stopped = Path(work) / "stopped.pid"
    if rank == victim:
        if params["how"] == "stop":
            stopped.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread of this rank stops: wedged
        os._exit(9)
    result: dict[str, Any] = {"2": _outcome(handle, started, timeout=params["wait"])}
    if stopped.exists():
        os.kill(int(stopped.read_text()), signal.SIGKILL)
    result["steps"] = ckpt.steps()
    with contextlib.suppress(Exception):
        ckpt.close(timeout=5)
    return result


def helper_deaths(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """upload.executor process. Step 2: rank 1's helper dies before its part; step 3: rank
    1's helper dies after its part landed; step 4: rank 0's (the coordinator's) helper dies
    during its upload; step 5: nothing happens."""
    import aiosnap
    from tests.process_faults import RankFaults

    marks = Path(work) / "marks"
    marks.mkdir(exist_ok=True)
    plan = {1: {2: "hang_data", 3: "wedge_after_part", 6: "wedge_after_part"}, 0: {4: "hang_data", 6: "slow_data"}}[
        rank
    ]
    storage = RankFaults(params["root"], rank, {str(k): v for k, v in plan.items()}, str(marks))
    cfg = config(
        params["root"], executor="process", commit_timeout=params["commit_timeout"], **params.get("timers", {})
    )
    result: dict[str, Any] = {}
    with aiosnap.SyncCheckpointer(cfg, storage=storage) as ckpt:
        ckpt.save(_state(1, rank), step=1, rank_local=["me"]).wait(timeout=40)
        for step in (2, 3, 4, 5):
            started = time.monotonic()
            handle = ckpt.save(_state(step, rank), step=step, rank_local=["me"])
            action = plan.get(step)
            if action is not None:
                mark = marks / f"{action}-{rank}-{step}"
                deadline = time.monotonic() + 20
                while not mark.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
                os.kill(ckpt._engine.transfer.pid, 9)  # the helper dies; the trainer lives on
            result[str(step)] = _outcome(handle, started)
        result["steps"] = ckpt.steps()
        result["loads"] = _verify_all(ckpt, rank)
        result.update(_close_while_helper_wedged(ckpt, rank, marks))
    return result


def _close_while_helper_wedged(ckpt: Any, rank: int, marks: Path) -> dict[str, Any]:
    """Step 6: rank 1's helper wedges after its part landed, the coordinator is slow (its
    data takes RankFaults.SLOW_S), and rank 1 calls close(timeout=1)."""
    import aiosnap.runtime.savejob

    started = time.monotonic()
    handle = ckpt.save(_state(6, rank), step=6, rank_local=["me"])
    if rank == 0:
        return {"6": _outcome(handle, started)}
    deadline = time.monotonic() + 20
    while not (marks / "wedge_after_part-1-6").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    aiosnap.runtime.savejob.ABORT_GRACE_S = 2.0  # (10 s by default) before the wedged helper is killed
    closing = time.monotonic()
    try:
        ckpt.close(timeout=1)
        closed = "returned"
    except Exception as exc:
        closed = f"{type(exc).__name__}: {exc}"
    return {"close": [closed, time.monotonic() - closing], "6": _outcome(handle, started, timeout=1)}


def gc_during_save(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """While rank 1's data of step 1 waits, ``aiosnap gc --grace 0`` runs on the root; in
    step 2, one of the coordinator's objects is deleted behind its back before it commits; in
    step 3, rank 1's part cannot be written (a full disk)."""
    import aiosnap
    from aiosnap.catalog.garbage import collect_garbage
    from aiosnap.storage.local import LocalStorage

    root = Path(params["root"])
    done: set[int] = set()
    seen: dict[str, Any] = {}

    class Meddled(LocalStorage):
        async def write(self, name: str, data: Any, *, if_absent: bool = False) -> None:
            step = _step_of(name)
            if rank == 1 and step == 3 and name.endswith(".part.json"):
                raise OSError(28, "No space left on device (injected)")
            if rank == 1 and name.endswith(".bin") and step in (1, 2) and step not in done:
                done.add(step)
                theirs = root / name.split("/rank-")[0] / "rank-0"
                await _until(lambda: any(theirs.glob("*.bin")), 20)
                await asyncio.sleep(0.3)  # the coordinator is waiting for this rank's part
                if step == 1:
                    report = await collect_garbage(LocalStorage(root), keep_last=10, grace_s=0)
                    seen["gc_removed"] = report.removed_incomplete
                else:
                    victim = sorted(theirs.glob("*.bin"))[0]
                    seen["deleted"] = victim.relative_to(root).as_posix()
                    victim.unlink()
            await super().write(name, data, if_absent=if_absent)

    cfg = config(str(root), commit_timeout=params["commit_timeout"], **params.get("timers", {}))
    result: dict[str, Any] = {}
    with aiosnap.SyncCheckpointer(cfg, storage=Meddled(str(root))) as ckpt:
        for step in (1, 2, 3):
            started = time.monotonic()
            result[str(step)] = _outcome(ckpt.save(_state(step, rank), step=step, rank_local=["me"]), started)
        result["steps"] = ckpt.steps()
        result["loads"] = _verify_all(ckpt, rank)
    result.update(seen)
    return result


def shared_spool_and_load_agreement(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """Both ranks given one spool.dir; then a load of the latest step while another job's
    re-save of it lands between rank 0's read of its manifest and rank 1's."""
    import aiosnap
    from aiosnap.storage.local import LocalStorage

    result: dict[str, Any] = {}
    shared = config(params["root"], agree_timeout=params["agree_timeout"])
    shared["spool"] = {"dir": f"{work}/one-spool", "mode": "overflow"}
    started = time.monotonic()
    try:
        aiosnap.SyncCheckpointer(shared).close()
        result["shared_spool"] = ["constructed", time.monotonic() - started]
    except Exception as exc:
        result["shared_spool"] = [f"{type(exc).__name__}: {exc}", time.monotonic() - started]

    root = Path(params["root"])
    manifest = "000000000005/manifest.json"
    read_by_0 = Path(work) / "rank-0-read-the-manifest"
    swapped: list[bool] = []

    class Racing(LocalStorage):
        async def read(self, name: str, *, limit: int | None = None) -> bytes:
            if name == manifest and rank == 1 and not swapped:
                swapped.append(True)
                await _until(read_by_0.exists, 15)
                os.replace(params["next_manifest"], root / manifest)  # the other job's re-save lands
            data = await super().read(name, limit=limit)
            if name == manifest and rank == 0:
                read_by_0.touch()
            return data

    cfg = config(str(root), agree_timeout=params["agree_timeout"])
    with aiosnap.SyncCheckpointer(cfg, storage=Racing(str(root))) as ckpt:
        try:
            loaded = ckpt.load({"w": torch.zeros(64)})
            result["load"] = loaded["w"][0].item()
        except Exception as exc:
            result["load"] = f"{type(exc).__name__}: {exc}"
    return result


def s3_losing_writer(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """Step 1 commits; another writer commits step 2 just before this job's coordinator
    writes its manifest (a definite If-None-Match refusal)."""
    import aiosnap
    from aiosnap.config import S3Config
    from aiosnap.storage.s3 import S3Storage

    competing = Path(params["competing"]).read_bytes()

    class Racing(S3Storage):
        async def write(self, name: str, data: Any, *, if_absent: bool = False) -> None:
            if rank == 0 and name == "000000000002/manifest.json":
                await super().write(name, competing, if_absent=True)  # the other writer is first
            await super().write(name, data, if_absent=if_absent)

    bucket, prefix = params["root"][len("s3://") :].split("/", 1)
    storage = Racing(bucket, prefix, S3Config(**params["s3"]))
    cfg = config(params["root"], params["s3"], commit_timeout=params["commit_timeout"], **params.get("timers", {}))
    result: dict[str, Any] = {}
    with aiosnap.SyncCheckpointer(cfg, storage=storage) as ckpt:
        for step in (1, 2):
            started = time.monotonic()
            result[str(step)] = _outcome(ckpt.save(_state(step, rank), step=step, rank_local=["me"]), started)
        result["steps"] = ckpt.steps()
        result["loads"] = {"1": _matches(ckpt.load(step=1), 1, rank)}
    return result


def soak_state(step: int, rank: int) -> dict[str, Any]:
    """What a rank of the multi-rank soak holds at ``step``: replicated values, and a rank-local one."""
    generator = torch.Generator().manual_seed(step)
    mine = torch.Generator().manual_seed(100_000 * rank + step)
    return {
        "w": torch.randn(40_000, generator=generator),
        "b": torch.randint(0, 1000, (333,), generator=generator, dtype=torch.int32),
        "mine": {"noise": torch.randn(1000, generator=mine), "rank": rank},
        "meta": {"step": step},
    }


def soak_job(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """One job of the multi-rank soak (tests/soak_ranks.py): check that every listed step
    loads bit-exact on this rank, then save ``steps``, rank ``victim`` (or its upload helper)
    being killed at ``point`` of the save of ``kill_step``."""
    import aiosnap
    from tests.conftest import assert_same
    from tests.process_faults import KillAt

    victim, point, kill_step = params["victim"], params["point"], params["kill_step"]
    armed = rank == victim and point in ("data", "part", "verdict", "manifest")
    in_helper = params["executor"] == "process"
    storage = KillAt(params["root"], kill_step if armed else None, point if armed else None, in_helper=in_helper)
    cfg = config(params["root"], executor=params["executor"], commit_timeout=30.0, **params["timers"])
    cfg["retention"] = {"keep_last": params["keep_last"]}
    result: dict[str, Any] = {"verified": 0, "bad": [], "outcomes": []}
    with aiosnap.SyncCheckpointer(cfg, storage=storage) as ckpt:
        for step in ckpt.steps() if params["verify"] else []:
            try:
                assert_same(ckpt.load(step=step), soak_state(step, rank))
                result["verified"] += 1
            except Exception as exc:
                result["bad"].append(f"step {step} listed but does not load bit-exact on rank {rank}: {exc!r}")
        for step in params["steps"]:
            started = time.monotonic()
            try:
                handle = ckpt.save(soak_state(step, rank), step=step, rank_local=["mine"])
            except Exception as exc:  # save() itself failed (a helper found dead as it began): reported here
                result["outcomes"].append([step, f"{type(exc).__name__}: {exc}", time.monotonic() - started])
                continue
            if rank == victim and step == kill_step:
                if point == "after_save":
                    os._exit(9)
                if point == "delay":
                    time.sleep(params["delay"])
                    os._exit(9)
                if point == "helper":
                    time.sleep(params["delay"])
                    os.kill(ckpt._engine.transfer.pid, 9)
            result["outcomes"].append([step, *_outcome(handle, started)])
            rank_killed = point in ("after_save", "delay") or (params["executor"] == "thread" and point != "helper")
            if step == kill_step and rank_killed:
                break  # the other rank is gone: this job can save no more
        result["steps"] = ckpt.steps()
    return result


def stall_after_claim_and_failed_lookup(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """Step 2: the coordinator's loop stalls (blocked: no heartbeat either) for longer than
    heartbeat_timeout right after its commit claim landed (a paused machine, a huge manifest
    being serialized); then a load of the latest step whose lookup fails on rank 0 (a store
    error); then every step is loaded."""
    import aiosnap
    from aiosnap.storage.local import LocalStorage

    stall = params["timers"]["heartbeat_timeout"] + 1.5
    armed = {"lookup": False}

    class Stalling(LocalStorage):
        async def write(self, name: str, data: Any, *, if_absent: bool = False) -> None:
            await super().write(name, data, if_absent=if_absent)
            if rank == 0 and _step_of(name) == 2 and name.endswith("/verdict") and b'"commit"' in bytes(data):
                time.sleep(stall)  # noqa: ASYNC251 - the coordinator's loop stalls on purpose

        async def list_children(self, prefix: str = "") -> list[str]:
            if rank == 0 and prefix == "" and armed["lookup"]:
                armed["lookup"] = False
                raise OSError(5, "Input/output error (injected)")
            return await super().list_children(prefix)

    cfg = config(params["root"], commit_timeout=params["commit_timeout"], agree_timeout=params["agree_timeout"],
                 **params["timers"])  # fmt: skip
    result: dict[str, Any] = {}
    with aiosnap.SyncCheckpointer(cfg, storage=Stalling(params["root"])) as ckpt:
        for step in (1, 2):
            started = time.monotonic()
            result[str(step)] = _outcome(ckpt.save(_state(step, rank), step=step, rank_local=["me"]), started)
        armed["lookup"] = True
        started = time.monotonic()
        try:
            ckpt.load({"w": torch.zeros(128, 64)})
            result["lookup"] = ["loaded", time.monotonic() - started]
        except Exception as exc:
            result["lookup"] = [f"{type(exc).__name__}: {exc}", time.monotonic() - started]
        result["steps"] = ckpt.steps()
        result["loads"] = _verify_all(ckpt, rank)
    return result


def local_faults(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """:func:`shared_spool_and_load_agreement` on ``root``, then :func:`gc_during_save` on
    ``gc_root``, then :func:`stall_after_claim_and_failed_lookup` on ``stall_root``: three
    scenarios, one launch of ranks."""
    return {
        "load": shared_spool_and_load_agreement(rank, world, work, params),
        "gc": gc_during_save(rank, world, work, {**params, "root": params["gc_root"]}),
        "stall": stall_after_claim_and_failed_lookup(rank, world, work, {**params, "root": params["stall_root"]}),
    }


def cancelled_lookup(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's ``load()`` is cancelled while it looks up the latest step (a slow listing):
    the other ranks hear of it at once instead of waiting ``agree_timeout``, and the next
    loads of every rank pair up again."""
    import aiosnap
    from aiosnap.storage.local import LocalStorage

    root = params["root"]

    class SlowListing(LocalStorage):
        slow = False

        async def list_children(self, prefix: str = "") -> list[str]:
            if self.slow:
                await asyncio.sleep(2)
            return await super().list_children(prefix)

    storage = SlowListing(root)
    out: dict[str, Any] = {}

    async def main() -> None:
        async with aiosnap.Checkpointer(config(root, agree_timeout=30), storage=storage) as ckpt:
            await (await ckpt.save({"w": torch.arange(4.0)}, step=3))
            storage.slow = rank == 0
            started = time.monotonic()
            try:
                if rank == 0:
                    await asyncio.wait_for(ckpt.load(), 0.5)
                else:
                    await ckpt.load()
                out["first"] = "loaded"
            except BaseException as exc:  # what each rank raised is the result
                out["first"] = type(exc).__name__
            out["first_s"] = time.monotonic() - started
            storage.slow = False
            out["second"] = torch.equal((await asyncio.wait_for(ckpt.load(), 40))["w"], torch.arange(4.0))

    asyncio.run(main())
    return out
