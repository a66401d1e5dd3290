"""The import graph is the architecture drawing: ARCHITECTURE.md shows the tree's own.

Each folder package (`gradsync.path`, `gradsync_server.rpc`, ...) is a layer.
The block between the `import-graph` markers in ARCHITECTURE.md lists, for
every folder package, the folder packages its modules import (anywhere in the
module, an import inside a function included; only `if TYPE_CHECKING:` blocks
are left out, since they never run). This test recomputes that list from the
source and fails when the two differ, so the drawing is regenerated whenever
the layering changes (the failure prints the block to paste). The layers also
import one way: no folder package reaches, directly or through others, back
into one that imports it.

Top-level modules (`gradsync.errors`, `gradsync_server.config`, ...) are the
packages' shared ground and their public faces; they are not layers here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Source folder of each top-level package drawn.
PACKAGES = {
    "gradsync": ROOT / "client" / "gradsync",
    "gradsync_server": ROOT / "server" / "gradsync_server",
    "gradsync_proto": ROOT / "proto" / "gradsync_proto",
}
#: Folder packages holding generated or data-only code, not drawn.
NOT_DRAWN = {"gradsync_proto.v1"}
BEGIN = "<!-- import-graph:begin -->"
END = "<!-- import-graph:end -->"


def layers() -> dict[str, Path]:
    """Every folder package below a top-level package, by dotted name."""
    found = {}
    for package, folder in PACKAGES.items():
        for child in sorted(folder.iterdir()):
            name = f"{package}.{child.name}"
            if (child / "__init__.py").is_file() and name not in NOT_DRAWN:
                found[name] = child
    return found


def _runs(node: ast.AST) -> list[ast.AST]:
    """`node`'s descendants, less the bodies of `if TYPE_CHECKING:` blocks."""
    kept: list[ast.AST] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            kept.extend(_runs(ast.Module(body=child.orelse, type_ignores=[])))
            continue
        kept.append(child)
        kept.extend(_runs(child))
    return kept


def imported_modules(path: Path) -> set[str]:
    """Every absolute import target of `path` (`from a.b import c` gives `a.b` and `a.b.c`)."""
    found: set[str] = set()
    for node in _runs(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def layer_of(module: str, known: dict[str, Path]) -> str | None:
    """The folder package `module` lies in, or None (a top-level module, or not ours)."""
    parts = module.split(".")
    name = ".".join(parts[:2])
    return name if len(parts) >= 2 and name in known else None


def graph() -> dict[str, set[str]]:
    """Each folder package -> the other folder packages its modules import."""
    known = layers()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, folder in known.items():
        for path in folder.rglob("*.py"):
            for module in imported_modules(path):
                target = layer_of(module, known)
                if target is not None and target != name:
                    edges[name].add(target)
    return edges


def render(edges: dict[str, set[str]]) -> str:
    """The block ARCHITECTURE.md shows: one line per folder package."""
    width = max(len(name) for name in edges)
    lines = [
        f"{name:<{width}} -> {', '.join(sorted(targets)) if targets else '(nothing of ours)'}"
        for name, targets in sorted(edges.items())
    ]
    return "```\n" + "\n".join(lines) + "\n```"


def reaches_back(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs (a, b) where a imports b and b reaches a again: a layering circle."""

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in edges.get(todo.pop(), set()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    return sorted((a, b) for a, targets in edges.items() for b in targets if a in reach(b))


def test_architecture_md_shows_the_tree_s_import_graph() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    assert BEGIN in text and END in text, "ARCHITECTURE.md lost its import-graph markers"
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    expected = render(graph())
    assert shown == expected, f"update ARCHITECTURE.md's import graph to:\n{expected}"


def test_folder_packages_import_one_way() -> None:
    edges = graph()
    assert {"gradsync.path", "gradsync.control", "gradsync_server.dataplane"} <= set(edges)
    assert reaches_back(edges) == []


def test_the_graph_sees_function_imports_and_skips_type_checking(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "from gradsync.path import inbox\n"
        "if TYPE_CHECKING:\n"
        "    from gradsync.control.link import SessionLink\n"
        "def later():\n"
        "    import gradsync.local.hierarchy\n"
    )
    found = imported_modules(sample)
    assert {"gradsync.path", "gradsync.path.inbox", "gradsync.local.hierarchy"} <= found
    assert not any(name.startswith("gradsync.control") for name in found)
    assert reaches_back({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ("a", "b"),
        ("b", "c"),
        ("c", "a"),
    ]
