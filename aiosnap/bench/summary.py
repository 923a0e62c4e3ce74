"""The closing table of ``make bench``: ``aiosnap bench summary PATH`` prints every figure.

``PATH`` is the results file the benchmarks appended to with ``--results PATH`` (the JSON
line schema is in :mod:`aiosnap.bench.results`). One row per figure: its value, its floor or
anchor, the ratio, the goal, and pass or miss, so a regression is seen at a glance. Exits 0
even when a goal is missed (``--strict``: exit 1 then), 2 when the file is not a results file.
"""

from __future__ import annotations

import argparse
import sys
import unicodedata
from typing import Any

from .results import Figure, ResultsFileError, read_figures

__all__ = ["CELL_CHARS", "NOTE_CHARS", "main", "table"]

HEADER = ("bench", "figure", "value", "floor / anchor", "ratio", "goal", "")
CELL_CHARS = 100
"""A cell longer than this is cut (with ``...``): one long figure must not widen every row."""
NOTE_CHARS = 400
"""The same for a note, printed under the table."""


def _escaped(text: str, limit: int) -> str:
    """``text`` as one line of plain characters: newlines and other control or format
    characters (ESC, bidi overrides) escaped as Python would write them, ``|`` as ``\\|``
    (it would start a new cell), cut to ``limit`` characters."""
    out = []
    for char in text:
        if char == "|":
            out.append("\\|")
        elif unicodedata.category(char)[0] in "CZ" and char != " ":  # controls, format, line/para separators
            out.append(
                repr(char)[1:-1]
                if char.isascii()
                else f"\\u{ord(char):04x}"
                if ord(char) < 0x10000
                else f"\\U{ord(char):08x}"
            )
        else:
            out.append(char)
    escaped = "".join(out)
    return escaped if len(escaped) <= limit else escaped[: limit - 3] + "..."


def _number(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    text = f"{value:.0f}" if 1000 <= abs(value) < 1e15 else f"{value:.3g}"
    return f"{text} {unit}".strip()


def _row(f: Figure) -> tuple[str, ...]:
    anchor = f.anchor if f.anchor_value is None else f"{_number(f.anchor_value, f.unit)} ({f.anchor})"
    goal = "-" if f.goal is None else f"{f.goal_op} {_number(f.goal)}x"
    ratio = "-" if f.ratio is None else f"{_number(f.ratio)}x"
    cells = (f.bench, f.figure, _number(f.value, f.unit), anchor, ratio, goal, f.verdict)
    return tuple(_escaped(cell, CELL_CHARS) for cell in cells)


def table(figures: list[Figure]) -> str:
    """The figures as a Markdown table (readable as plain text too), then the count of misses
    and the notes of the rows that have one."""
    rows = [HEADER, *(_row(f) for f in figures)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in rows[1:])]
    misses = [f for f in figures if f.verdict == "miss"]
    graded = [f for f in figures if f.verdict != "-"]
    out.append(f"\n{len(graded) - len(misses)} of {len(graded)} goals met; {len(figures)} figures in all.")
    out.extend(_escaped(f"- {f.bench} / {f.figure}: {f.note}", NOTE_CHARS) for f in figures if f.note)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="aiosnap bench summary", description=__doc__)
    parser.add_argument("path", help="the results file (JSON lines, from --results PATH)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args(argv)
    try:
        figures = read_figures(args.path)
    except (ResultsFileError, OSError) as exc:
        parser.error(str(exc))
    print(table(figures))
    misses = sum(f.verdict == "miss" for f in figures)
    if args.strict and misses:
        sys.exit(1)
    return {"figures": len(figures), "misses": misses}
