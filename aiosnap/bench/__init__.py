"""Benchmarks, one module each; ``aiosnap bench NAME [options]`` or ``python -m aiosnap.bench NAME``.

Each module has ``main(argv)`` and prints JSON figures (ratios measured in one run against
a baseline). Importing this package imports no benchmark.
"""

from __future__ import annotations

import importlib

__all__ = ["BENCHMARKS", "run"]

BENCHMARKS = {
    "local": "aiosnap.bench.local",
    "s3": "aiosnap.bench.s3",
    "spool": "aiosnap.bench.spool",
    "lightning": "aiosnap.bench.lightning",
    "load": "aiosnap.bench.load",
    "many": "aiosnap.bench.many",
    "interference": "aiosnap.bench.interference",
    "distributed": "aiosnap.bench.distributed",
    "safetensors": "aiosnap.bench.safetensors",
}
"""Benchmark name -> module."""


def run(name: str, argv: list[str]) -> None:
    """Run benchmark ``name`` with its own command-line options."""
    importlib.import_module(BENCHMARKS[name]).main(argv)
