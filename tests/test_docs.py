"""Every ```python block of the documentation (``docs/**/*.md`` and README.md) runs as written.

The blocks of one page run in order in one namespace, in a fresh interpreter whose working
directory is a new temporary folder, and then a second time in that same folder (a snippet
that fails on a second run, say a save of a step that now exists, is a bug). A block right
after a line ``<!-- docs-test: skip (reason) -->`` is left out: its code must live in an
example or a test that runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent
PAGES = [*sorted((REPO / "docs").rglob("*.md")), REPO / "README.md"]
SKIP = re.compile(r"^<!-- docs-test: skip \(.+\) -->$")

RUNNER = """
import json, sys, traceback
page, blocks = sys.argv[1], json.loads(sys.argv[2])
namespace = {"__name__": "__main__"}
for line, code in blocks:
    try:  # padded so that a traceback names the page's own line numbers
        exec(compile("\\n" * line + code, page, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"the python block at {page}:{line} failed")
"""


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line of the first code line - 1, code)`` of each ```python block not marked skip."""
    blocks: list[tuple[int, str]] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        if lines[index].strip() != "```python":
            index += 1
            continue
        before = next((lines[i].strip() for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
        if not SKIP.match(before):
            blocks.append((index + 1, "\n".join(lines[index + 1 : end]) + "\n"))
        index = end + 1
    return blocks


def test_blocks_are_found_and_skips_honoured() -> None:
    text = "# t\n```python\nx = 1\n```\n\n<!-- docs-test: skip (needs a GPU) -->\n```python\nraise SystemExit\n```\n"
    assert python_blocks(text) == [(2, "x = 1\n")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_python_blocks_of_a_page_run_twice_in_one_folder(page: Path, tmp_path: Path) -> None:
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    if not blocks:
        pytest.skip(f"{page.name} has no python block")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOSNAP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    for attempt in ("first", "second"):
        run = subprocess.run(
            [sys.executable, "-c", RUNNER, str(page), json.dumps(blocks)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert run.returncode == 0, f"{attempt} run:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
