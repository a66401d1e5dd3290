"""What a DiLoCo rank exports about its rounds: a real /metrics endpoint and a real trace file.

Two real ranks run streaming DiLoCo (two fragments, a bf16 wire) against a real
`gradsync serve`, each serving its metrics on a port of its own and writing a
trace; at the end each scrapes its own endpoint over HTTP. The numbers must be
the run's: every fragment's rounds counted, the inner steps, the bytes each way
(bf16 up, float32 global parameters down), one exposed-wait sample and one trace
span per round, and both ranks contributing; `gradsync status` shows each
fragment's job with its outer rounds and the state it holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gradsync import defaults
from gradsync.status import format_status, query_status
from prometheus_client.parser import text_string_to_metric_families
from support.diloco_reference import Run, make_model
from support.processes import WORKERS, run_ranks

DILOCO_WORKER = WORKERS / "diloco_worker.py"
WORLD = 2


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape by (name, sorted labels)."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


@pytest.mark.timeout(120)
def test_round_metrics_and_trace_count_what_the_rounds_did(
    tmp_path: Path, coordinator_factory
) -> None:
    coordinator = coordinator_factory(WORLD)
    run = Run(rounds=3, fragments=2, wire="bf16")
    traces = tmp_path / "traces"
    traces.mkdir()
    outputs = run_ranks(
        DILOCO_WORKER, coordinator.address, WORLD, tmp_path, *run.argv(), "--metrics"
    )
    # The trace run is separate so that one of them failing names which part broke.
    traced = tmp_path / "traced"
    traced.mkdir()
    run_ranks(
        DILOCO_WORKER,
        coordinator.address,
        WORLD,
        traced,
        *run.argv(),
        "--job-id",
        "traced",
        "--trace",
        str(traces),
    )
    float32_bytes = sum(p.numel() * 4 for p in make_model(0, run.hidden).parameters())
    for rank, saved in enumerate(outputs):
        found = samples(bytes(saved["metrics"]).decode())
        label = (("rank", str(rank)),)
        assert found[("gradsync_diloco_inner_steps_total", label)] == run.rounds * run.sync_every
        for fragment in range(run.fragments):
            key = ("gradsync_diloco_rounds_total", (("fragment", str(fragment)), *label))
            assert found[key] == run.rounds, (rank, fragment, found[key])
        rounds = run.rounds * run.fragments
        assert found[("gradsync_diloco_exposed_wait_seconds_count", label)] == rounds
        assert found[("gradsync_diloco_round_seconds_count", label)] == rounds
        # Every round brings back the fragment's global parameters in float32.
        assert found[("gradsync_diloco_received_bytes_total", label)] == run.rounds * float32_bytes
        sent = found[("gradsync_diloco_sent_bytes_total", label)]
        assert 0.4 < sent / (run.rounds * float32_bytes) < 0.75, sent  # bf16 up
        assert found[("gradsync_diloco_last_round_contributors", label)] == WORLD
    # `gradsync status` knows each fragment's job for a DiLoCo one, and what it holds.
    reply = query_status(coordinator.address)
    jobs = {job.job_id: job for job in reply.jobs}
    held = 0
    for fragment in range(run.fragments):
        job = jobs[f"{defaults.JOB_ID}.fragment{fragment}"]
        assert job.outer and job.outer_rounds == run.rounds, job
        held += job.outer_state_bytes
    assert held == 2 * float32_bytes  # the global parameters and the momentum, once each
    assert f"DiLoCo: {run.rounds} outer rounds applied" in format_status(reply)
    for rank in range(WORLD):
        events = json.loads((traces / f"rank{rank}.json").read_text())  # closed: valid JSON
        spans = [e for e in events if e.get("ph") == "X" and e["name"].startswith("round (")]
        assert len(spans) == run.rounds * run.fragments, [e["name"] for e in spans]
        assert {span["name"] for span in spans} == {"round (fragment 0)", "round (fragment 1)"}
        assert all(span["dur"] > 0 and span["pid"] == rank for span in spans)
        waits = [e for e in events if e.get("name") == "wait for round"]
        assert len(waits) == run.rounds * run.fragments  # no overlap: every round is waited for
