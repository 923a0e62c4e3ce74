"""Benchmark figures as JSON lines, for the closing table of ``make bench`` (:mod:`.summary`).

A benchmark given ``--results PATH`` appends one JSON object per line to ``PATH`` for each
figure it measured against a floor or an anchor (``aiosnap bench summary PATH`` prints them as
one table). The line is the whole contract between a benchmark and the table: each row carries
its own anchor and goal, so any benchmark (another helper's included) adds rows without the
summary knowing it. Schema, version 1 (unknown keys are refused, so a typo is seen):

``schema``        1
``bench``         the benchmark that measured it: ``"spool"``, ``"interference"``, ...
``figure``        what was measured, one line: ``"spool overflow: save() blocked"``
``value``         the figure (a finite number)
``unit``          its unit: ``"s"``, ``"x"``, ``"MB/s"``, ...
``anchor``        what it is compared with: ``"disk floor: 448 MB as fsynced 64 MiB files"``
``anchor_value``  the anchor's figure in the same unit, or ``null`` when the value is itself
                  a ratio (a slowdown) or stands alone
``ratio``         ``value / anchor_value``, or the value itself when it is a ratio; ``null``:
                  nothing to compare
``goal``          the goal for ``ratio``, or ``null`` (informational row)
``goal_op``       ``"<="`` (the default: at most the goal) or ``">="`` (at least)
``note``          optional, a few words (the cause of a miss, the run's conditions)

A row with the same ``bench`` and ``figure`` as an earlier one replaces it in the table (a
benchmark run again), keeping the first one's place. The file is untrusted input: at most
:data:`MAX_FILE_BYTES`, UTF-8, every number finite and within a float's range, every string
valid Unicode of at most :data:`MAX_TEXT_CHARS` characters; anything else is a
:class:`ResultsFileError` naming the file, the line and the field. :func:`record` writes only
figures that read back.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_FILE_BYTES", "MAX_TEXT_CHARS", "SCHEMA", "Figure", "ResultsFileError", "add_results_option", "compare",
    "read_figures", "record",
]  # fmt: skip

SCHEMA = 1
GOAL_OPS = ("<=", ">=")
MAX_FILE_BYTES = 4 * 1024 * 1024
"""A results file larger than this is refused (a ``make bench`` run appends a few kB)."""
MAX_TEXT_CHARS = 1000
"""The longest string a figure's field may hold."""


class ResultsFileError(ValueError):
    """A results file line that is no figure of this schema (names the file, line and field)."""


@dataclass(frozen=True)
class Figure:
    """One measured figure against its floor or anchor, and its goal."""

    bench: str
    figure: str
    value: float
    unit: str
    anchor: str
    anchor_value: float | None
    ratio: float | None
    goal: float | None
    goal_op: str = "<="
    note: str = ""
    schema: int = SCHEMA

    @property
    def verdict(self) -> str:
        """``pass``, ``miss``, or ``-`` (no goal, or nothing to compare)."""
        if self.goal is None or self.ratio is None:
            return "-"
        met = self.ratio <= self.goal if self.goal_op == "<=" else self.ratio >= self.goal
        return "pass" if met else "miss"


def compare(
    bench: str,
    name: str,
    value: float,
    unit: str,
    anchor: str,
    anchor_value: float | None,
    goal: float | None,
    *,
    ratio: float | None = None,
    goal_op: str = "<=",
    note: str = "",
) -> Figure:
    """A figure whose ratio is ``value / anchor_value`` unless ``ratio`` is given.
    ValueError (naming the figure) for a number that is not finite: a broken measurement is
    refused where it is made, not written to a file the summary would then refuse whole."""
    for field, number in (("value", value), ("anchor_value", anchor_value), ("goal", goal), ("ratio", ratio)):
        if number is not None and not math.isfinite(number):
            raise ValueError(f"{bench} / {name}: {field} is {number!r}, not a finite number")
    if ratio is None and anchor_value:
        ratio = value / anchor_value
    return Figure(
        bench, name, _rounded(value), unit, anchor, None if anchor_value is None else _rounded(anchor_value),
        None if ratio is None else round(ratio, 3), goal, goal_op, note,
    )  # fmt: skip


def _rounded(value: float) -> float:
    """Four significant digits (a figure of a noisy run carries no more)."""
    return float(f"{value:.4g}")


def add_results_option(parser: argparse.ArgumentParser) -> None:
    """``--results PATH``: append this run's figures there as JSON lines (default: off)."""
    parser.add_argument(
        "--results", metavar="PATH", help="append the figures as JSON lines to PATH (aiosnap bench summary PATH)"
    )


def record(path: str | Path | None, figures: Iterable[Figure]) -> None:
    """Append ``figures`` to the results file ``path`` (nothing when ``path`` is None).
    :class:`ResultsFileError` (and nothing written) when one of them would not read back."""
    if path is None:
        return
    rows = [json.dumps(asdict(f), sort_keys=True) for f in figures]
    for row, figure in zip(rows, figures, strict=True):
        _parse(_loads(row, f"{figure.bench} / {figure.figure}"), f"{figure.bench} / {figure.figure}")
    lines = "".join(row + "\n" for row in rows)
    with open(path, "a", encoding="utf-8") as out:
        out.write(lines)


_FIELDS: dict[str, tuple[type, ...]] = {
    "schema": (int,), "bench": (str,), "figure": (str,), "value": (int, float), "unit": (str,),
    "anchor": (str,), "anchor_value": (int, float, type(None)), "ratio": (int, float, type(None)),
    "goal": (int, float, type(None)), "goal_op": (str,), "note": (str,),
}  # fmt: skip
_OPTIONAL = {"goal_op", "note"}


def _parse(row: Any, where: str) -> Figure:
    if not isinstance(row, dict):
        raise ResultsFileError(f"{where}: a figure is a JSON object, not {type(row).__name__}")
    unknown = sorted(set(row) - set(_FIELDS))
    if unknown:
        raise ResultsFileError(f"{where}: unknown field(s) {unknown}")
    missing = sorted(set(_FIELDS) - _OPTIONAL - set(row))
    if missing:
        raise ResultsFileError(f"{where}: missing field(s) {missing}")
    for name, types in _FIELDS.items():
        value = row.get(name)
        if name in row and (not isinstance(value, types) or isinstance(value, bool)):
            shown = _short(repr(value))
            raise ResultsFileError(f"{where}: field {name!r} is {shown}, not {'/'.join(t.__name__ for t in types)}")
        if isinstance(value, int) and name != "schema":
            try:
                row[name] = value = float(value)
            except OverflowError:
                raise ResultsFileError(f"{where}: field {name!r} is out of the range of a float") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ResultsFileError(f"{where}: field {name!r} is {value!r}, not a finite number")
        if isinstance(value, str):
            _check_text(value, f"{where}: field {name!r}")
    if row["schema"] != SCHEMA:
        raise ResultsFileError(f"{where}: field 'schema' is {row['schema']!r}; this summary reads schema {SCHEMA}")
    if row.get("goal_op", "<=") not in GOAL_OPS:
        raise ResultsFileError(f"{where}: field 'goal_op' is {row['goal_op']!r}, not one of {list(GOAL_OPS)}")
    return Figure(**row)


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _check_text(text: str, what: str) -> None:
    if len(text) > MAX_TEXT_CHARS:
        raise ResultsFileError(f"{what} is longer than {MAX_TEXT_CHARS} characters ({len(text)})")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\\ud800"): no terminal can print it
        raise ResultsFileError(f"{what} is not valid Unicode (a lone surrogate)") from None


def _loads(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ResultsFileError(f"{where}: not JSON ({exc.msg})") from None
    except RecursionError:
        raise ResultsFileError(f"{where}: not JSON (nested too deeply)") from None
    except ValueError as exc:  # an integer over the digit limit of int()
        raise ResultsFileError(f"{where}: not JSON ({_short(str(exc))})") from None


def read_figures(path: str | Path) -> list[Figure]:
    """The figures of a results file, a later row of the same bench and figure replacing an
    earlier one in its place; :class:`ResultsFileError` names the line at fault (OSError
    when the file cannot be read)."""
    with open(path, "rb") as source:
        data = source.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ResultsFileError(f"{path}: larger than {MAX_FILE_BYTES} bytes: not a results file")
    found: dict[tuple[str, str], Figure] = {}
    for number, raw in enumerate(data.split(b"\n"), 1):
        where = f"{path}, line {number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ResultsFileError(f"{where}: not UTF-8 (byte {exc.start})") from None
        if not line.strip():
            continue
        parsed = _parse(_loads(line, where), where)
        found[(parsed.bench, parsed.figure)] = parsed
    return list(found.values())
