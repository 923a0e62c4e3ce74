"""The RAM budget is enforced: measured from the budget itself and from the OS."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.memory_probe import SLACK, needs_peak_rss, run_probe

pytestmark = pytest.mark.both_executors


@needs_peak_rss
def test_state_four_times_the_budget_stays_within_budget(root: Path) -> None:
    figures = run_probe(root, 32)
    assert figures["state_bytes"] >= 4 * figures["budget"]
    assert 0 < figures["budget_high_water"] <= figures["budget"]
    assert figures["rss_increase"] <= figures["budget"] + SLACK, figures
    assert len(list(root.glob("*/*/rank-0/*.bin"))) >= 16
