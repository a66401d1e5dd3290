"""gradsync as a torch.distributed backend against gloo, in real processes.

The same unchanged scripts (`support/workers/backend_worker.py`) run once over
"gloo" and once over "gradsync" (a real `gradsync serve` coordinator; torch's
TCPStore for the rendezvous): stock DDP on zoo models, a loop with
`DistributedSampler()`, a metric all-reduce and barriers, and every
collective. Their results must match gloo's. Stock DDP on a bfloat16 wire
equals a one-process reference of the same rounding. A shape mismatch fails every
rank naming both shapes; a killed rank fails the others' pending Work with
`DistBackendError` naming it, within the heartbeat timeout. With $GRADSYNC_TRACE
set, every rank's trace holds each operation's phases in order. Each test checks in
the coordinator's log that the group's job really ran there.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gradsync_proto.net.launch import free_port
from prometheus_client.parser import text_string_to_metric_families
from support.backend_launch import finish_backend_runs, start_backend_ranks
from support.processes import WORKERS, CoordinatorProcess

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

BACKEND_WORKER = WORKERS / "backend_worker.py"
#: Zoo cases for stock DDP: plain, BatchNorm buffers, unused parameters, no_sync, and
#: uneven inputs under DDP's join().
DDP_CASES = "mlp,cnn_batchnorm,unused_branch_adam,sometimes_unused,no_sync,join_uneven"
#: Ranks start this far apart, the highest first.
START_APART_S = 0.7


def run(
    backend: str,
    scenario: str,
    world: int,
    out: Path,
    coordinator: str,
    *extra: str,
    timeout_s: float = 180,
    expect_exit: dict[int, int] | None = None,
) -> list[dict[str, Any]]:
    """Run every rank of `scenario` (the highest rank first, each started apart);
    return what each saved (an empty dict for a rank that saved nothing)."""
    started = start_backend_ranks(
        BACKEND_WORKER,
        backend,
        scenario,
        world,
        out,
        coordinator,
        *extra,
        start_apart_s=START_APART_S,
    )
    return finish_backend_runs(started, timeout_s=timeout_s, expect_exit=expect_exit)[0]


def assert_job_ran(coordinator: CoordinatorProcess, world: int) -> tuple[int, str]:
    """The coordinator's own log shows the group's job assembled with every rank;
    return how it stopped (exit status, the rest of its log)."""
    code, log = coordinator.stop()
    for rank in range(world):
        assert f"job 'default.pg-world': rank {rank} joined" in log, log
    return code, log


@pytest.mark.parametrize(
    ("world", "hierarchical"),
    [pytest.param(2, "0", id="W2-flat"), pytest.param(3, "", id="W3-host")],
)
def test_stock_ddp_over_gradsync_equals_gloo(
    world: int, hierarchical: str, tmp_path: Path, coordinator_factory: Any
) -> None:
    """W = 2 with $GRADSYNC_HIERARCHICAL=0 (every rank sends its own input); W = 3 with
    the default, where the three ranks of this host sum each float all-reduce in shared
    memory and only rank 0 uploads it: the coordinator receives about one input per
    all-reduce, not three."""
    metrics_port = free_port()
    coordinator = coordinator_factory(world, "--metrics-port", str(metrics_port))
    extra = ("--cases", DDP_CASES)
    gloo = run("gloo", "ddp", world, tmp_path / "gloo", "unused:1", *extra)
    ours = run(
        "gradsync",
        "ddp",
        world,
        tmp_path / "ours",
        coordinator.address,
        *extra,
        *(("--hierarchical", hierarchical) if hierarchical else ()),
    )
    received = scrape_metrics(metrics_port)[
        'gradsync_collective_bytes_total{direction="received",op="all_reduce_sum"}'
    ]
    assert_job_ran(coordinator, world)
    if hierarchical == "0":
        assert all("host_members" not in ours[rank] for rank in range(world))
    else:
        uploaded = int(ours[0]["host_uploaded_bytes"])
        for rank in range(world):
            assert list(ours[rank]["host_members"]) == list(range(world))
            # Every rank took the same ops through it (DDP's float32 buckets).
            assert int(ours[rank]["host_ops"]) == int(ours[0]["host_ops"]) > 10
            assert int(ours[rank]["host_uploaded_bytes"]) == (uploaded if rank == 0 else 0)
        # The leader's uploads, plus every rank's own small integer all-reduces (DDP's
        # unused-parameter maps and join()): far below three inputs per all-reduce.
        assert uploaded <= received < 1.5 * uploaded, (received, uploaded)
    keys = sorted(k for k in gloo[0] if "/" in k)
    assert {k.split("/")[0] for k in keys} == set(DDP_CASES.split(","))
    for rank in range(world):
        assert str(ours[rank]["backend"]) == "gradsync"
        assert sorted(k for k in ours[rank] if "/" in k) == keys
        for key in keys:
            difference = float(np.abs(ours[rank][key] - gloo[rank][key]).max(initial=0.0))
            assert difference <= 1e-6, f"{key} on rank {rank}: {difference:.3g} from gloo"
    # The ranks hold one model (BatchNorm's running statistics are each rank's own
    # after the last forward pass, as under DDP: broadcast before a forward, not after).
    for key in (k for k in keys if "running_" not in k and "num_batches" not in k):
        np.testing.assert_array_equal(ours[1][key], ours[0][key], err_msg=key)


def test_a_script_with_sampler_metric_and_barrier_and_every_op_match_gloo(
    tmp_path: Path, coordinator_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """... and, with $GRADSYNC_TRACE set, every rank traces every op of its groups."""
    world = 3
    coordinator = coordinator_factory(world)
    gloo = run("gloo", "usage", world, tmp_path / "gloo", "unused:1")
    monkeypatch.setenv("GRADSYNC_TRACE", str(tmp_path / "trace" / "rank{rank}.json"))
    ours = run("gradsync", "usage", world, tmp_path / "ours", coordinator.address)
    coordinator_log = assert_job_ran(coordinator, world)
    check_traces(tmp_path / "trace", ours)
    for rank in range(world):
        # The script: DistributedSampler() split by the group, the summed metric, the model.
        np.testing.assert_array_equal(ours[rank]["indices"], gloo[rank]["indices"])
        np.testing.assert_array_equal(ours[rank]["samples_seen"], [24.0, 24.0])  # 22 padded
        np.testing.assert_allclose(ours[rank]["losses"], gloo[rank]["losses"], rtol=1e-6)
        for key in (k for k in gloo[rank] if k.startswith("model/")):
            np.testing.assert_allclose(ours[rank][key], gloo[rank][key], rtol=0, atol=1e-6)
        # Every op gloo has, bitwise (small integers in float32: every order sums exactly).
        ops = [
            k
            for k in gloo[rank]
            if k.startswith(("all_", "broadcast", "reduce", "gather", "scatter"))
        ]
        assert len(ops) == (16 if rank == 0 else 14), ops
        for key in ops:
            np.testing.assert_array_equal(ours[rank][key], gloo[rank][key], err_msg=key)
        sums = ours[rank]["all_reduce_sum"]
        np.testing.assert_allclose(ours[rank]["gradsync_avg"], sums / world, rtol=1e-6)
        np.testing.assert_allclose(ours[rank]["gradsync_premul_sum"], sums / 2, rtol=1e-6)
        np.testing.assert_array_equal(ours[rank]["gradsync_bf16"], [-3.0, 3.0, 9.0, 15.0])
        assert "BAND is not supported" in str(ours[rank]["gradsync_band_error"])
        assert "send is not supported" in str(ours[rank]["gradsync_send_error"])
        assert "point-to-point" in str(ours[rank]["gradsync_send_error"])
        # 17 ops both backends run, AVG, PREMUL_SUM and bf16, after the script's own
        # (DDP's start, 11 buckets, 2 metric sums, 2 barriers); BAND and send were
        # refused before queueing.
        assert int(ours[rank]["operations_completed"]) >= 20 + 4
        assert str(ours[rank]["job_id"]) == "default.pg-world"
        # Two new_groups of two ranks: each its own job, beside the default group's.
        groups = [k for k in gloo[rank] if k.startswith(("head_", "tail_", "world_after"))]
        assert len(groups) == (8 if rank == 1 else 5), groups
        for key in groups:
            np.testing.assert_array_equal(ours[rank][key], gloo[rank][key], err_msg=key)
    _, log = coordinator_log
    subgroup_jobs = set(re.findall(r"job '(default\.pg-[0-9a-f]{12})': rank \d joined", log))
    assert len(subgroup_jobs) == 2, log


#: An operation's phases in its trace span, in the order they happen.
PHASES = ("issued", "first_byte_sent", "last_byte_sent", "result_received", "completed")


def check_traces(folder: Path, ours: list[dict[str, Any]]) -> None:
    """Each rank's trace file (closed JSON) holds a span per operation of each of its
    groups, named, numbered 0, 1, ... per group, with its phases in order."""
    # The groups each rank is in: the default group, head (0, 1) and tail (1, 2).
    expected_groups = {0: 2, 1: 3, 2: 2}
    for rank, groups in expected_groups.items():
        events = json.loads((folder / f"rank{rank}.json").read_text())
        tracks = {
            e["tid"]: e["args"]["name"]
            for e in events
            if e["ph"] == "M" and e["name"] == "thread_name" and e["tid"] >= 2
        }
        ops_tracks = {tid: name for tid, name in tracks.items() if name.endswith(" ops")}
        assert len(ops_tracks) == groups, tracks
        world_ops = [
            e
            for e in events
            if e["ph"] == "X"
            and e["tid"] in ops_tracks
            and ops_tracks[e["tid"]] == "default.pg-world ops"
        ]
        # Every operation the group completed, in order (the worker saved its count
        # before the subgroups' part, which runs a few more on the default group).
        assert len(world_ops) >= int(ours[rank]["operations_completed"]), len(world_ops)
        assert [e["args"]["operation"] for e in world_ops] == list(range(len(world_ops)))
        names = {e["name"].split("(")[0] for e in world_ops}
        assert {"allreduce", "broadcast", "allgather", "barrier", "all_to_all_single"} <= names, (
            names
        )
        for event in (e for e in events if e["ph"] == "X" and e["tid"] in ops_tracks):
            args = event["args"]
            times = [args[phase] for phase in PHASES if args[phase] is not None]
            assert times == sorted(times), (rank, event)
            assert args["ok"] is True and args["issued"] == pytest.approx(event["ts"])
            assert args["completed"] == pytest.approx(event["ts"] + event["dur"])
            assert (args["first_byte_sent"] is None) == (args["last_byte_sent"] is None)
        # Every rank sends its own input for the flat ops; the float all-reduces go
        # through the host group, whose leader (rank 0) uploads the host's sum.
        for event in world_ops:
            sent = event["args"]["first_byte_sent"] is not None
            assert sent == (rank == 0 or "host group" not in event["name"]), (rank, event)
        assert any("host group" in event["name"] for event in world_ops)
        wire = [
            e for e in events if e["ph"] == "X" and tracks.get(e["tid"]) == "default.pg-world wire"
        ]
        assert sum(e["name"] == "result" for e in wire) == len(world_ops)
        assert sum(e["name"] == "send" for e in wire) == sum(
            e["args"]["first_byte_sent"] is not None for e in world_ops
        )


def test_the_gradsync_rendezvous_needs_no_listener_on_rank_0(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    """init_method="gradsync://host:port": the coordinator serves c10d's store too."""
    pytest.importorskip("gradsync.distributed.store", reason="needs the coordinator's store")
    world = 2
    coordinator = coordinator_factory(world)
    extra = ("--cases", "mlp", "--rendezvous", "gradsync")
    gloo = run("gloo", "ddp", world, tmp_path / "gloo", "unused:1", "--cases", "mlp")
    ours = run("gradsync", "ddp", world, tmp_path / "ours", coordinator.address, *extra)
    assert_job_ran(coordinator, world)
    for rank in range(world):
        for key in (k for k in gloo[rank] if k.startswith("mlp/")):
            np.testing.assert_array_equal(ours[rank][key], gloo[rank][key], err_msg=key)


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        ("abort", "rank 1 disconnected"),
        # Elastic: the coordinator goes on over rank 0 alone, but a c10d group's size is
        # fixed, so the backend fails the Work instead of returning a partial sum.
        ("elastic", "only 1 of the group's 2 ranks took part (the coordinator lost ranks [1]"),
    ],
)
def test_a_killed_rank_fails_the_pending_work_within_the_heartbeat_timeout(
    policy: str, says: str, tmp_path: Path, coordinator_factory: Any
) -> None:
    world = 2
    coordinator = coordinator_factory(
        world, "--heartbeat-timeout", "3", "--on-failure", policy, "--min-workers", "1"
    )
    ours = run(
        "gradsync", "kill", world, tmp_path / "ours", coordinator.address, expect_exit={1: -9}
    )
    assert_job_ran(coordinator, world)
    error = str(ours[0]["error"])
    assert str(ours[0]["error_type"]) == "DistBackendError", error
    assert "rank 0 of group '0'" in error and "allreduce" in error and says in error, error
    assert float(ours[0]["failed_after_s"]) < 3 + 2, error


def test_a_killed_rank_makes_stock_ddps_backward_raise_naming_it(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    world = 2
    coordinator = coordinator_factory(world, "--heartbeat-timeout", "3")
    ours = run(
        "gradsync", "ddp_kill", world, tmp_path / "ours", coordinator.address, expect_exit={1: -9}
    )
    assert_job_ran(coordinator, world)
    error = str(ours[0]["error"])
    # DDP's reducer reads the Work's future: the failure reaches backward() from C++.
    assert int(ours[0]["failed_at_step"]) == 2, error
    assert "DistBackendError" in error and "rank 0 of group '0'" in error, error
    assert "allreduce" in error and "rank 1 disconnected" in error, error
    assert float(ours[0]["failed_after_s"]) < 3 + 2, error


def scrape_metrics(port: int) -> dict[str, float]:
    """The coordinator's metrics page as {'name{label="value",...}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        text = page.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            rendered = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{rendered}}}"] = sample.value
    return values


def test_a_bfloat16_wire_rounds_as_one_process_and_mismatches_fail_every_rank_naming_both(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    """Stock DDP with $GRADSYNC_WIRE_DTYPE=bfloat16 equals, bitwise, the same training
    computed in one process with the wire's rounding (and differs from the exact one);
    the coordinator's metrics show 2 bytes an element each way. A shape mismatch, and
    ranks that ask for different wires, fail every rank naming both values."""
    world, metrics_port = 2, free_port()
    coordinator = coordinator_factory(world, "--metrics-port", str(metrics_port))
    extra = ("--wire-dtype", "bfloat16")
    ours = run("gradsync", "wire", world, tmp_path / "ours", coordinator.address, *extra)
    values = scrape_metrics(metrics_port)
    assert_job_ran(coordinator, world)
    keys = [k.removeprefix("ours/") for k in ours[0] if k.startswith("ours/")]
    assert len(keys) == 4, keys
    for rank in range(world):
        for key in keys:
            mine, rounded = ours[rank][f"ours/{key}"], ours[rank][f"rounded/{key}"]
            np.testing.assert_array_equal(mine, rounded, err_msg=f"rank {rank}: {key}")
        assert any(
            not np.array_equal(ours[rank][f"ours/{k}"], ours[rank][f"exact/{k}"]) for k in keys
        ), "the bfloat16 wire left every parameter as float32 would"
        error = str(ours[rank]["shape_error"])
        assert str(ours[rank]["shape_error_type"]) == "DistBackendError", error
        assert f"rank {rank} of group" in error and "allreduce" in error, error
        assert "8" in error and "12" in error, error  # 2 and 3 float32s, in bytes
        error = str(ours[rank]["wire_error"])
        assert str(ours[rank]["wire_error_type"]) == "DistBackendError", error
        assert "as bfloat16, but rank" in error or "as float16, but rank" in error, error
        assert "sent bfloat16" in error or "sent float16" in error, error
        wire = "float16" if rank == 1 else "bfloat16"
        assert f"allreduce(sum, [3] float32 on a {wire} wire)" in error, error
    # DDP's one bucket a step, in bfloat16: 2 bytes an element up from each rank, and
    # down (a 16-bit wire keeps every rank's input its own); then the float32 group's
    # all-reduce of 2 elements, 4 bytes each, summed on this host first: one input up,
    # one result down (the failed ones are not counted).
    total = world * 3 * int(ours[0]["elements"]) * 2 + 2 * 4
    assert values['gradsync_collectives_total{op="all_reduce_sum"}'] == 3 + 1
    for direction in ("received", "sent"):
        key = f'gradsync_collective_bytes_total{{direction="{direction}",op="all_reduce_sum"}}'
        assert values[key] == total, (key, values[key], total)
    # DDP's start broadcasts the parameters exactly: float32, 4 bytes an element.
    assert values['gradsync_collectives_total{op="broadcast"}'] >= 1
