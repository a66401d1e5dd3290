"""The guard that fails a test session which wrote into the repository.

Tests write under `tmp_path`; anything else they create or modify in the
checkout would end up committed (as a stray checkpoint once did). `snapshot`
lists what git sees as changed or untracked, with each file's size and
modification time, ignoring what .gitignore covers; `changes` compares two
snapshots, so files that were already dirty before the session count only if
the session touched them again.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

#: path -> (porcelain status, size, mtime in ns); missing files have size and mtime -1.
Snapshot = dict[str, tuple[str, int, int]]


def repository_root(start: Path) -> Path | None:
    """The root of the git checkout holding `start`, or None (no git, or not a checkout)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"],
            cwd=start,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError:
        return None
    return Path(done.stdout.strip()) if done.returncode == 0 else None


def snapshot(root: Path) -> Snapshot:
    """What `git status --porcelain --untracked-files=all` lists under `root`, and file stats."""
    listing = subprocess.run(
        ["git", "status", "--porcelain=v1", "-z", "--untracked-files=all"],
        cwd=root,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode(errors="surrogateescape")
    entries = listing.split("\0")
    found: Snapshot = {}
    index = 0
    while index < len(entries):
        entry = entries[index]
        index += 1
        if not entry:
            continue
        status, path = entry[:2], entry[3:]
        if status[0] in "RC":
            index += 1  # a rename or copy is followed by its source path
        try:
            stat = (root / path).stat()
            found[path] = (status, stat.st_size, stat.st_mtime_ns)
        except OSError:
            found[path] = (status, -1, -1)
    return found


def changes(before: Snapshot, after: Snapshot) -> list[str]:
    """Paths that are new in `after`, or whose status, size or mtime differs from `before`.

    A path that was dirty before and is clean after (someone restored it) is not listed.
    """
    return sorted(path for path, state in after.items() if before.get(path) != state)
