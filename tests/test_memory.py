"""The RAM budget is enforced, and is a ceiling rather than an allocation: measured from the
budget itself and from the OS."""

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


@needs_peak_rss
def test_staging_memory_is_what_the_saves_need_not_the_budget(root: Path) -> None:
    """Issue 26: a default 1 GiB budget made the process 1 GiB larger before it saved a byte."""
    figures = run_probe(root, 1024, "small-state")
    assert figures["idle_increase"] <= SLACK, figures
    assert figures["after_small_saves_increase"] <= SLACK, figures
    assert figures["save_peak_increase"] <= figures["state_bytes"] + SLACK, figures
    assert figures["run_peak_increase"] <= figures["state_bytes"] + SLACK, figures
    assert figures["budget_high_water"] <= figures["state_bytes"] + 16 * 1024 * 1024, figures
