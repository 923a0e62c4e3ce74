"""One rank of the multi-rank incremental-save test (launched by :func:`dist_launch.run_ranks`
with ``child=`` this file): ``python incremental_ranks.py SCENARIO RANK WORLD PORT WORKDIR PARAMS``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_child import config, main


def fine_tune_ranks(rank: int, world: int, work: str, params: dict[str, Any]) -> dict[str, Any]:
    """Three saves of a replicated frozen base with a trained adapter, and a rank-local
    tensor that only rank 1 changes: every step loads back as saved, on every rank."""
    import aiosnap

    torch.manual_seed(0)  # the same replicated model on every rank
    base = torch.nn.Linear(256, 256)
    base.requires_grad_(False)
    adapter = torch.nn.Linear(256, 4)
    own = torch.full((5000,), float(rank))
    settings = config(params["root"], executor=params.get("executor", "thread"))
    settings["upload"]["dedup"] = True
    saved: dict[int, dict[str, torch.Tensor]] = {}
    found: list[dict[str, Any]] = []
    with aiosnap.SyncCheckpointer(settings) as ckpt:
        for step in (1, 2, 3):
            with torch.no_grad():
                adapter.weight.add_(1.0)
                if rank == 1 and step == 3:
                    own[:10] = -1.0
            state = {"base": base.state_dict(), "adapter": adapter.state_dict(), "own": {"t": own}}
            ckpt.save(state, step=step, rank_local=["own"]).wait(timeout=40)
            saved[step] = {"w": base.weight.clone(), "a": adapter.weight.clone(), "own": own.clone()}
        for step, expected in saved.items():
            loaded = ckpt.load(step=step)
            same = (
                torch.equal(loaded["base"]["weight"], expected["w"])
                and torch.equal(loaded["adapter"]["weight"], expected["a"])
                and torch.equal(loaded["own"]["t"], expected["own"])
            )
            m = ckpt.manifest(step)
            found.append({
                "step": step, "same": same, "own": m.own_bytes, "total": m.total_bytes,
                "refs": [[o.name, o.rank] for o in m.references or ()],
            })  # fmt: skip
    return {"steps": found}


if __name__ == "__main__":
    main(globals())
