"""The coordinator and the shared package import nothing of the client library, and the
benchmarks nothing but the library's public API.

`gradsync_server` and `gradsync_proto` may be imported where the worker's
package is not wanted (a coordinator image, the shards it starts), and a
server module that reached into `gradsync.*` would tie the coordinator to
the client's internals; what both need lives in `gradsync_proto`.

`gradsync_bench` measures what users run: it imports `gradsync` as users do
(the package and the names in its `__all__`, never a module under it but
`gradsync.distributed`, the torch.distributed backend users import by name),
`gradsync_proto` (what every process shares, no private name), and never the
coordinator's package (it starts coordinators through the CLI or
`gradsync_proto.net.launch`). Read with `ast`, like the core's purity rule,
so an import inside a function counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gradsync
import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Modules under `gradsync` that are public API of their own (users import them by name).
PUBLIC_MODULES = ("gradsync.distributed",)
#: Source folders whose modules may not import the client package `gradsync`.
FOLDERS = ("server/gradsync_server", "proto/gradsync_proto")
MODULES = sorted(
    path.relative_to(ROOT).as_posix()
    for folder in FOLDERS
    for path in (ROOT / folder).rglob("*.py")
)
BENCH_MODULES = sorted(
    path.relative_to(ROOT).as_posix() for path in (ROOT / "bench/gradsync_bench").rglob("*.py")
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


def internal_imports(path: Path, public: set[str]) -> list[str]:
    """Every use in `path` of the library beyond its public API (see the module docstring):
    a module under `gradsync` or a name outside `public` (imported, or read as
    `gradsync.<name>`), anything of `gradsync_server`, a private name of `gradsync_proto`."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
            found += [
                m
                for m in modules
                if m.startswith(("gradsync.", "gradsync_server")) and m not in PUBLIC_MODULES
            ]
            found += [m for m in modules if m.startswith("gradsync_proto") and "._" in m]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module, names = node.module, [alias.name for alias in node.names]
            if module in PUBLIC_MODULES:
                pass
            elif module.startswith(("gradsync.", "gradsync_server")):
                found.append(module)
            elif module == "gradsync":
                found += [f"gradsync.{name}" for name in names if name not in public]
            elif module.startswith("gradsync_proto"):
                found += [f"{module}.{n}" for n in names if n.startswith("_") or "._" in module]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "gradsync"
            and node.attr not in public
            and f"gradsync.{node.attr}" not in PUBLIC_MODULES
        ):
            found.append(f"gradsync.{node.attr}")
    return found


@pytest.mark.parametrize("module", BENCH_MODULES)
def test_the_benchmarks_use_only_the_public_api(module: str) -> None:
    assert not internal_imports(ROOT / module, set(gradsync.__all__)), (
        f"{module} uses the library's internals"
    )


def test_the_bench_rule_sees_every_module_and_every_spelling(tmp_path: Path) -> None:
    assert "bench/gradsync_bench/runner.py" in BENCH_MODULES
    assert "bench/gradsync_bench/churn_schedule.py" in BENCH_MODULES
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import gradsync\n"
        "from gradsync import DiLoCo, errors\n"
        "from gradsync_proto.net.launch import start_coordinator, _private\n"
        "import gradsync_proto._hidden\n"
        "from gradsync_server.dataplane import aggregation\n"
        "def later():\n"
        "    import gradsync.status\n"
        "    from gradsync.ddp import DistributedDataParallel\n"
        "    import gradsync_server.app\n"
        "    return gradsync.DistributedDataParallel, gradsync.control\n"
    )
    assert sorted(internal_imports(sample, {"DiLoCo", "DistributedDataParallel"})) == [
        "gradsync.control",
        "gradsync.ddp",
        "gradsync.errors",
        "gradsync.status",
        "gradsync_proto._hidden",
        "gradsync_proto.net.launch._private",
        "gradsync_server.app",
        "gradsync_server.dataplane",
    ]
