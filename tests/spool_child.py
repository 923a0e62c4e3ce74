"""Run by test_spool.py as a child process that gets SIGKILLed during upload.

argv: config-json step [root]. Saves a deterministic state (to ``root`` through ``at()``
when given), prints HELPER <pid> first in process mode, CAPTURED once save() returned,
then waits for the upload (and is killed meanwhile)."""

from __future__ import annotations

import json
import sys

import torch
from aiosnap import Config, SyncCheckpointer


def state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return {"w": torch.randn(4_000_000, generator=generator), "b": torch.randn(1000, generator=generator)}


if __name__ == "__main__":
    config = Config(**json.loads(sys.argv[1]))
    with SyncCheckpointer(config) as ckpt:
        if config.upload.executor == "process":
            print(f"HELPER {ckpt._engine.transfer.pid}", flush=True)  # type: ignore[union-attr]
        target = ckpt.at(sys.argv[3], keep_last=1) if len(sys.argv) > 3 else ckpt
        handle = target.save(state(), step=int(sys.argv[2]))
        print("CAPTURED", flush=True)
        handle.wait()
        print("DURABLE", flush=True)
