"""The closing table of ``make bench``: figures appended as JSON lines by real benchmark runs,
read back (as untrusted input) and printed with their ratio, goal and verdict."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiosnap.bench import summary
from aiosnap.bench.results import (
    MAX_FILE_BYTES,
    MAX_TEXT_CHARS,
    Figure,
    ResultsFileError,
    compare,
    read_figures,
    record,
)
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


def _summary(path: Path) -> tuple[int, str, str]:
    """``aiosnap bench summary path`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    status = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            summary.main([str(path)])
        except SystemExit as exc:
            status = int(exc.code or 0)
    return status, out.getvalue(), err.getvalue()


@settings(max_examples=300, deadline=None)
@given(row=st.one_of(_json, _fields))
def test_any_json_line_is_a_figure_or_a_results_file_error(tmp_path_factory: Any, row: Any) -> None:
    results = tmp_path_factory.mktemp("fuzz") / "results.jsonl"
    results.write_text(json.dumps(row) + "\n")
    try:
        figures = read_figures(results)
    except ResultsFileError:
        assert _summary(results)[0] == 2
        return
    assert len(figures) == 1 and isinstance(figures[0], Figure)
    assert figures[0].verdict in ("pass", "miss", "-")
    status, shown, _ = _summary(results)
    assert status == 0 and shown.count("\n|") == 2 and shown.encode("utf-8")


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200), cut=st.integers(0, 300))
def test_any_bytes_are_a_table_or_a_typed_refusal_through_main(tmp_path_factory: Any, data: bytes, cut: int) -> None:
    """Hostile results files end in a table or exit 2 naming the file, never in another
    exception (a byte string spliced into a good line, or alone)."""
    good = json.dumps(compare("spool", "blocked", 1.0, "s", "floor", 1.0, 1.5).__dict__).encode()
    results = tmp_path_factory.mktemp("fuzz") / "results.jsonl"
    results.write_bytes(good[:cut] + data + good[cut:] + b"\n")
    status, _, err = _summary(results)
    assert status in (0, 2)
    if status == 2:
        assert str(results) in err


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"\xff\xfe" + b"GOOD\n", "line 1: not UTF-8"),
        (b'{"schema": 1, "value": ' + b"9" * 5000 + b"}\n", "line 1: not JSON"),
        (b"[" * 200_000 + b"]" * 200_000 + b"\n", "line 1: not JSON (nested too deeply)"),
        (b"FIGURE|value|" + b"9" * 4000, "field 'value' is out of the range of a float"),
        (b"FIGURE|ratio|" + b"9" * 400, "field 'ratio' is out of the range of a float"),
        (b"FIGURE|anchor_value|1e999", "field 'anchor_value' is inf, not a finite number"),
        (b'FIGURE|note|"\\ud800"', "field 'note' is not valid Unicode"),
        (b'FIGURE|anchor|"' + b"x" * (MAX_TEXT_CHARS + 1) + b'"', f"field 'anchor' is longer than {MAX_TEXT_CHARS}"),
        (b"GOOD\n" * (MAX_FILE_BYTES // 150), f"larger than {MAX_FILE_BYTES} bytes"),
    ],
)
def test_a_hostile_results_file_is_refused_by_main_naming_what_is_wrong(tmp_path: Path, data: bytes, says: str) -> None:
    """Each crashed ``aiosnap bench summary`` with an untyped error (UnicodeDecodeError, the
    int digit limit's ValueError, RecursionError, OverflowError) or read a huge file whole."""
    good = json.dumps(compare("spool", "blocked", 1.0, "s", "floor", 1.0, 1.5).__dict__)
    if data.startswith(b"FIGURE|"):
        _, field, value = data.split(b"|", 2)
        row = json.loads(good)
        row[field.decode()] = "@"
        data = json.dumps(row).replace('"@"', value.decode()).encode() + b"\n"
    results = tmp_path / "results.jsonl"
    results.write_bytes(data.replace(b"GOOD", good.encode()))
    status, _, err = _summary(results)
    assert status == 2 and str(results) in err and says in err, err


def test_the_table_escapes_and_truncates_its_cells(tmp_path: Path) -> None:
    """A figure's text cannot forge rows, move the terminal's cursor, or make every row as
    wide as its longest cell (a 0.6 MB file printed ~1.2 GB): newlines, control characters
    and ``|`` are escaped, cells cut to ``summary.CELL_CHARS``."""
    results = tmp_path / "results.jsonl"
    record(results, [
        compare("spool", "blocked\n| forged | row | 0 s | - | 0.1x | <= 1.5x | pass |", 9.0, "s", "floor", 0.4, 1.5),
        compare("x", "\x1b[2J\x1b[Hclears the terminal\u202e", 1.0, "s", "a", 1.0, 1.5, note="a\nb\x07"),
        *(compare("many", f"f{i}", 1.0, "s", "a", 1.0, 1.5) for i in range(300)),
        compare("long", "long", 1.0, "s", "x" * MAX_TEXT_CHARS, 1.0, 1.5, note="y" * MAX_TEXT_CHARS),
    ])  # fmt: skip
    status, shown, _ = _summary(results)
    assert status == 0
    lines = shown.splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 2 + 303, "one line per figure: no forged row"
    assert "blocked\\n\\| forged \\| row" in table[2] and table[2].rstrip().endswith("| miss |")
    assert not any(ch in shown for ch in "\x1b\x07\u202e"), "no control character reaches the terminal"
    assert "\\x1b[2J" in table[3] and "- x / \\x1b[2J" in shown and "a\\nb\\x07" in shown
    assert max(len(line) for line in lines) <= 7 * (summary.CELL_CHARS + 3) + 2
    assert len(shown) < 2 * results.stat().st_size, "no amplification"


def test_record_refuses_a_figure_the_summary_would_refuse_and_writes_nothing(tmp_path: Path) -> None:
    """A broken run (an infinite figure) was written, and the next summary refused the whole
    file: every other benchmark's row was lost. Now refused where it is made."""
    results = tmp_path / "results.jsonl"
    record(results, [compare("spool", "blocked", 0.5, "s", "floor", 0.4, 1.5)])
    with pytest.raises(ValueError, match=r"local / warm: value is inf, not a finite number"):
        compare("local", "warm", float("inf"), "s", "memcpy", 0.04, 1.25)
    with pytest.raises(ValueError, match=r"local / warm: anchor_value is nan"):
        compare("local", "warm", 1.0, "s", "memcpy", float("nan"), 1.25)
    broken = Figure("local", "warm", 1.0, "s", "memcpy", 0.04, float("inf"), 1.25)
    fine = compare("local", "cold", 0.5, "s", "memcpy", 0.4, 1.5)
    with pytest.raises(ResultsFileError, match=r"local / warm: field 'ratio' is inf"):
        record(results, [fine, broken])
    with pytest.raises(ResultsFileError, match=r"field 'anchor' is longer than"):
        record(results, [compare("local", "cold", 0.5, "s", "m" * (MAX_TEXT_CHARS + 1), 0.4, 1.5)])
    assert [f.figure for f in read_figures(results)] == ["blocked"], "nothing of a refused batch written"


def test_the_disk_floor_writes_the_bytes_as_fsynced_chunk_files_and_leaves_nothing(tmp_path: Path) -> None:
    seconds = spill_floor_s(tmp_path, 5 * 1024 * 1024 + 7, 2 * 1024 * 1024, runs=3)
    assert seconds > 0
    assert list(tmp_path.iterdir()) == []


def test_the_spool_benchmark_records_blocked_over_its_measured_disk_floor(s3_endpoint: str, tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    run = bench(
        "spool", "--size-mb", "40", "--ram-budget-mib", "8", "--chunk-mib", "2", "--executors", "thread",
        "--modes", "overflow", "--rounds", "2", "--endpoint", s3_endpoint, "--cap-mb-s", "0",
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
    rounds = report["rounds"]  # the floor and the save alternate: each round has both
    assert len(rounds) == 2 and all(r["disk_floor_s"] > 0 and r["thread"] > 0 for r in rounds)
    assert sorted(overflow["blocked_s_each"]) == sorted(r["thread"] for r in rounds)


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
