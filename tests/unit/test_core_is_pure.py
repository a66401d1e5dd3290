"""The coordinator's core imports neither grpc nor asyncio (architecture: aggregation is pure).

Parsed with `ast` rather than checked through `sys.modules`, so an import
inside a function, or one that another test already loaded, cannot hide.
The list of core modules is explicit, and a second test fails when a server
module is in neither list, so a new module has to be sorted on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "server" / "gradsync" / "server"
FORBIDDEN = ("grpc", "grpc_health", "asyncio")

#: Pure logic: the job and its components, and everything they use.
CORE = (
    "__init__",
    "actions",
    "admission",
    "aggregation",
    "assembly",
    "broadcast",
    "budget",
    "checkpoint",
    "checkpoint_file",
    "checkpoint_redis",
    "checkpoint_seal",
    "chunk_checks",
    "collectives",
    "config",
    "elastic",
    "errors",
    "host_groups",
    "job",
    "job_ending",
    "liveness",
    "membership",
    "metrics",
    "nonfinite",
    "open_step",
    "persistence",
    "progress",
    "shard_config",
    "shard_jobs",
    "shard_metrics",
    "shard_registry",
    "shard_view",
    "segments",
    "signature",
    "status",
    "step_aborts",
    "step_checks",
    "stores",
    "text",
    "uneven",
    "uploads",
    "wire_replies",
)
#: Glue that may use gRPC and asyncio: streams, process wiring, background tasks.
GLUE = (
    "app",
    "auth_check",
    "checkpointer",
    "connection",
    "local_shards",
    "payload_socket",
    "servicer",
    "shard_app",
    "shard_control",
    "shard_link",
    "shard_servicer",
    "stream_guard",
    "watchdog",
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


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_no_grpc_or_asyncio(module: str) -> None:
    path = SERVER / f"{module}.py"
    assert path.is_file(), f"{path} is listed as core but does not exist"
    bad = sorted(imported_roots(path) & set(FORBIDDEN))
    assert not bad, f"gradsync.server.{module} is core logic but imports {bad}"


def test_every_server_module_is_sorted_into_core_or_glue() -> None:
    modules = {path.stem for path in SERVER.glob("*.py")}
    assert not set(CORE) & set(GLUE)
    unsorted = sorted(modules - set(CORE) - set(GLUE))
    assert not unsorted, f"server modules in neither CORE nor GLUE: {unsorted}"
    missing = sorted((set(CORE) | set(GLUE)) - modules)
    assert not missing, f"listed modules that no longer exist: {missing}"


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
