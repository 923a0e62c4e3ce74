"""A trainer for the soak, run as a child process that the soak SIGKILLs at random moments.

argv: config-json first-step count. Saves ``soak_state(step)`` for each step, printing
``CAPTURED <step>`` once save() returned and ``DURABLE <step>`` once the step committed."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from aiosnap import Config, SyncCheckpointer


def soak_state(step: int, numel: int = 150_000) -> dict[str, Any]:
    """What training holds at ``step`` (deterministic, so a loaded step can be checked): ``w``
    and ``b`` change at every step, ``slow`` every fifth, ``frozen`` never (what incremental
    saves name in earlier steps instead of writing again)."""
    generator = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(numel, generator=generator),
        "b": torch.randint(0, 1000, (333,), generator=generator, dtype=torch.int32),
        "frozen": torch.randn(40_000, generator=torch.Generator().manual_seed(-1)).to(torch.bfloat16),
        "slow": torch.randn(20_000, generator=torch.Generator().manual_seed(step // 5)),
        "meta": {"step": step, "tags": ("soak", step % 7)},
    }


if __name__ == "__main__":
    config = Config(**json.loads(sys.argv[1]))
    first, count = int(sys.argv[2]), int(sys.argv[3])
    with SyncCheckpointer(config) as ckpt:
        for step in range(first, first + count):
            state = soak_state(step)
            handle = ckpt.save(state, step=step)
            print(f"CAPTURED {step}", flush=True)
            state["w"].add_(1.0)  # training goes on
            handle.wait()
            print(f"DURABLE {step}", flush=True)
