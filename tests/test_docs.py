"""Every code block of the documentation (``docs/**/*.md`` and README.md) runs as written.

The ```python blocks of one page run in order in one namespace, in a fresh interpreter whose
working directory is a new temporary folder, and then a second time in that same folder (a
snippet that fails on a second run, say a save of a step that now exists, is a bug). Every
```yaml block is an aiosnap configuration, validated by :func:`aiosnap.load_config`. A block
right after a line ``<!-- docs-test: skip (reason) -->`` is left out (a reason is required:
it needs torchrun, a GPU, a cloud account); its code must live in an example or a test that
runs, and such blocks stay few. Every page is reachable from the site's navigation.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent
PAGES = [*sorted((REPO / "docs").rglob("*.md")), REPO / "README.md"]
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
_SKIP = re.compile(r"^<!-- docs-test: skip \((?P<reason>.+)\) -->$")
_MARKER = re.compile(r"<!--\s*docs-test:")

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


@dataclass(frozen=True)
class Block:
    line: int
    """The line of the opening fence (1-based): the code starts on the next one."""
    lang: str
    code: str
    skip: str | None


def blocks_of(text: str, where: str = "<page>") -> list[Block]:
    """The fenced blocks of a page with their language and skip reason (if any)."""
    found = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = next((ln.strip() for ln in reversed(text[: match.start()].splitlines()) if ln.strip()), "")
        skip = _SKIP.match(before)
        if _MARKER.search(before) and skip is None:
            raise AssertionError(f"{where}:{line}: malformed docs-test marker {before!r}")
        reason = skip["reason"].strip() if skip else None
        found.append(Block(line, match["lang"].lower(), textwrap.dedent(match["body"]), reason))
    return found


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line of the first code line - 1, code)`` of each ```python block not marked skip."""
    return [(b.line, b.code) for b in blocks_of(text) if b.lang == "python" and b.skip is None]


def _page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def test_blocks_are_found_and_skips_honoured() -> None:
    text = "# t\n```python\nx = 1\n```\n\n<!-- docs-test: skip (needs a GPU) -->\n```python\nraise SystemExit\n```\n"
    assert python_blocks(text) == [(2, "x = 1\n")]
    with pytest.raises(AssertionError, match="malformed"):
        blocks_of("<!-- docs-test: skip -->\n```python\nx = 1\n```\n")


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
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


@pytest.mark.parametrize(
    "page", [p for p in PAGES if any(b.lang == "yaml" for b in blocks_of(p.read_text(encoding="utf-8")))], ids=_page_id
)
def test_yaml_blocks_are_valid_configurations(page: Path, tmp_path: Path) -> None:
    from aiosnap import load_config

    yaml_blocks = [b for b in blocks_of(page.read_text(encoding="utf-8")) if b.lang == "yaml" and b.skip is None]
    for index, block in enumerate(yaml_blocks):
        path = tmp_path / f"block{index}.yaml"
        path.write_text(block.code)
        try:
            load_config(path)
        except Exception as exc:
            raise AssertionError(f"{_page_id(page)}:{block.line}: {type(exc).__name__}: {exc}") from exc


def test_skipped_blocks_say_why_and_are_few() -> None:
    """Skips carry a reason; most of the documentation's code really runs."""
    every = [(p, b) for p in PAGES for b in blocks_of(p.read_text(encoding="utf-8"), _page_id(p))]
    code = [(p, b) for p, b in every if b.lang in ("python", "yaml")]
    skipped = [f"{_page_id(p)}:{b.line}" for p, b in code if b.skip is not None]
    assert len(skipped) <= max(4, len(code) // 4), skipped


def test_every_page_is_in_the_site_navigation() -> None:
    """A page nobody can reach is a page nobody reads (mkdocs --strict checks links, not this)."""
    import yaml

    config = yaml.safe_load(REPO.joinpath("mkdocs.yml").read_text())
    listed: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, str):
            listed.add(node)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config["nav"])
    pages = {str(p.relative_to(REPO / "docs")) for p in REPO.joinpath("docs").rglob("*.md")}
    assert sorted(pages - listed) == []
