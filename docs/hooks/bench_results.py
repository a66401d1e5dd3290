"""MkDocs hook: the latest benchmark results on the performance page, read from bench/results/.

docs/performance.md is committed with the marker line `<!-- gradsync-bench-results -->`. At
build time this hook replaces it (in memory only: nothing is written into the repository)
with one section per result set that `gradsync bench` wrote: bench/results/latest.md (the
default suites' full run) first, then every folder of bench/results/ that holds a
latest.md, in SUITE_ORDER and then by name. Each section is headed by the run's date and
states its machine, commit and command line, read from the latest.json beside the table
(`started_at`, `machine`, `commit`, `command`); result sets written before the bench
recorded the commit and the command say "not recorded" instead. The body is the table
file itself, less its own header lines (restated above it), with its plot (latest.png)
added to the site as a generated file.

Result files keep their working history in their prose; the page does not: a prose line
that names a tracker entry or a work session by its number is left out, and such a
reference inside a table row is cut from the cell. Tables and headers are
shown as written.

Registered in mkdocs.yml under `hooks:`; a page without the marker fails the build.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

#: The page this hook fills, relative to docs/.
PAGE = "performance.md"
#: The line of PAGE that the generated results replace.
MARKER = "<!-- gradsync-bench-results -->"
#: Where `gradsync bench --out` wrote the results this page shows.
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
#: The result folders in the order the page shows them; any other folder follows by name.
SUITE_ORDER = (
    "loopback",
    "train",
    "latency",
    "wan",
    "wan-compact",
    "sharded",
    "sharded-w8",
    "sharded-wire16",
    "churn",
    "heal",
)
#: Where the plots go in the built site.
PLOTS = "performance"
#: A reference to a tracker entry or a work session by its number: history, not
#: documentation. "session" alone is a protocol term; a number followed by a unit (a
#: duration) and a hyphenated compound (a churn failure kind and its count) are not
#: references. tests/system/test_docs.py checks every user-facing doc with this pattern.
HISTORY = re.compile(
    r"(?<![\w-])(?:stop|issue|session)s?[ -]?#?\d+"
    r"(?![\d.]*\s*(?:s|ms|seconds?|minutes?|min|h)\b)",
    re.IGNORECASE,
)
#: The header lines that `gradsync_bench.runner.markdown` starts a table file with.
_HEADER = re.compile(r"^(?:Measured \S+ on |Commit \S+; command: )")


def on_files(files: Files, config: Any) -> Files:
    """Add every result set's plot to the site (copied from bench/results/ when built)."""
    for name, folder in result_sets():
        plot = folder / "latest.png"
        if plot.is_file():
            files.append(File.generated(config, _plot_uri(name), abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace the marker of the performance page with the results; other pages pass."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"docs/{PAGE} lost its marker line {MARKER!r}: nothing to fill")
    return markdown.replace(MARKER, render(), 1)


def result_sets() -> list[tuple[str, Path]]:
    """(name, folder) of every result set with a latest.md: "all suites" first."""
    found = [("all suites", RESULTS)] if (RESULTS / "latest.md").is_file() else []
    folders = [
        path for path in RESULTS.iterdir() if path.is_dir() and (path / "latest.md").is_file()
    ]
    rank = {name: index for index, name in enumerate(SUITE_ORDER)}
    folders.sort(key=lambda path: (rank.get(path.name, len(rank)), path.name))
    return found + [(path.name, path) for path in folders]


def render() -> str:
    """The Markdown of every result set, each under its own heading."""
    sets = result_sets()
    if not sets:
        raise PluginError(f"no latest.md under {RESULTS}: nothing to show on docs/{PAGE}")
    lines: list[str] = []
    for name, folder in sets:
        lines += _section(name, folder)
    return "\n".join(lines)


def _section(name: str, folder: Path) -> list[str]:
    """One result set: heading with its date, then machine, commit, command, table, plot."""
    document = _document(folder)
    where = folder.relative_to(RESULTS.parents[1]).as_posix()
    started = str(document.get("started_at", "not recorded"))
    suites = ", ".join(document.get("plan", {}).get("suites", [])) or "not recorded"
    lines = [
        f"### {name if name != 'all suites' else 'The default suites'}: {started[:10]}",
        "",
        f"- **date**: {started}{_duration(document)}",
        f"- **machine**: {_machine(document)}",
        f"- **commit**: {_code(document.get('commit'))}",
        f"- **command**: {_code(document.get('command'))}",
        f"- **suites**: {suites}",
        f"- **files**: `{where}/latest.md`, `{where}/latest.json`",
        "",
    ]
    lines += _body((folder / "latest.md").read_text(encoding="utf-8"))
    if (folder / "latest.png").is_file():
        lines += ["", f"![{name}: plot of the results]({_plot_uri(name)})", ""]
    return lines


def _body(text: str) -> list[str]:
    """The table file's lines without its header and without history in its prose."""
    kept: list[str] = []
    for line in text.splitlines():
        if _HEADER.match(line):
            continue
        if line.lstrip().startswith("|"):
            kept.append(HISTORY.sub("", line))
        elif line.startswith("#"):
            # Headings inside a table file sit below this page's section heading.
            kept.append("###" + line)
        elif not HISTORY.search(line):
            kept.append(line)
    return kept


def _document(folder: Path) -> dict[str, Any]:
    """The latest.json beside the table ({} when it is missing or unreadable)."""
    try:
        loaded = json.loads((folder / "latest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _machine(document: dict[str, Any]) -> str:
    """ "2 cores (AMD EPYC), Linux-..., Python 3.11.7, torch 2.13.0+cpu, grpcio 1.85.3"."""
    machine = document.get("machine")
    if not isinstance(machine, dict):
        return "not recorded"
    parts = [f"{machine.get('cores', '?')} cores ({machine.get('cpu_model', 'unknown CPU')})"]
    parts += [
        f"{label} {machine[key]}"
        for key, label in (("python", "Python"), ("torch", "torch"), ("grpcio", "grpcio"))
        if key in machine
    ]
    if "platform" in machine:
        parts.append(f"`{machine['platform']}`")
    return ", ".join(parts)


def _duration(document: dict[str, Any]) -> str:
    """ ", run took 1881 s" when the document says so."""
    duration = document.get("duration_s")
    return f", run took {duration:.0f} s" if isinstance(duration, int | float) else ""


def _code(value: Any) -> str:
    """A recorded value in code style, or "not recorded"."""
    return f"`{value}`" if value else "not recorded"


def _plot_uri(name: str) -> str:
    """The plot's path in the site (relative to docs/, as pages link to it)."""
    return f"{PLOTS}/{name.replace(' ', '-')}.png"
