"""Strict checkpoint store URLs: a Redis address without its scheme is never a directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from gradsync.cli import main
from gradsync_server.config import CoordinatorConfig
from gradsync_server.store.stores import StoreLocation, parse_store_url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://10.213.0.3:6379/0", StoreLocation("redis", "redis://10.213.0.3:6379/0")),
        ("rediss://cache:6380/1", StoreLocation("redis", "rediss://cache:6380/1")),
        ("file:///var/lib/gradsync", StoreLocation("file", "/var/lib/gradsync")),
        ("file:relative/dir", StoreLocation("file", "relative/dir")),
        ("/var/lib/gradsync", StoreLocation("file", "/var/lib/gradsync")),
        ("checkpoints", StoreLocation("file", "checkpoints")),
        ("./10.213.0.3:6379/0", StoreLocation("file", "./10.213.0.3:6379/0")),
        ("runs/host:1/x", StoreLocation("file", "runs/host:1/x")),
    ],
)
def test_unambiguous_urls_are_accepted(url: str, expected: StoreLocation) -> None:
    assert parse_store_url(url) == expected


@pytest.mark.parametrize(
    "url", ["10.213.0.3:6379/0", "redis:6379/0", "localhost:6379", "[::1]:6379/2", "cache:1"]
)
def test_host_port_without_a_scheme_is_refused(url: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_store_url(url)
    message = str(caught.value)
    assert repr(url) in message and f"redis://{url}" in message


def test_server_config_refuses_an_ambiguous_store() -> None:
    with pytest.raises(ValueError, match="looks like a network address"):
        CoordinatorConfig(world_size=2, checkpoint_store="10.213.0.3:6379/0")


def test_cli_refuses_an_ambiguous_store_at_start_up(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as caught:
        main(["serve", "--world-size", "2", "--checkpoint-store", "10.213.0.3:6379/0"])
    assert caught.value.code == 2
    error = capsys.readouterr().err
    assert "--checkpoint-store" in error and "redis://10.213.0.3:6379/0" in error
    assert not any(tmp_path.iterdir()), "nothing may be created for a refused store"
