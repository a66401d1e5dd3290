"""docker-compose files as Docker would see them, without Docker.

`load_compose(*files)` merges override files onto the first the way
`docker compose -f a.yml -f b.yml` does, for what our files use: services and
top-level sections merge key by key, a service's `command` (and any other scalar
or list) is replaced, except `volumes` and `ports`, which merge by their target.
"""

from __future__ import annotations

import copy
import shlex
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "docker-compose.yml"
SHARDED = ROOT / "docker-compose.sharded.yml"
#: The compose variants: the files `docker compose -f ... -f ...` is given for each.
VARIANTS: dict[str, tuple[Path, ...]] = {"base": (BASE,), "sharded": (BASE, SHARDED)}


def _target(entry: Any) -> str:
    """What a `volumes`/`ports` entry is keyed by when merging: its container side."""
    if isinstance(entry, dict):
        return str(entry.get("target"))
    parts = str(entry).split(":")
    return parts[1] if len(parts) > 1 and not parts[-1].isdigit() else parts[-1]


def _merge_service(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if key in ("volumes", "ports") and key in merged:
            by_target = {_target(entry): entry for entry in merged[key]}
            by_target.update({_target(entry): entry for entry in value})
            merged[key] = list(by_target.values())
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **copy.deepcopy(value)}
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_compose(*files: Path) -> dict[str, Any]:
    """The merged compose document of `files` (the first is the base)."""
    document: dict[str, Any] = {}
    for path in files:
        layer: dict[str, Any] = yaml.safe_load(path.read_text())
        for section, entries in layer.items():
            if section.startswith("x-"):
                continue  # extension fields: only their anchors matter, already resolved
            if section != "services":
                document[section] = {**document.get(section, {}), **(entries or {})}
                continue
            services = document.setdefault("services", {})
            for name, service in entries.items():
                services[name] = _merge_service(services.get(name, {}), service)
    return document


def command_argv(service: dict[str, Any]) -> list[str]:
    """A service's command as an argv list (compose accepts a string or a list)."""
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else list(command)
