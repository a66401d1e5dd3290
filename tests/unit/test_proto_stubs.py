"""The checked-in stubs must be exactly what scripts/gen_proto.sh generates."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ["gradsync_pb2.py", "gradsync_pb2.pyi"]


def test_generated_stubs_match_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is part of the test extra")
    copy = tmp_path / "repo"
    (copy / "proto" / "gradsync_proto" / "v1").mkdir(parents=True)
    (copy / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "gen_proto.sh", copy / "scripts")
    shutil.copy(
        ROOT / "proto" / "gradsync_proto" / "v1" / "gradsync.proto",
        copy / "proto" / "gradsync_proto" / "v1",
    )
    subprocess.run(
        ["bash", str(copy / "scripts" / "gen_proto.sh")],
        check=True,
        timeout=60,
        env=dict(os.environ, PYTHON=sys.executable),
    )
    fresh_files = {p.name for p in (copy / "proto" / "gradsync_proto" / "v1").iterdir()}
    assert fresh_files == {"gradsync.proto", *GENERATED}, "the script generates other files"
    for name in GENERATED:
        fresh = (copy / "proto" / "gradsync_proto" / "v1" / name).read_text()
        checked_in = (ROOT / "proto" / "gradsync_proto" / "v1" / name).read_text()
        assert fresh == checked_in, f"{name} is stale: run scripts/gen_proto.sh and commit"


def test_every_proto_field_and_enum_value_is_commented() -> None:
    lines = (ROOT / "proto" / "gradsync_proto" / "v1" / "gradsync.proto").read_text().splitlines()
    for number, line in enumerate(lines):
        stripped = line.strip()
        is_field = (
            stripped.endswith(";")
            and "=" in stripped
            and not stripped.startswith(("syntax", "package", "option", "//"))
        )
        if is_field:
            previous = lines[number - 1].strip()
            assert previous.startswith("//"), f"line {number + 1} has no comment: {stripped}"
