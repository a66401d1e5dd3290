"""Stock DDP over "gradsync" survives a coordinator killed with SIGKILL and started again.

Two real ranks (`support/workers/backend_worker.py`, scenario ddp_steps) train a
small MLP with stock `torch.nn.parallel.DistributedDataParallel`, the same
script once over gloo and once over "gradsync" (torch's TCPStore for the
rendezvous, which the coordinator's death leaves alone). Mid-training the
coordinator is killed with SIGKILL and a new one started on the same port:
the groups reconnect, rejoin their job and send their collectives in flight
again, and the run ends equal to gloo's, with no step recomputed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gradsync_proto.net.launch import free_port
from support.backend_launch import BackendRun, finish_backend_runs, start_backend_ranks
from support.processes import WORKERS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

BACKEND_WORKER = WORKERS / "backend_worker.py"
WORLD = 2
STEPS = 14
#: Steps done (on rank 0) before the coordinator is killed.
KILL_AFTER_STEP = 4


def start(backend: str, out: Path, coordinator: str) -> BackendRun:
    return start_backend_ranks(
        BACKEND_WORKER,
        backend,
        "ddp_steps",
        WORLD,
        out,
        coordinator,
        *("--steps", str(STEPS)),
        start_apart_s=0.0,
        # Rank 0 waits in every step for rank 1: it has collectives in flight at the kill.
        per_rank={1: ["--step-delay-s", "0.15"]},
    )


def steps_done(out: Path) -> int:
    try:
        return int((out / "rank0.npz.progress").read_text() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def test_stock_ddp_survives_a_coordinator_killed_and_restarted_on_its_port(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    port = str(free_port())
    first = coordinator_factory(WORLD, "--port", port)
    out = tmp_path / "ours"
    run = start("gradsync", out, first.address)
    reference = start("gloo", tmp_path / "gloo", "unused:1")  # beside it, to save time
    deadline = time.monotonic() + 60
    while steps_done(out) < KILL_AFTER_STEP:
        assert time.monotonic() < deadline, "the ranks never reached the kill step"
        if any(p.poll() is not None for p in run.processes.values()):
            finish_backend_runs(run, timeout_s=90)  # (raises with the ranks' output)
            pytest.fail("a rank exited before the kill step")
        time.sleep(0.02)
    first.process.kill()  # SIGKILL: no goodbye, every collective in flight lost
    first.process.wait()
    killed_at = steps_done(out)
    time.sleep(1.0)  # the ranks notice and start reconnecting
    second = coordinator_factory(WORLD, "--port", port)
    ours, gloo = finish_backend_runs(run, reference, timeout_s=90)
    assert killed_at < STEPS - 1, "the run ended before the coordinator was killed"
    _, log = second.stop()
    # The group's job came back at the second coordinator, both ranks claiming where
    # their collectives stood, and it carried the rest of the run.
    assert "job 'default.pg-world': rank 0 joined" in log, log
    assert "job 'default.pg-world': rank 1 joined" in log, log
    assert "collectives resumed at" in log, log
    keys = sorted(k for k in gloo[0] if k.startswith("model/"))
    assert keys
    # Rank 0 sent its collectives in flight again (each rank sends every collective from
    # the lowest one a rank claimed on).
    assert int(ours[0]["resent"]) >= 1, ours[0]
    for rank in range(WORLD):
        assert int(ours[rank]["reconnects"]) == 1, ours[rank]
        for key in keys:
            difference = float(np.abs(ours[rank][key] - gloo[rank][key]).max(initial=0.0))
            assert difference <= 1e-6, f"{key} on rank {rank}: {difference:.3g} from gloo"
