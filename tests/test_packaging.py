"""What ``pip install .`` puts on a user's machine: a wheel built from a copy of the source
holds the package with its ``py.typed`` marker and the license, and no tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

REPO = Path(__file__).parent.parent


def test_the_wheel_holds_the_package_typed_and_licensed_and_no_tests(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(REPO / "aiosnap", source / "aiosnap", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "tests", source / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(  # offline: this interpreter's setuptools, no build isolation
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=source, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("aiosnap-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "aiosnap/py.typed" in names and "aiosnap/cli.py" in names
    assert not [n for n in names if n.startswith(("tests/", "examples/", "configs/"))], names
    assert not [n for n in names if n.endswith(".whl")]
    info = next(n for n in names if n.endswith(".dist-info/METADATA"))
    metadata = Parser().parsestr(zipfile.ZipFile(wheel).read(info).decode())
    assert metadata["License-Expression"] == "Apache-2.0"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "Typing :: Typed" in metadata.get_all("Classifier", [])
    assert metadata["Keywords"] and not metadata.get_all("Project-URL")  # no public home yet: no made-up URLs
    assert {"s3", "lightning"} <= set(metadata.get_all("Provides-Extra", []))
    entry_points = zipfile.ZipFile(wheel).read(info.replace("METADATA", "entry_points.txt")).decode()
    assert "aiosnap = aiosnap.cli:main" in entry_points


def test_the_repository_ships_the_license_it_names() -> None:
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a pointer to it
    assert not list(REPO.glob("*.whl")), "no stray wheels at the repository root"


def test_no_made_up_host_is_named_as_the_projects_home() -> None:
    """Until aiosnap has a public repository, install lines name the clone's own URL."""
    texts = {p: p.read_text() for p in [REPO / "pyproject.toml", REPO / "README.md", *(REPO / "docs").rglob("*.md")]}
    for placeholder in (".invalid", "<git host>", "<owner>"):
        assert not [p.name for p, text in texts.items() if placeholder in text], placeholder
    assert "git+file:///path/to/aiosnap" in texts[REPO / "README.md"]
