"""Run as a child process (:func:`run_probe`): save a state 4x the RAM budget and report
the budget's high-water mark and the process's peak RSS increase (Linux /proc). With
``staged-load [cuda]``: load 160 MiB into strided (or CUDA) tensors through the staging
slabs and report the load's peak RSS increase. With ``small-state``: a default checkpointer
(a RAM budget far above the state) saving a 10x10 ``Linear`` and then a 96 MiB state, with
the RSS it adds once made (idle), after the small saves and at its peak. With ``export SRC
WORK``: export the checkpoint at SRC (10x the budget) to an aiosnap root, that to a DCP
folder, that to a torch.save file, and report each export's peak RSS increase."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Config, SyncCheckpointer
from aiosnap.bench.local import PeakRSS

MiB = 1024 * 1024
SLACK = 64 * MiB  # thread stacks, allocator arenas, the manifest, Python objects

needs_peak_rss = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset"
)


def run_probe(root: Path, budget_mib: int, *mode: str) -> dict[str, Any]:
    """Run this module in a fresh process (a clean peak RSS) and return its figures."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.memory_probe", str(root), str(budget_mib), *mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    figures: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    print(figures)
    return figures


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


def staged_load(root: str, budget_mib: int, device: str = "cpu") -> None:
    budget = budget_mib * MiB
    columns = 1024
    rows = 10 * MiB // 4 // columns  # 10 MiB each: 160 MiB, well past the budget and the slack
    saved = {f"w{i}": torch.full((rows, columns), float(i)).t() for i in range(16)}
    total = sum(t.numel() * 4 for t in saved.values())
    config = Config(storage={"url": root}, ram_budget=budget, upload={"chunk_size": "1MiB"})
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(saved, step=1).wait()
    targets = {name: torch.zeros(rows, columns, device=device).t() for name in saved}  # (CUDA set up here)
    with SyncCheckpointer(config) as ckpt, PeakRSS() as rss:
        ckpt.load(targets)
    equal = all(torch.equal(targets[name].cpu(), tensor) for name, tensor in saved.items())
    print(json.dumps({"state_bytes": total, "budget": budget, "rss_increase": rss.increase, "values_equal": equal}))


def exports(budget_mib: int, source: str, work: str) -> None:
    from aiosnap import export

    config = {"ram_budget": f"{budget_mib}MiB", "events": {"log": False}}
    figures = {}
    steps = [("aiosnap", source, f"{work}/root"), ("dcp", f"{work}/root", f"{work}/dcp-out")]
    steps.append(("torch", f"{work}/dcp-out", f"{work}/f.pt"))
    for to, src, dest in steps:
        with PeakRSS() as rss:
            result = export(src, dest, to=to, config=config)
        figures[to] = {"rss_increase": rss.increase, "nbytes": result.nbytes}
    print(json.dumps({"budget": budget_mib * MiB, "exports": figures}))


def small_state(root: str, budget_mib: int) -> None:
    """The staging memory is sized by what the saves need, not by the budget."""
    tiny = torch.nn.Linear(10, 10)
    medium = {f"t{i}": torch.randn(MiB // 4) for i in range(96)}  # 96 MiB
    config = Config(storage={"url": root}, ram_budget=budget_mib * MiB, upload={"chunk_size": "16MiB"})
    figures: dict[str, Any] = {"budget": budget_mib * MiB, "state_bytes": 96 * MiB}
    with PeakRSS() as whole:
        base = _rss()
        with SyncCheckpointer(config) as ckpt:
            figures["idle_increase"] = _rss() - base
            for step in range(3):  # what a first save leaves resident, and what later saves add
                ckpt.save({"model": tiny}, step=step).wait()
            figures["after_small_saves_increase"] = _rss() - base
            with PeakRSS() as save:
                result = ckpt.save(medium, step=10).wait()
            figures["save_peak_increase"] = save.increase
            figures["budget_high_water"] = result.ram_high_water
    figures["run_peak_increase"] = whole.increase
    print(json.dumps(figures))


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


if __name__ == "__main__":
    if sys.argv[3:4] == ["export"]:
        exports(int(sys.argv[2]), sys.argv[1], sys.argv[4])
    elif sys.argv[3:4] == ["small-state"]:
        small_state(sys.argv[1], int(sys.argv[2]))
    elif sys.argv[3:4] == ["staged-load"]:
        staged_load(sys.argv[1], int(sys.argv[2]), *sys.argv[4:5])
    else:
        main(sys.argv[1], int(sys.argv[2]))
