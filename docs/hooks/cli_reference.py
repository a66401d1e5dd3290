"""MkDocs hook: the CLI reference page, rendered from the real `gradsync` argparse parsers.

docs/reference/cli.md is committed as a short page: a title, an introduction and the marker
line `<!-- gradsync-cli-reference -->`. At build time this hook replaces the marker (in
memory only: nothing is written into the repository) with one section per subcommand of
`gradsync.arguments.build_parser()`, the parser `gradsync` itself runs: its usage line, its
description, and a table of every flag with its help text and default. The page therefore
cannot drift from the code: a new flag, or a changed help text or default, shows up at the
next build. Help texts are expanded as `--help` expands them (`%(default)s`).

Defaults that the parser reads from the environment (`$GRADSYNC_COORDINATOR`, `$RANK`,
...) are read with those variables unset, so the page does not depend on the shell that
built it. A page without the marker fails the build rather than silently showing nothing.

Registered in mkdocs.yml under `hooks:`; the page is reached at reference/cli/.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

#: The page this hook fills, relative to docs/.
PAGE = "reference/cli.md"
#: The line of PAGE that the generated reference replaces.
MARKER = "<!-- gradsync-cli-reference -->"
#: Environment variables that parser defaults are read from (gradsync.config's ENV_*, the
#: security flags' $GRADSYNC_TLS_* and token variables), unset while the parser is built.
_ENV_PREFIXES = ("GRADSYNC_", "RAY_")
_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
#: Usage lines are wrapped at this width whatever the terminal building the site.
_USAGE_COLUMNS = "88"
#: The repository's source roots (pyproject's packages.find), for a build without gradsync
#: installed.
_ROOT = Path(__file__).resolve().parents[2]
_SOURCE_ROOTS = ("client", "proto", "server", "bench")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace the marker of the CLI page with the generated reference; other pages pass."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"docs/{PAGE} lost its marker line {MARKER!r}: nothing to fill")
    return markdown.replace(MARKER, render(_build_parser()), 1)


def render(parser: argparse.ArgumentParser) -> str:
    """The Markdown reference of `parser`: its own options, then one section per subcommand."""
    commands = _subcommands(parser)
    lines = [
        "## Subcommands",
        "",
        "| command | what it does |",
        "|---|---|",
        *(
            f"| [`{parser.prog} {name}`](#{_anchor(parser, name)}) | {_cell(summary)} |"
            for name, summary, _ in commands
        ),
        "",
        f"## `{parser.prog}`",
        "",
        *_section_body(parser, parser.description or ""),
    ]
    for name, summary, subparser in commands:
        lines += [f"## `{parser.prog} {name}`", "", *_section_body(subparser, summary)]
    return "\n".join(lines)


def _section_body(parser: argparse.ArgumentParser, summary: str) -> list[str]:
    """Usage block, description and flag table of one parser."""
    with _fixed_width():
        usage = parser.format_usage().strip()
    lines = ["```text", usage, "```", ""]
    description = parser.description or summary
    if description:
        lines += [_sentence(description), ""]
    rows = [action for action in parser._actions if _documented(action)]
    if rows:
        lines += ["| flag | default | help |", "|---|---|---|"]
        lines += [
            f"| {_flag_cell(action)} | {_default_cell(action)} | {_cell(_help(parser, action))} |"
            for action in rows
        ]
        lines.append("")
    return lines


def _subcommands(
    parser: argparse.ArgumentParser,
) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of every subcommand, in the order they were added."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, subparser in action.choices.items():
                found.append((name, helps.get(name, ""), subparser))
    return found


def _documented(action: argparse.Action) -> bool:
    """Whether a flag gets a row: not --help, not a subcommand switch, not hidden."""
    return (
        not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
        and action.help != argparse.SUPPRESS
    )


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's help as `--help` prints it: `%(default)s` and friends expanded."""
    if not action.help:
        return ""
    params: dict[str, Any] = dict(vars(action), prog=parser.prog)
    for name in list(params):
        if params[name] is argparse.SUPPRESS:
            del params[name]
    for name in list(params):
        if hasattr(params[name], "__name__"):
            params[name] = params[name].__name__
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(choice) for choice in params["choices"])
    return action.help % params


def _flag_cell(action: argparse.Action) -> str:
    """`--flag METAVAR` (all its spellings), or the positional argument's name."""
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    if action.nargs == 0:
        return ", ".join(f"`{option}`" for option in action.option_strings)
    metavar = action.metavar or (
        "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper()
    )
    spellings = ", ".join(f"`{option} {metavar}`" for option in action.option_strings)
    return spellings + (" (required)" if action.required else "")


def _default_cell(action: argparse.Action) -> str:
    """The default as the user sees it; "-" for none (a required flag, an unset env var)."""
    if isinstance(action, argparse._VersionAction):
        return "-"
    if action.nargs == 0 and isinstance(action.default, bool):
        return "on" if action.default else "off"
    if action.default is None or action.default is argparse.SUPPRESS or action.required:
        return "-"
    return _cell(f"`{action.default}`")


def _cell(text: str) -> str:
    """Text safe inside one Markdown table cell: one line, pipes escaped, and outside
    `code` no emphasis or HTML ("W * N", "<path>" stay as typed)."""
    parts = " ".join(str(text).split()).replace("|", "\\|").split("`")
    for index in range(0, len(parts), 2):  # the even parts lie outside code spans
        parts[index] = parts[index].replace("*", "\\*").replace("<", "&lt;")
    return "`".join(parts)


def _sentence(text: str) -> str:
    """The first letter capitalised, a full stop at the end."""
    text = " ".join(text.split())
    text = text[:1].upper() + text[1:]
    return text if text.endswith((".", "!", "?", ")")) else text + "."


def _anchor(parser: argparse.ArgumentParser, name: str) -> str:
    """The id Python-Markdown's toc gives the heading "`gradsync NAME`"."""
    return f"{parser.prog}-{name}".lower()


@contextmanager
def _fixed_width() -> Iterator[None]:
    """argparse wraps usage at $COLUMNS: fix it while formatting."""
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = _USAGE_COLUMNS
    try:
        yield
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


@contextmanager
def _without_parser_environment() -> Iterator[None]:
    """Unset the variables the parser takes defaults from; put them back afterwards."""
    names = [name for name in os.environ if name.startswith(_ENV_PREFIXES) or name in _ENV_NAMES]
    saved = {name: os.environ.pop(name) for name in names}
    try:
        yield
    finally:
        os.environ.update(saved)


def _build_parser() -> argparse.ArgumentParser:
    """`gradsync.arguments.build_parser()`, from the source tree if gradsync is not installed."""
    try:
        from gradsync.arguments import build_parser
    except ImportError:
        sys.path[:0] = [str(_ROOT / root) for root in _SOURCE_ROOTS]
        from gradsync.arguments import build_parser
    with _without_parser_environment():
        return build_parser()
