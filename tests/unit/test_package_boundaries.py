"""The coordinator and the shared package import nothing of the client library.

`gradsync_server` and `gradsync_proto` may be imported where the worker's
package is not wanted (a coordinator image, the shards it starts), and a
server module that reached into `gradsync.*` would tie the coordinator to
the client's internals; what both need lives in `gradsync_proto`. Read with
`ast`, like the core's purity rule, so an import inside a function counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Source folders whose modules may not import the client package `gradsync`.
FOLDERS = ("server/gradsync_server", "proto/gradsync_proto")
MODULES = sorted(
    path.relative_to(ROOT).as_posix()
    for folder in FOLDERS
    for path in (ROOT / folder).rglob("*.py")
)


def client_imports(path: Path) -> list[str]:
    """Every absolute import of `gradsync` or a module under it, wherever it sits in `path`."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [name for name in names if name == "gradsync" or name.startswith("gradsync.")]
    return found


@pytest.mark.parametrize("module", MODULES)
def test_server_and_shared_modules_do_not_import_the_client(module: str) -> None:
    assert not client_imports(ROOT / module), f"{module} imports the client package"


def test_the_rule_sees_every_folder_and_every_spelling(tmp_path: Path) -> None:
    assert "server/gradsync_server/arguments.py" in MODULES
    assert "proto/gradsync_proto/flags.py" in MODULES
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import gradsync_proto.flags\n"
        "from gradsync_server import app\n"
        "def later():\n"
        "    import gradsync.flags\n"
        "    from gradsync import errors\n"
    )
    assert client_imports(sample) == ["gradsync.flags", "gradsync"]
