"""`gradsync bench --netns-wires`: 16-bit wire jobs and DDP's bf16 hook on an emulated cluster.

The smallest cluster that shows them (dedicated, W = S = 2, 1 MB): every method ran in
the same worker processes and has a real time, the plan records the wires, and the
table is written. (Times are not compared here: a 1 MB sync on a shared machine is noise.)
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from gradsync_bench.netns_probe import available
from gradsync_bench.wire_report import DDP_BF16

pytestmark = pytest.mark.system


@pytest.mark.timeout(300)
def test_the_16_bit_wires_and_ddps_hook_are_timed_in_every_row(tmp_path: Path) -> None:
    capable, reason = available()
    if not capable:
        pytest.skip(reason)
    flags = ["--suites", "netns", "--layouts", "dedicated", "--shards", "2", "--worlds", "2"]
    flags += ["--sizes-mb", "1", "--reps", "2", "--netns-wires", "bf16,fp16"]
    result = subprocess.run(
        [sys.executable, "-m", "gradsync.cli", "bench", "--out", str(tmp_path), *flags],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "latest.json").read_text())
    assert document["plan"]["netns_wires"] == ["bf16", "fp16"]
    (row,) = document["suites"]["netns"]
    for method in ("gradsync", "bf16", "fp16", DDP_BF16, "gloo"):
        assert math.isfinite(row[method]["median_ms"]) and row[method]["median_ms"] > 0, method
    table = (tmp_path / "latest.md").read_text()
    assert "**16-bit wire on the emulated cluster**" in table
    assert "| dedicated | 2 | 2 | 1 |" in table.split("16-bit wire", 1)[1]
