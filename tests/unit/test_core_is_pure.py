"""The coordinator's core imports neither grpc, asyncio nor Prometheus (aggregation is pure).

Parsed with `ast` rather than checked through `sys.modules`, so an import
inside a function, or one that another test already loaded, cannot hide.
The rule is a folder rule: every module under `gradsync_server/dataplane/`
and `gradsync_server/control/` is core, so a new module is checked by
where it is put, not by remembering to list it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "server" / "gradsync_server"
#: The pure folders: the data plane and the control plane.
CORE_FOLDERS = ("dataplane", "control")
#: Roots no core module may import: transport, event loops and Prometheus reach the
#: core only through the observer and the events the RPC layer hands it.
FORBIDDEN = ("grpc", "grpc_health", "asyncio", "prometheus_client")
#: Server modules the core may not import either (they would bring the above along).
FORBIDDEN_MODULES = ("gradsync_server.rpc", "gradsync_server.metrics", "gradsync_server.app")
CORE = sorted(
    path.relative_to(SERVER).with_suffix("").as_posix()
    for folder in CORE_FOLDERS
    for path in (SERVER / folder).glob("*.py")
)


def imported_roots(path: Path) -> set[str]:
    """The top-level package of every import in `path`, wherever the import sits."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def imported_modules(path: Path) -> set[str]:
    """The full dotted name of every absolute import in `path`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_no_grpc_asyncio_or_prometheus(module: str) -> None:
    path = SERVER / f"{module}.py"
    bad = sorted(imported_roots(path) & set(FORBIDDEN))
    assert not bad, f"gradsync_server/{module}.py is core logic but imports {bad}"
    glue = sorted(
        name
        for name in imported_modules(path)
        if any(name == banned or name.startswith(banned + ".") for banned in FORBIDDEN_MODULES)
    )
    assert not glue, f"gradsync_server/{module}.py is core logic but imports {glue}"


#: The source roots: a dotted name is looked up as a file below one of them.
ROOTS = [SERVER.parents[1] / folder for folder in ("client", "proto", "server", "bench")]


def module_file(name: str) -> Path | None:
    """The file of project module `name` (a package's __init__), or None if not ours."""
    for root in ROOTS:
        base = root.joinpath(*name.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def reachable(start: str) -> dict[str, str]:
    """Every project module `start` loads (imports anywhere in a file), with who loads it."""
    seen: dict[str, str] = {start: ""}
    todo = [start]
    while todo:
        name = todo.pop()
        path = module_file(name)
        if path is None:
            continue
        for imported in imported_modules(path):
            if imported not in seen and module_file(imported) is not None:
                seen[imported] = name
                todo.append(imported)
    return seen


@pytest.mark.parametrize("module", CORE)
def test_nothing_the_core_loads_imports_grpc_asyncio_or_prometheus(module: str) -> None:
    # Transitively: a core module must not reach the forbidden packages through a helper.
    start = "gradsync_server." + module.replace("/", ".")
    for name, via in reachable(start).items():
        path = module_file(name)
        assert path is not None
        bad = sorted(imported_roots(path) & set(FORBIDDEN))
        assert not bad, f"{start} loads {name} (through {via or 'itself'}), which imports {bad}"


def test_the_core_folders_hold_the_job_and_the_open_step() -> None:
    # Guards the glob above: an empty CORE would make every check vacuous.
    assert "control/job" in CORE
    assert "dataplane/open_step" in CORE
    assert "dataplane/aggregation" in CORE


def test_the_guard_sees_imports_anywhere(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\n"
        "def later():\n"
        "    import asyncio.tasks\n"
        "    from grpc import aio\n"
        "from . import sibling\n"
    )
    assert imported_roots(sample) == {"os", "asyncio", "grpc"}
