"""Every code block of the documentation runs, twice.

The pages are ``docs/**/*.md`` and ``README.md``. For each page, its ```python blocks run in
order in one namespace, in a fresh temporary working directory; then the whole page runs again
in the same directory (a snippet that fails on a second run is a bug: a quickstart that cannot
resume, a save of a step older than the last). Every ```yaml block is an aiosnap configuration,
validated by :func:`aiosnap.load_config` (relative paths resolved against a file in that
temporary directory). A block preceded by ``<!-- docs-test: skip (reason) -->`` is not run
(a reason is required: it needs torchrun, a GPU, a cloud account); its code must also run in
an example or a test. Blocks run in this process (torch is imported once), each page with its
own namespace; checkpointers a page leaves open are closed by the garbage collector's warning,
which fails the test (warnings are errors), so pages close what they open.
"""

from __future__ import annotations

import gc
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([*ROOT.joinpath("docs").rglob("*.md"), ROOT / "README.md"])
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
_SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->\s*$")
_MARKER = re.compile(r"<!--\s*docs-test:")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    skip: str | None


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` with their language and skip reason (if any)."""
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.search(before)
        if _MARKER.search(before) and skip is None:
            raise AssertionError(f"{page}:{text.count(chr(10), 0, match.start()) + 1}: malformed docs-test marker")
        found.append(
            Block(
                page,
                text.count("\n", 0, match.start()) + 1,
                match["lang"].lower(),
                textwrap.dedent(match["body"]),
                skip["reason"].strip() if skip else None,
            )
        )
    return found


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", [p for p in PAGES if any(b.lang == "python" for b in blocks_of(p))], ids=_page_id)
def test_python_blocks_run_twice(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runnable = [b for b in blocks_of(page) if b.lang == "python" and b.skip is None]
    if not runnable:
        pytest.skip("every python block of this page is marked skip")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # `examples/...` and `configs/...` paths are the repository's
    for run in (1, 2):
        namespace: dict[str, object] = {"__name__": "__docs__"}
        for block in runnable:
            where = f"{_page_id(page)}:{block.line}"
            try:
                exec(compile(block.code, where, "exec"), namespace)  # noqa: S102 - the docs' own code
            except BaseException as exc:
                raise AssertionError(f"{where} (run {run}) raised {type(exc).__name__}: {exc}") from exc
        del namespace
        gc.collect()  # a checkpointer the page forgot to close warns now, inside this test


@pytest.mark.parametrize("page", [p for p in PAGES if any(b.lang == "yaml" for b in blocks_of(p))], ids=_page_id)
def test_yaml_blocks_are_valid_configurations(page: Path, tmp_path: Path) -> None:
    from aiosnap import load_config

    for index, block in enumerate(b for b in blocks_of(page) if b.lang == "yaml" and b.skip is None):
        path = tmp_path / f"block{index}.yaml"
        path.write_text(block.code)
        try:
            load_config(path)
        except Exception as exc:
            raise AssertionError(f"{_page_id(page)}:{block.line}: {type(exc).__name__}: {exc}") from exc


def test_skipped_blocks_say_why_and_are_few() -> None:
    """Skips carry a reason; most of the documentation's code really runs."""
    every = [b for p in PAGES for b in blocks_of(p) if b.lang in ("python", "yaml")]
    skipped = [b for b in every if b.skip is not None]
    assert all(b.skip for b in skipped)
    assert len(skipped) <= max(4, len(every) // 4), [f"{_page_id(b.page)}:{b.line}" for b in skipped]


def test_every_page_is_in_the_site_navigation() -> None:
    """A page nobody can reach is a page nobody reads (mkdocs --strict checks links, not this)."""
    import yaml

    config = yaml.safe_load(ROOT.joinpath("mkdocs.yml").read_text())
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
    pages = {str(p.relative_to(ROOT / "docs")) for p in ROOT.joinpath("docs").rglob("*.md")}
    assert sorted(pages - listed) == []

