"""``python -m aiosnap.bench NAME [options]``: run one benchmark (see :mod:`aiosnap.bench`)."""

from __future__ import annotations

import sys

from . import BENCHMARKS, describe_benchmarks, run

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        sys.exit(f"usage: python -m aiosnap.bench NAME [options]\n\n{describe_benchmarks()}")
    run(sys.argv[1], sys.argv[2:])
