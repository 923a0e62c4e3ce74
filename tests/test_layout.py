"""The package's shape: imports run one way, from the shims down to the primitives, with no
circles, and the package root holds only the public surface.

Layers, top to bottom; a module may import its own layer and those below, never above. The
trainer side and the transfer side never import each other (they talk through
``aiosnap.handoff.contract``), and the transfer side never imports torch (the upload process runs
without it).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "aiosnap"

LAYERS: list[set[str]] = [
    {
        "__init__",
        "__main__",
        "checkpointer",
        "lifecycle",
        "cli",
        "cli_export",
        "integrations",
        "bench",
        "testing",
        "dcp",
    },
    {"service", "distributed", "runtime"},
    {"trainer", "transfer"},
    {"catalog", "load", "handoff", "interop"},
    {"format"},
    {"storage"},
    {"errors", "config", "core"},
]


def _unit(module: str) -> str:
    """``aiosnap.trainer.capture`` -> ``trainer``; ``aiosnap.service`` -> ``service``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(unit: str) -> int:
    for index, layer in enumerate(LAYERS):
        if unit in layer:
            return index
    raise AssertionError(f"module group {unit!r} is in no layer of tests/test_layout.py")


def _submodule_or_package(package: str, name: str) -> str:
    """``from aiosnap import durable`` names a module; ``from aiosnap import Config`` a name."""
    folder = PACKAGE.parent.joinpath(*package.split("."))
    is_module = (folder / f"{name}.py").exists() or (folder / name).is_dir()
    return f"{package}.{name}" if is_module else package


def _imports(path: Path) -> list[str]:
    """Absolute names of the aiosnap modules ``path`` imports (TYPE_CHECKING ones too)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("aiosnap"):
                found += [_submodule_or_package(name, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("aiosnap")]
    return found


def test_imports_run_one_way() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for target in _imports(path):
            a, b = _unit(here), _unit(target)
            if a == b:
                continue
            if _layer(b) < _layer(a) or {a, b} == {"trainer", "transfer"}:
                wrong.append(f"{here} imports {target}")
    assert wrong == []


def test_the_transfer_side_runs_without_torch() -> None:
    code = (
        "import sys, aiosnap.transfer.local, aiosnap.transfer.resume, aiosnap.storage.s3, aiosnap.catalog.garbage\n"
        "print('torch' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.strip() == "False", run.stdout + run.stderr


def _runtime_imports(path: Path) -> set[str]:
    """aiosnap modules that importing ``path`` imports: at module level, outside ``if
    TYPE_CHECKING:`` (an import inside a function is a deliberate late binding)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name.startswith("aiosnap"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                if name.startswith("aiosnap"):
                    found.update(_submodule_or_package(name, alias.name) for alias in node.names)

    visit(ast.parse(path.read_text()).body)
    found.discard(module)
    return {name for name in found if not module.startswith(name + ".")}  # a package above: not a module edge


def test_no_import_circles() -> None:
    """Also inside one layer (``trainer.plan`` and ``trainer.archive_plan`` once imported
    each other)."""
    graph = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): _runtime_imports(p)
        for p in sorted(PACKAGE.rglob("*.py"))
    }
    state: dict[str, int] = {}
    circles: list[str] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in state:
                walk(target, stack)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [])
    assert circles == []


def test_the_package_root_holds_only_the_public_surface() -> None:
    """Primitives live in ``aiosnap.core``, the trainer/transfer contract in
    ``aiosnap.handoff``; the root keeps the shims, the engine, config, errors and the CLI."""
    assert sorted(p.stem for p in PACKAGE.glob("*.py")) == [
        "__init__", "__main__", "checkpointer", "cli", "cli_export", "config", "errors", "lifecycle", "service",
    ]  # fmt: skip
