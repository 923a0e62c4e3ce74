"""The ```python blocks of docs/guides/dcp.md and docs/guides/converter.md run as they are:
the blocks of one page in order in one namespace, in a fresh folder, and a second time in
the same folder (a snippet that fails on a second run is a bug). A block preceded by
``<!-- docs-test: skip (reason) -->`` is left out (its code runs in a test elsewhere)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs" / "guides"
BLOCK = re.compile(r"(<!-- docs-test: skip \([^)]*\) -->\n)?```python\n(.*?)```", re.DOTALL)


def _script(page: Path) -> str:
    return "\n".join(code for skip, code in BLOCK.findall(page.read_text()) if not skip)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", ["dcp.md", "converter.md"])
def test_the_page_runs_twice(page: str, tmp_path: Path) -> None:
    script = _script(DOCS / page)
    assert script.strip()
    env = {**os.environ, "PYTHONPATH": str(DOCS.parent.parent), "AIOSNAP_EVENTS__LOG": "false"}
    for attempt in (1, 2):
        run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                             timeout=100, env=env)  # fmt: skip
        assert run.returncode == 0, f"run {attempt} of {page}:\n{run.stdout}\n{run.stderr[-3000:]}"
