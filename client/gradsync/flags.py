"""Argument types of the `gradsync` command: every flag's range is checked by argparse.

The types both the worker's and the coordinator's flags take (counts, ports,
durations, sizes, addresses, names) are `gradsync_proto.flags`, where the
coordinator's flags (declared on `gradsync_server.config.CoordinatorConfig`)
import them too, with `add_flags`, which builds a subcommand's flags from a
config dataclass; they are re-exported here so that every flag of the
client's subcommands reads `flags.<type>`. This module adds the types only those subcommands take:
files and folders written later, and comma-separated lists. As there, a bad
value is an `ArgumentTypeError`, which argparse reports naming the flag
(exit status 2), never a traceback later.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from gradsync_proto.flags import (
    add_flags,
    chunk_mb,
    coordinator,
    integer,
    non_empty,
    number,
    port,
    positive_int,
    positive_number,
    seconds,
    seconds_or_zero,
)

__all__ = [
    "add_flags",
    "choice_list",
    "chunk_mb",
    "coordinator",
    "integer",
    "non_empty",
    "number",
    "number_list",
    "output_file",
    "output_folder",
    "port",
    "positive_int",
    "positive_number",
    "seconds",
    "seconds_or_zero",
]

T = TypeVar("T")


def output_file(text: str) -> Path:
    """An argparse type: a file to write later; its folder must exist now.

    Checked at start so that a typo fails in a second, not after training.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(folder)!r} of {text} does not exist")
    return path


def output_folder(text: str) -> Path:
    """An argparse type: a folder to create (if needed) and write into later.

    It may not exist yet, but it must not be a file, and the closest folder
    above it that exists must be a folder, so the write at the end cannot fail
    on the path itself.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    path = Path(text)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{str(existing)!r} is a file, not a folder")
    return path


def number_list(kind: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse type: comma-separated values, each checked by `kind`."""

    def parse(text: str) -> list[T]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}")
        return [kind(item) for item in items]

    return parse


def choice_list(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma-separated subset of `allowed`."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        unknown = sorted(set(items) - set(allowed))
        if unknown or not items:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown} in {text!r}: choose from {','.join(allowed)}"
                if unknown
                else f"expected a comma-separated subset of {','.join(allowed)}"
            )
        return items

    return parse
