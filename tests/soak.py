"""The fault soak: many saves of a changing state while faults are injected, then the invariant.

Invariant, checked after every round: every step ``steps()`` lists loads bit-exact to what
was saved at that step, and the newest surviving step is never older than the last save
reported durable. Faults come from wrapping the real backends (``FaultyStorage`` over local
disk, the ``FaultProxy`` in front of the S3 test server) and from SIGKILLing a child trainer.
``make soak`` runs it long (``--soak-rounds``); ``make test`` runs a short version.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiosnap import Checkpointer, Config, SyncCheckpointer
from aiosnap.core.names import MANIFEST_FILE
from tests.conftest import FaultyStorage, assert_same
from tests.soak_child import soak_state

REPO = Path(__file__).parent.parent


@dataclass
class Figures:
    saves: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    failures_reported: int = 0
    committed: int = 0
    kills: int = 0
    steps_verified: int = 0
    data_lost: int = 0
    problems: list[str] = field(default_factory=list)
    referencing_steps: set[int] = field(default_factory=set)
    """Steps verified whose manifest names an earlier step's bytes (incremental saves)."""

    def lost(self, why: str) -> None:
        self.data_lost += 1
        self.problems.append(why)

    def line(self) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        return (
            f"saves tried {self.saves}, faults injected {sum(self.faults.values())} ({faults}), "
            f"failures reported {self.failures_reported}, committed {self.committed}, children killed {self.kills}, "
            f"steps verified {self.steps_verified}, data lost {self.data_lost}"
        )


async def _verify(ckpt: Checkpointer, last_durable: int | None, figures: Figures) -> None:
    steps = await ckpt.steps()
    for step in steps:
        try:
            loaded = await ckpt.load(step=step)
            assert_same(loaded, soak_state(step))
            if (await ckpt.manifest(step)).references:
                figures.referencing_steps.add(step)
        except Exception as exc:
            if step not in await ckpt.steps() and step != steps[-1]:
                continue  # a concurrent gc deleted this older step meanwhile: not a loss
            figures.lost(f"step {step} listed but does not load bit-exact: {exc!r}")
            continue
        figures.steps_verified += 1
    if last_durable is not None and (not steps or steps[-1] < last_durable):
        figures.lost(f"newest step {steps[-1] if steps else None} is older than durable step {last_durable}")


LOCAL_FAULTS = ["none", "enospc", "answer_lost", "cancelled", "close_timeout", "slow", "reset"]
S3_FAULTS = ["none", "reset", "slowdown", "cancelled"]


def _arm_local(store: FaultyStorage, fault: str, rng: random.Random) -> None:
    store.fail_when = store.lose_answer_when = store.hang_after_write_when = None
    store.delay = 0.0
    if fault == "enospc":
        victim = f"/{rng.randrange(3)}.bin"
        store.fail_when = lambda name: name.endswith(victim)
        store.error = OSError(errno.ENOSPC, "No space left on device (soak)")
    elif fault == "reset":
        store.fail_when = lambda name: name.endswith(MANIFEST_FILE)
        store.error = ConnectionResetError("connection reset (soak)")
    elif fault == "answer_lost":
        store.lose_answer_when = lambda name: name.endswith(MANIFEST_FILE)
        store.error = ConnectionResetError("the answer was lost (soak)")
    elif fault == "close_timeout":
        store.hang_after_write_when = lambda name: name.endswith(MANIFEST_FILE) or name.endswith("/1.bin")
    elif fault in ("slow", "cancelled"):
        store.delay = 0.02


def _arm_s3(proxy: Any, fault: str) -> None:
    proxy.clear()
    if fault == "reset":
        proxy.reset_every = 3
        proxy.reset_after_bytes = 64 * 1024
    elif fault == "slowdown":
        proxy.slowdown_requests = 2
    elif fault == "cancelled":
        proxy.set_rate(4e6)


async def soak_in_process(
    config: Config, rounds: int, seed: int, figures: Figures, *, store: FaultyStorage | None = None, proxy: Any = None
) -> int:
    """Saves with faults through one root (local disk through ``store``, or S3 through
    ``proxy``); returns the last step used."""
    rng = random.Random(seed)
    faults = LOCAL_FAULTS if store is not None else S3_FAULTS

    def open_checkpointer() -> Checkpointer:
        return Checkpointer(config, storage=store)

    ckpt = open_checkpointer()
    last_durable: int | None = None
    step = 0
    try:
        for _ in range(rounds):
            step += rng.randint(1, 3)
            fault = rng.choice(faults)
            figures.saves += 1
            if fault != "none":
                figures.faults[fault] += 1
            if store is not None:
                _arm_local(store, fault, rng)
            else:
                _arm_s3(proxy, fault)
            state = soak_state(step)
            handle = None
            try:
                if fault == "cancelled":
                    with contextlib.suppress(TimeoutError):
                        handle = await asyncio.wait_for(ckpt.save(state, step=step), rng.uniform(0.001, 0.05))
                else:
                    handle = await ckpt.save(state, step=step)
                state["w"].add_(1.0)  # training goes on at once
                if fault == "close_timeout":
                    with contextlib.suppress(TimeoutError):
                        await ckpt.close(timeout=0.2)
                    if handle is not None and handle.done() and handle.result is not None:
                        last_durable = step
                        figures.committed += 1
                    if store is not None:
                        _arm_local(store, "none", rng)
                    ckpt = open_checkpointer()
                elif handle is not None:
                    await handle.wait(60)
                    last_durable = step
                    figures.committed += 1
            except Exception:
                figures.failures_reported += 1
            if store is not None:
                _arm_local(store, "none", rng)
            else:
                proxy.clear()
            await _verify(ckpt, last_durable, figures)
    finally:
        with contextlib.suppress(Exception):
            await ckpt.close(timeout=30)
    return step


_GC_LOOP = """
import asyncio, sys, time
from pathlib import Path
from aiosnap.catalog.garbage import collect_garbage
from aiosnap.storage.local import LocalStorage

async def main(root, stop, deadline):
    storage, runs = LocalStorage(root), 0
    while not Path(stop).exists() and time.monotonic() < deadline:
        await collect_garbage(storage, keep_last=2, grace_s=30.0)  # fewer steps than retention keeps
        runs += 1
        await asyncio.sleep(0.05)
    print(runs)

asyncio.run(main(sys.argv[1], sys.argv[2], time.monotonic() + float(sys.argv[3])))
"""


@contextlib.contextmanager
def concurrent_gc(root: Path, stop: Path, limit_s: float) -> Any:
    """``aiosnap gc`` (keep_last 2) in a loop in another process on local root ``root``
    while the block runs (at most ``limit_s``); yields a list that gets its run count."""
    root.mkdir(parents=True, exist_ok=True)
    child = subprocess.Popen(
        [sys.executable, "-c", _GC_LOOP, str(root), str(stop), str(limit_s)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    runs: list[int] = []
    try:
        yield runs
    finally:
        stop.touch()
        try:
            out, err = child.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
        if child.returncode != 0:
            raise AssertionError(f"the concurrent gc failed: {err[-2000:]}")
        runs.append(int(out.strip() or 0))


def _child(config: Config, first: int, count: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.soak_child", config.model_dump_json(), str(first), str(count)],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip


def soak_killed_children(config: Config, trials: int, seed: int, figures: Figures, first_step: int = 1) -> None:
    """SIGKILL a child trainer at random moments (right after save() returned included),
    then resume the spool in a new checkpointer and check the invariant."""
    rng = random.Random(seed)
    step = first_step
    always = config.spool.effective_mode == "always"
    for _ in range(trials):
        child = _child(config, step, 50)
        captured: list[int] = []
        durable: list[int] = []
        right_after_capture = rng.random() < 0.5
        wanted = rng.randint(1, 4)
        deadline = time.monotonic() + rng.uniform(0.0, 1.5)
        try:
            assert child.stdout is not None
            while True:
                line = child.stdout.readline().split()
                if not line:
                    break
                (captured if line[0] == "CAPTURED" else durable).append(int(line[1]))
                if right_after_capture and line[0] == "CAPTURED" and len(captured) >= wanted:
                    break
                if not right_after_capture and time.monotonic() > deadline and captured:
                    break
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
            if child.stdout is not None:
                child.stdout.close()
        figures.kills += 1
        figures.saves += len(captured)
        figures.faults["sigkill"] += 1
        with SyncCheckpointer(config) as ckpt:  # resumes what the spool holds
            steps = ckpt.steps()
            figures.committed += len(ckpt.resume_report.resumed) + len(durable)
            for listed in steps:
                try:
                    assert_same(ckpt.load(step=listed), soak_state(listed))
                except Exception as exc:
                    figures.lost(f"step {listed} listed but does not load bit-exact: {exc!r}")
                    continue
                figures.steps_verified += 1
        newest = steps[-1] if steps else None
        if durable and (newest is None or newest < durable[-1]):
            figures.lost(f"newest step {newest} is older than durable step {durable[-1]}")
        if always and captured and (newest is None or newest < captured[-1]):
            figures.lost(f"spool always: step {captured[-1]} was captured but is gone after resume")
        step = max([step, *captured]) + 1
