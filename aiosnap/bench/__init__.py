"""Benchmarks, one module each; ``aiosnap bench NAME [options]`` or ``python -m aiosnap.bench NAME``.

Each module has ``main(argv)`` and prints JSON figures (ratios measured in one run against
a baseline); with ``--results PATH`` the headline figures are also appended to ``PATH`` as
JSON lines (:mod:`.results`), which ``summary`` prints as one table at the end of ``make
bench``. Importing this package imports no benchmark.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

__all__ = ["BENCHMARKS", "describe_benchmarks", "run"]

BENCHMARKS = {
    "local": "aiosnap.bench.local",
    "s3": "aiosnap.bench.s3",
    "spool": "aiosnap.bench.spool",
    "lightning": "aiosnap.bench.lightning",
    "load": "aiosnap.bench.load",
    "many": "aiosnap.bench.many",
    "interference": "aiosnap.bench.interference",
    "executor": "aiosnap.bench.executor",
    "distributed": "aiosnap.bench.distributed",
    "dcp": "aiosnap.bench.dcp",
    "safetensors": "aiosnap.bench.safetensors",
    "gpu": "aiosnap.bench.gpu",
    "summary": "aiosnap.bench.summary",
    "incremental": "aiosnap.bench.incremental",
}
"""Benchmark name -> module."""


def run(name: str, argv: list[str]) -> None:
    """Run benchmark ``name`` with its own command-line options (its usage lines name it as
    ``aiosnap bench NAME``)."""
    program = sys.argv[0] if sys.argv else ""
    sys.argv[:1] = [f"aiosnap bench {name}"]  # argparse's default program name
    try:
        importlib.import_module(BENCHMARKS[name]).main(argv)
    finally:
        sys.argv[:1] = [program]


def describe_benchmarks() -> str:
    """One line per benchmark: its name and the first line of its module's docstring (read
    from the source: no benchmark, nor torch, is imported)."""
    lines = []
    for name, module in BENCHMARKS.items():
        spec = importlib.util.find_spec(module)
        source = Path(spec.origin).read_text(encoding="utf-8") if spec is not None and spec.origin else ""
        summary = (ast.get_docstring(ast.parse(source)) or "").strip().splitlines()
        lines.append(f"  {name:<13} {summary[0] if summary else ''}")
    return "benchmarks:\n" + "\n".join(lines)
