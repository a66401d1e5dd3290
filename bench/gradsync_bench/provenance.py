"""Where a benchmark result came from: the commit of the code that ran and its command line.

Both are recorded in every result document (`latest.json`) and in the header of its
table (`latest.md`), so a number can be traced back to the code and the flags that made
it. Nothing is guessed: outside a git checkout of this code the commit is "unknown".
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

#: The commit recorded when the running code is not a git checkout (or git is missing).
UNKNOWN = "unknown"
#: Program names that stand for the `gradsync` command: the console script, and
#: `python -m gradsync.cli` (whose argv[0] is the module's file).
_CLI_PROGRAMS = ("gradsync", "cli.py")


def commit() -> str:
    """The git commit of the code that runs, with "+dirty" when tracked files differ from it.

    Returns:
        The 40-hex commit, or `UNKNOWN` when git is missing, this package is not in a
        checkout, or it is an installed copy that merely lives inside some checkout (a
        virtual environment under a repository), whose HEAD would not be this code's.
    """
    here = Path(__file__).resolve().parent
    try:
        top = _git(here, "rev-parse", "--show-toplevel")
        if (Path(top) / "bench" / "gradsync_bench").resolve() != here:
            return UNKNOWN
        head = _git(here, "rev-parse", "HEAD")
        changed = _git(here, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    if not head:
        return UNKNOWN
    return head + ("+dirty" if changed else "")


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran (default: this process's `sys.argv`), quoted as a shell takes it.

    The program is shown as `gradsync` when it is the CLI (the console script's full path,
    or `gradsync/cli.py` under `python -m gradsync.cli`); any other program is kept as is.
    """
    words = list(sys.argv if argv is None else argv)
    if words and Path(words[0]).name in _CLI_PROGRAMS:
        words[0] = "gradsync"
    return shlex.join(words)


def _git(cwd: Path, *args: str) -> str:
    """`git *args` in `cwd`; its stripped output (raises when git fails or is missing)."""
    result = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=True
    )
    return result.stdout.strip()
