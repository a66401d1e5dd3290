"""Helpers shared by the fault-tolerance tests: run fault workers, read their reports."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gradsync.status import query_status

from support import scenarios
from support.processes import reap

HEARTBEAT = ("--heartbeat-interval", "0.25", "--heartbeat-timeout", "2")


def finish(
    processes: list[subprocess.Popen[bytes]], out: Path, timeout_s: float = 90
) -> list[dict | None]:
    deadline = time.monotonic() + timeout_s
    reports: list[dict | None] = []
    try:
        for rank, process in enumerate(processes):
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
            path = out / f"rank{rank}.json"
            reports.append(json.loads(path.read_text()) if path.exists() else None)
    finally:
        reap(processes)
    return reports


def params_of(report: dict) -> dict[str, np.ndarray]:
    return {name: np.array(values) for name, values in report["params"].items()}


def assert_matches_reference(report: dict, world_size: int, steps: int) -> None:
    reference = scenarios.reference_training(world_size, steps, init_seed=0)
    got = params_of(report)
    for name, param in reference.named_parameters():
        expected = param.detach().double().numpy()
        error = np.linalg.norm(got[name] - expected) / np.linalg.norm(expected)
        assert error <= 1e-6, (name, error)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def job_status(address: str) -> object | None:
    try:
        reply = query_status(address, "default", timeout_s=2)
    except ConnectionError:
        return None
    return reply.jobs[0] if reply.jobs else None
