"""The ```python blocks of docs/guides/dcp.md and docs/guides/converter.md run as they are:
the blocks of one page in order in one namespace, in a fresh folder, and a second time in
the same folder (a snippet that fails on a second run is a bug). A block preceded by
``<!-- docs-test: skip (reason) -->`` is left out (its code runs in a test elsewhere). Both
pages run in one fresh interpreter (torch is imported once), each in a namespace of its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs" / "guides"
PAGES = ["dcp.md", "converter.md"]
BLOCK = re.compile(r"(<!-- docs-test: skip \([^)]*\) -->\n)?```python\n(.*?)```", re.DOTALL)
RUNNER = """
import json, os, sys, traceback
for page, folder, script in json.loads(sys.argv[1]):
    os.makedirs(folder, exist_ok=True)
    os.chdir(folder)
    try:
        exec(compile(script, page, "exec"), {"__name__": "__main__"})
    except BaseException:
        print(f"FAILED {page} in {folder}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def _script(page: Path) -> str:
    return "\n".join(code for skip, code in BLOCK.findall(page.read_text()) if not skip)


@pytest.mark.timeout(150)
def test_the_pages_run_and_run_again(tmp_path: Path) -> None:
    runs = []
    for page in PAGES:
        script = _script(DOCS / page)
        assert script.strip(), page
        folder = str(tmp_path / page.removesuffix(".md"))
        runs += [(page, folder, script), (page, folder, script)]  # the second run in the same folder
    env = {**os.environ, "PYTHONPATH": str(DOCS.parent.parent), "AIOSNAP_EVENTS__LOG": "false"}
    run = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(runs)], capture_output=True, text=True,
                         timeout=140, env=env)  # fmt: skip
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-4000:]}"
