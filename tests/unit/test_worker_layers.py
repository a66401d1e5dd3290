"""The worker's folders import one way: `path` below `local` below `control`.

`gradsync.path` (the gradient path: buckets, uploads, shard data streams) knows
nothing of a session; `gradsync.local` (same-host groups) composes gradient
paths; `gradsync.control` (the session link, the Sync stream that carries it,
healing) drives both. A module may import its own folder and those below it,
never one above: checked on every import a module makes (inside functions and
`TYPE_CHECKING` blocks too), so a new module is checked by where it is put.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "client" / "gradsync"
#: Lowest first: each folder may import only itself and the folders before it.
LAYERS = ("path", "local", "control")


def imported_folders(source: str) -> set[str]:
    """The worker folders (`LAYERS`) a module's source imports from, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if len(parts) >= 2 and parts[0] == "gradsync" and parts[1] in LAYERS:
                found.add(parts[1])
    return found


def upward_imports(package: Path) -> list[str]:
    """Every "module imports folder" that goes from a lower folder to a higher one."""
    wrong = []
    for rank, folder in enumerate(LAYERS):
        modules = sorted((package / folder).glob("*.py"))
        assert modules, f"no modules in {package / folder}"
        for path in modules:
            above = imported_folders(path.read_text()) - set(LAYERS[: rank + 1])
            wrong.extend(f"{folder}/{path.name} imports gradsync.{name}" for name in sorted(above))
    return wrong


def test_the_worker_folders_import_one_way() -> None:
    assert upward_imports(PACKAGE) == []


def test_the_check_finds_an_upward_import(tmp_path: Path) -> None:
    for folder in LAYERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "path" / "low.py").write_text(
        "def late():\n    from gradsync.control.link import SessionLink\n"
    )
    (tmp_path / "local" / "mid.py").write_text("import gradsync.path.buffers\n")
    (tmp_path / "control" / "top.py").write_text("from gradsync.local import mid\n")
    assert upward_imports(tmp_path) == ["path/low.py imports gradsync.control"]
