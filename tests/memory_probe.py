"""Run as a child process by test_memory.py: save a state 4x the RAM budget and report
the budget's high-water mark and the process's peak RSS increase (Linux /proc)."""

from __future__ import annotations

import json
import sys

import torch
from aiosnap import Config, SyncCheckpointer
from aiosnap.bench.local import PeakRSS

MiB = 1024 * 1024


def main(root: str, budget_mib: int) -> None:
    budget = budget_mib * MiB
    state = {
        "huge": torch.randn(budget // 2),  # 2x the budget in one tensor
        "medium": [torch.randn(MiB // 4) for _ in range(16)],  # 16 x 1 MiB
        "small": {str(i): torch.randn(1000) for i in range(500)},  # ~2 MiB of small tensors
        "rest": torch.randn(budget // 2),  # another 2x the budget
    }
    total = sum(t.numel() * 4 for t in [state["huge"], *state["medium"], *state["small"].values(), state["rest"]])
    config = Config(storage={"url": root}, ram_budget=budget, upload={"chunk_size": "8MiB"})
    with SyncCheckpointer(config) as ckpt, PeakRSS() as rss:
        result = ckpt.save(state, step=1).wait()
    print(
        json.dumps(
            {
                "state_bytes": total,
                "budget": budget,
                "budget_high_water": result.ram_high_water,
                "rss_increase": rss.increase,
                "blocked_s": result.blocked_s,
                "durable_s": result.durable_s,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
