"""A training process with ``preemption`` enabled, run by test_preemption.py, which sends it
a real SIGTERM.

argv: scenario root [spool]. Scenarios:

- ``in-flight``: save step 1 to a storage that holds its writes until the preemption came
  (a FaultyStorage), print UPLOADING once save() returned, then train until
  ``ckpt.preempted``, let the storage go on, take a last save (step 2), close and return;
- ``stuck``: save step 1 to a storage that holds every write (it never lands), print
  UPLOADING, then wait for the handle as a trainer that knows nothing of preemption would;
- ``committing``: as ``stuck``, but the storage holds only the manifest's write: every
  chunk lands, and COMMITTING is printed once the save is committing;
- ``stuck-packed``: with ``upload.dedup`` and ``upload.compression: zstd``, step 1 lands,
  then step 2 (two of its four tensors changed, all in one chunk: packed, compressed) is
  held as ``stuck`` once its upload has started the write, UPLOADING is printed, and the
  handle waited for;
- ``stuck-compressed``: with ``upload.compression: zstd``, save the state of
  ``packed_state(2)`` as step 1 to ``root`` (an S3 root behind a stalling proxy, say: the
  test sets it up), print CAPTURED once save() returned, and wait for the handle;
- ``idle``: print READY, train until ``ckpt.preempted`` (no save in flight), take a last
  save (step 5), close, return; in process mode it prints HELPER <pid> first.

(How the process ends after a handler installed before aiosnap's, one from C, in a forked
child: tests/signal_child.py.)
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import Any

import torch
from aiosnap import Config, SyncCheckpointer
from aiosnap.storage.local import LocalStorage
from tests.conftest import FaultyStorage

DEADLINE_S = 60.0


def state(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1_000_000, generator=generator), "step": torch.tensor(step)}  # 4 MB


def train_until_preempted(ckpt: SyncCheckpointer) -> None:
    began = time.monotonic()
    for _ in itertools.count():
        if ckpt.preempted:
            return
        assert time.monotonic() - began < DEADLINE_S, "never preempted"
        time.sleep(0.005)  # one training step


def packed_state(step: int) -> dict[str, torch.Tensor]:
    """Four trained-like tensors in one 512 KiB chunk; step 2 changes the second and fourth
    (dedup writes only those, and moves the fourth towards the chunk's start)."""
    generator = torch.Generator().manual_seed(7)
    tensors = {f"t{i}": torch.randn(20_000, generator=generator) * 0.02 for i in range(4)}
    if step == 1:
        tensors["t1"] = tensors["t1"] + 1
        tensors["t3"] = tensors["t3"] + 1
    return tensors


def stuck_packed(config: Config, root: str) -> None:
    config = config.model_copy(
        update={"upload": config.upload.model_copy(update={"dedup": True, "compression": "zstd"})}
    )
    storage = FaultyStorage(LocalStorage(root))
    with SyncCheckpointer(config, storage=storage) as ckpt:
        ckpt.save(packed_state(1), step=1).wait()
        storage.hold_when = lambda name: name.endswith(".bin")
        handle = ckpt.save(packed_state(2), step=2)
        began = time.monotonic()
        while storage._gate is None:  # the chunk's write is held: whatever it packs is packed
            assert time.monotonic() - began < DEADLINE_S, "the upload never started"
            time.sleep(0.005)
        print("UPLOADING", flush=True)
        handle.wait()
        print("NOT REACHED", flush=True)


def stuck_compressed(config: Config) -> None:
    upload = config.upload.model_copy(update={"compression": "zstd", "chunk_size": 2 * 1024**2})
    with SyncCheckpointer(config.model_copy(update={"upload": upload})) as ckpt:
        handle = ckpt.save(packed_state(2), step=1)
        print("CAPTURED", flush=True)  # the test signals once the proxy holds the chunk's body
        handle.wait()
        print("NOT REACHED", flush=True)


def main(scenario: str, root: str, spool: str | None) -> None:
    settings: dict[str, Any] = {
        "storage": {"url": root},
        "ram_budget": "16MiB",
        "upload": {"chunk_size": "512KiB", "concurrency": 1},
        "preemption": {
            "enabled": True,
            "grace_period": 2.0 if scenario in ("stuck", "committing", "stuck-packed") else 20.0,
        },
        "events": {"log": False},
    }
    if spool is not None:
        settings["spool"] = {"dir": spool, "mode": "overflow"}
    config = Config(**settings)
    if scenario == "stuck-packed":
        stuck_packed(config, root)
        return
    if scenario == "stuck-compressed":
        stuck_compressed(config)
        return
    storage: Any = None
    if scenario in ("in-flight", "stuck", "committing"):
        storage = FaultyStorage(LocalStorage(root))
        held = "manifest.json" if scenario == "committing" else ".bin"
        storage.hold_when = lambda name: name.endswith(held)
    with SyncCheckpointer(config, storage=storage) as ckpt:
        if scenario == "idle":
            if config.upload.executor == "process":
                print(f"HELPER {ckpt._engine.transfer.pid}", flush=True)  # type: ignore[union-attr]
            print("READY", flush=True)
            train_until_preempted(ckpt)
            ckpt.save(state(5), step=5).wait()
            return
        handle = ckpt.save(state(1), step=1)
        print("UPLOADING", flush=True)
        if scenario == "committing":
            began = time.monotonic()
            while handle.progress().stage != "committing":
                assert time.monotonic() - began < DEADLINE_S, handle.progress()
                time.sleep(0.005)
            print("COMMITTING", flush=True)
        if scenario in ("stuck", "committing"):
            handle.wait()
            print("NOT REACHED", flush=True)
            return
        train_until_preempted(ckpt)
        print(f"PREEMPTED upload done={handle.done()}", flush=True)
        storage.release(ckpt._loop.loop)
        ckpt.save(state(2), step=2).wait()
    print("CLOSED", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
