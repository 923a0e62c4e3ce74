"""The RAM budget is enforced: measured from the budget itself and from the OS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MiB = 1024 * 1024
pytestmark = pytest.mark.both_executors

SLACK = 64 * MiB  # thread stacks, allocator arenas, the manifest, Python objects


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_state_four_times_the_budget_stays_within_budget(root: Path) -> None:
    budget_mib = 32
    out = subprocess.run(
        [sys.executable, "-m", "tests.memory_probe", str(root), str(budget_mib)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    print(figures)
    assert figures["state_bytes"] >= 4 * figures["budget"]
    assert 0 < figures["budget_high_water"] <= figures["budget"]
    assert figures["rss_increase"] <= figures["budget"] + SLACK, figures
    assert len(list(root.glob("*/*/rank-0/*.bin"))) >= 16
