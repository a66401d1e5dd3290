"""A process group's trace file (`gradsync.distributed.op_trace`), fed by hand.

The phases come from the group's queue, its link and its stream in a real run
(tests/multiprocess/test_backend.py checks those); here the file a rank writes
is checked for what each call records: the names, the phases in order, a
collective numbered outside any operation ignored, two groups in one file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from gradsync.distributed.op_trace import (
    ENV_TRACE,
    UPLOAD_END,
    UPLOAD_START,
    OpTrace,
    resolve_trace_path,
    trace_file,
)


def test_the_path_names_the_global_rank() -> None:
    assert trace_file("/t/run-{rank}.json", 3) == Path("/t/run-3.json")
    assert trace_file("/t/trace.json", 2) == Path("/t/trace-rank2.json")
    assert trace_file("/t/trace", 0) == Path("/t/trace-rank0")


def test_the_option_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_TRACE, raising=False)
    assert resolve_trace_path(None) is None
    monkeypatch.setenv(ENV_TRACE, "/env/{rank}.json")
    assert resolve_trace_path(None) == "/env/{rank}.json"
    assert resolve_trace_path(Path("/opt.json")) == "/opt.json"


def _spans(path: Path) -> tuple[dict[int, str], list[dict[str, Any]]]:
    events = json.loads(path.read_text())
    tracks = {
        e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
    }
    return tracks, [e for e in events if e["ph"] == "X"]


def test_an_operation_s_phases_are_written_in_order(tmp_path: Path) -> None:
    world = OpTrace(str(tmp_path / "t-{rank}.json"), 1, "job.pg-world")
    sub = OpTrace(str(tmp_path / "t-{rank}.json"), 1, "job.pg-abc")  # the same file
    world.issued(0, "allreduce(sum, [4] float32)")
    with world.running(0):
        world.numbered(7)  # the link's collective 7 carries operation 0
    world.numbered(8)  # numbered outside any operation (a leader's thread): not attributed
    world.on_link_event(UPLOAD_START, 7, -1)
    world.on_link_event(UPLOAD_START, 8, -1)
    time.sleep(0.002)
    world.on_link_event(UPLOAD_END, 7, -1)
    world.on_link_event("averaged", 7, -1)  # (the wrapper's events are not the trace's)
    world.received(0)
    sub.issued(0, "barrier")
    sub.completed(0, False, time.perf_counter())
    world.completed(0, True, time.perf_counter())
    world.close()
    assert not (tmp_path / "t-1.json").read_text().rstrip().endswith("]")  # sub still open
    sub.close()
    sub.close()  # idempotent
    tracks, spans = _spans(tmp_path / "t-1.json")
    named = {name: tid for tid, name in tracks.items()}
    assert {"job.pg-world ops", "job.pg-world wire", "job.pg-abc ops"} <= set(named)
    (op,) = [s for s in spans if s["tid"] == named["job.pg-world ops"]]
    args = op["args"]
    assert op["name"] == "allreduce(sum, [4] float32)" and args["ok"] is True
    phases = [
        args[k]
        for k in ("issued", "first_byte_sent", "last_byte_sent", "result_received", "completed")
    ]
    assert None not in phases and phases == sorted(phases)
    assert args["last_byte_sent"] - args["first_byte_sent"] >= 1500  # microseconds
    wire = [s["name"] for s in spans if s["tid"] == named["job.pg-world wire"]]
    assert wire == ["send", "result"]
    (barrier,) = [s for s in spans if s["tid"] == named["job.pg-abc ops"]]
    assert barrier["args"]["ok"] is False
    assert barrier["args"]["first_byte_sent"] is None  # it sent nothing traced
