"""The closing table of ``make bench``: figures appended as JSON lines by real benchmark runs,
read back (as untrusted input) and printed with their ratio, goal and verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiosnap.bench.results import Figure, ResultsFileError, compare, read_figures, record
from aiosnap.bench.spool import spill_floor_s
from hypothesis import given, settings
from hypothesis import strategies as st


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiosnap.bench", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_the_summary_prints_each_figure_with_its_anchor_ratio_goal_and_verdict(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    record(results, [
        compare("spool", "overflow blocked", 0.6, "s", "disk floor", 0.4, 1.5),  # 1.5x: met
        compare("local", "warm blocked", 0.05, "s", "memcpy", 0.038, 1.25),  # 1.32x: missed
        compare("interference", "slowdown", 1.01, "x", "no checkpoint", None, 1.03, ratio=1.01, note="noise 0.99x"),
        compare("s3", "throughput", 90.0, "MB/s", "the cap", 100.0, 0.95, goal_op=">="),  # 0.9x: missed
        compare("executor", "open", 0.01, "s", "thread", 0.02, None),  # no goal
    ])  # fmt: skip
    record(results, [compare("spool", "overflow blocked", 0.8, "s", "disk floor", 0.4, 1.5)])  # run again: 2x
    shown = bench("summary", str(results))
    assert shown.returncode == 0, shown.stderr
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in shown.stdout.splitlines() if line.startswith("| ") and "figure" not in line}  # fmt: skip
    assert list(rows) == ["overflow blocked", "warm blocked", "slowdown", "throughput", "open"]  # first places kept
    assert rows["overflow blocked"][2:] == ["0.8 s", "0.4 s (disk floor)", "2x", "<= 1.5x", "miss"]  # the later run
    assert rows["warm blocked"][4:] == ["1.32x", "<= 1.25x", "miss"]
    assert rows["slowdown"][3:] == ["no checkpoint", "1.01x", "<= 1.03x", "pass"]
    assert rows["throughput"][4:] == ["0.9x", ">= 0.95x", "miss"]
    assert rows["open"][4:] == ["0.5x", "-", "-"]
    assert "1 of 4 goals met; 5 figures in all." in shown.stdout
    assert "- interference / slowdown: noise 0.99x" in shown.stdout
    assert bench("summary", str(results), "--strict").returncode == 1
    record(results, [compare("spool", "overflow blocked", 0.5, "s", "disk floor", 0.4, 1.5)])
    kept = tmp_path / "met.jsonl"
    kept.write_text("".join(line for line in results.read_text().splitlines(True) if '"spool"' in line))
    assert bench("summary", str(kept), "--strict").returncode == 0


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "a JSON object, not list"),
        ('{"schema": 1}', "missing field(s)"),
        ("FIGURE|value|NaN", "field 'value' is nan, not a finite number"),
        ("FIGURE|value|true", "field 'value' is True"),
        ('FIGURE|ratio|"2"', "field 'ratio' is '2'"),
        ("FIGURE|schema|2", "field 'schema' is 2; this summary reads schema 1"),
        ('FIGURE|goal_op|"<"', "field 'goal_op' is '<'"),
        ('FIGURE|colour|"red"', "unknown field(s) ['colour']"),
    ],
)
def test_a_results_line_that_is_no_figure_is_refused_naming_its_line_and_field(
    tmp_path: Path, line: str, says: str
) -> None:
    good = json.dumps(compare("spool", "blocked", 1.0, "s", "floor", 1.0, 1.5).__dict__)
    if line.startswith("FIGURE|"):
        _, field, value = line.split("|")
        row = json.loads(good)
        row[field] = json.loads(value)
        line = json.dumps(row)
    results = tmp_path / "results.jsonl"
    results.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(ResultsFileError, match=rf"results\.jsonl, line 3: .*{_escaped(says)}"):
        read_figures(results)
    refused = bench("summary", str(results))
    assert refused.returncode == 2 and "line 3" in refused.stderr and says in refused.stderr
    assert bench("summary", str(tmp_path / "absent.jsonl")).returncode == 2


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_fields = st.fixed_dictionaries(
    {},
    optional={
        name: _json
        for name in (
            "schema",
            "bench",
            "figure",
            "value",
            "unit",
            "anchor",
            "anchor_value",
            "ratio",
            "goal",
            "goal_op",
            "note",
        )
    },
)


@settings(max_examples=300, deadline=None)
@given(row=st.one_of(_json, _fields))
def test_any_json_line_is_a_figure_or_a_results_file_error(tmp_path_factory: Any, row: Any) -> None:
    results = tmp_path_factory.mktemp("fuzz") / "results.jsonl"
    results.write_text(json.dumps(row) + "\n")
    try:
        figures = read_figures(results)
    except ResultsFileError:
        return
    assert len(figures) == 1 and isinstance(figures[0], Figure)
    assert figures[0].verdict in ("pass", "miss", "-")


def test_the_disk_floor_writes_the_bytes_as_fsynced_chunk_files_and_leaves_nothing(tmp_path: Path) -> None:
    seconds = spill_floor_s(tmp_path, 5 * 1024 * 1024 + 7, 2 * 1024 * 1024, runs=3)
    assert seconds > 0
    assert list(tmp_path.iterdir()) == []


def test_the_spool_benchmark_records_blocked_over_its_measured_disk_floor(s3_endpoint: str, tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    run = bench(
        "spool", "--size-mb", "40", "--ram-budget-mib", "8", "--chunk-mib", "2", "--executors", "thread",
        "--modes", "overflow", "--floor-runs", "2", "--endpoint", s3_endpoint, "--cap-mb-s", "0",
        "--results", str(results),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    figure = read_figures(results)[0]
    overflow = report["executors"]["thread"]["modes"]["overflow"]
    assert overflow["spooled_chunks"] > 0  # the spill happened
    assert figure.value == overflow["blocked_s"] and figure.anchor_value == pytest.approx(report["disk_floor_s"], 1e-2)
    assert figure.ratio == pytest.approx(figure.value / report["disk_floor_s"], rel=2e-2)
    assert "fsynced 2 MiB files" in figure.anchor and figure.goal == 1.5
    assert report["over_budget_bytes"] == report["state_bytes"] - 8 * 1024 * 1024


def test_the_interference_benchmark_runs_at_two_rates_and_measures_the_trainers_other_cpu(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    run = bench(
        "interference", "--size-mb", "8", "--cap-mb-s", "100,40", "--runs", "1", "--before-s", "0.2",
        "--during-s", "0.2", "--no-dcp", "--results", str(results),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert sorted(report["by_cap_mb_s"]) == ["100", "40"]
    for rate in report["by_cap_mb_s"].values():
        process = rate["runs"][0]["aiosnap_process"]
        assert process["other_threads_cpu_s"] >= 0 and process["slowdown"] > 0
    slowdowns = [f for f in read_figures(results) if f.goal is not None]
    assert [f.figure.split("S3 at ")[1].split(",")[0] for f in slowdowns] == ["100 MB/s", "40 MB/s"]
    assert all(f.goal == 1.03 and f.ratio == f.value and "outside its training thread" in f.note for f in slowdowns)


def test_the_executor_benchmark_compares_a_fresh_checkpointers_first_save_under_both(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    run = bench(
        "executor", "--size-mb", "8", "--runs", "1", "--dir", str(tmp_path / "roots"), "--results", str(results)
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert set(report["median"]) == {"thread", "process"}
    blocked = next(f for f in read_figures(results) if f.goal is not None)
    assert blocked.value == report["median"]["process"]["blocked_s"]
    assert blocked.anchor_value == report["median"]["thread"]["blocked_s"] and blocked.goal == 1.0
    assert list((tmp_path / "roots").iterdir()) == [], "each run's root removed"
