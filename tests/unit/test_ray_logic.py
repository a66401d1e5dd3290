"""gradsync.ray's pure logic, without a Ray cluster (nothing here calls `ray.init`).

Resource options, torchrun's local ranks, addresses and actor names; how a training
function is called and what `report` does outside a run; the report sink as a plain
class; how a worker's environment is set; the options `start_coordinator` refuses before
it touches Ray; what the coordinator hands workers, and what never shows of a token; the
loop thread an actor runs its server on; the CLI's `--ray-address` without `--ray`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from gradsync.cli import main
from gradsync.config import ENV_COORDINATOR
from gradsync.ray import placement
from gradsync.ray.coordinator import Coordinator, LoopThread, start_coordinator
from gradsync.ray.train_backend import GradsyncBackend, GradsyncConfig
from gradsync.ray.workers import (
    ReportSink,
    apply_environment,
    call_train_fn,
    get_context,
    report,
)
from gradsync_proto import auth
from hypothesis import given, settings, strategies as st

pytestmark = pytest.mark.timeout(30)

TOKEN = "a-test-token-that-must-never-be-shown-0123456789"


# --- placement ---------------------------------------------------------------------------


def test_actor_options_maps_ray_train_s_resource_names() -> None:
    options = placement.actor_options({"CPU": 2, "GPU": 1, "memory": 2**30, "head": 0.01}, {})
    assert options == {
        "num_cpus": 2.0,
        "num_gpus": 1.0,
        "memory": float(2**30),
        "resources": {"head": 0.01},
    }


def test_actor_options_without_cpu_asks_for_no_core() -> None:
    assert placement.actor_options({"head": 1}, {"CPU": 4}) == {
        "num_cpus": 0.0,
        "resources": {"head": 1.0},
    }
    assert placement.actor_options({}, {"CPU": 4}) == {"num_cpus": 0.0}


def test_actor_options_take_the_default_only_when_none_is_given() -> None:
    assert placement.actor_options(None, placement.DEFAULT_WORKER_RESOURCES) == {"num_cpus": 1.0}
    assert placement.actor_options(None, placement.DEFAULT_COORDINATOR_RESOURCES) == {
        "num_cpus": 1.0
    }
    assert placement.actor_options(None, {"GPU": 1}) == {"num_cpus": 0.0, "num_gpus": 1.0}


def test_actor_options_leave_the_request_and_the_default_unchanged() -> None:
    request = {"CPU": 1.0, "GPU": 1.0}
    default = {"CPU": 3.0}
    placement.actor_options(request, default)
    placement.actor_options(None, default)
    assert request == {"CPU": 1.0, "GPU": 1.0}
    assert default == {"CPU": 3.0}


@pytest.mark.parametrize(("name", "amount"), [("CPU", -1), ("GPU", -0.5), ("head", -2)])
def test_a_negative_amount_is_refused_naming_the_resource_and_the_value(
    name: str, amount: float
) -> None:
    with pytest.raises(ValueError, match=rf"resource '{name}' must be >= 0, got {amount}"):
        placement.actor_options({"CPU": 1, name: amount}, {})


def test_local_ranks_follow_torchrun_for_interleaved_nodes() -> None:
    nodes = ["a", "b", "a", "a", "b"]
    assert placement.local_ranks(nodes) == [(0, 3), (0, 2), (1, 3), (2, 3), (1, 2)]
    assert placement.local_ranks([]) == []
    assert placement.local_ranks(["only"]) == [(0, 1)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from("abcd"), max_size=40))
def test_every_node_s_local_ranks_count_up_in_rank_order(nodes: list[str]) -> None:
    ranks = placement.local_ranks(nodes)
    assert len(ranks) == len(nodes)
    counts = Counter(nodes)
    by_node: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for node, local in zip(nodes, ranks, strict=True):
        by_node[node].append(local)
    for node, locals_ in by_node.items():
        assert [local_rank for local_rank, _ in locals_] == list(range(counts[node]))
        assert {size for _, size in locals_} == {counts[node]}


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("10.0.0.7", "10.0.0.7:29500"),
        ("node-3.cluster.local", "node-3.cluster.local:29500"),
        ("::1", "[::1]:29500"),
        ("fd00::17", "[fd00::17]:29500"),
        ("[fd00::17]", "[fd00::17]:29500"),
    ],
)
def test_host_port_brackets_ipv6_literals(host: str, expected: str) -> None:
    assert placement.host_port(host, 29500) == expected


def test_actor_names_are_distinct_per_coordinator_and_shard() -> None:
    assert placement.NAMESPACE == "gradsync"
    assert placement.leader_actor_name("demo") == "gradsync-coordinator:demo"
    assert placement.shard_actor_name("demo", 2) == "gradsync-shard:demo:2"
    names = {placement.leader_actor_name(n) for n in ("a", "b")} | {
        placement.shard_actor_name(n, i) for n in ("a", "b") for i in (1, 2)
    }
    assert len(names) == 6


# --- workers: calling the training function, reports, the environment -------------------


def test_a_train_fn_with_a_parameter_gets_a_copy_of_the_config() -> None:
    config = {"lr": 0.1}
    seen: list[dict[str, Any]] = []

    def train_fn(given_config: dict[str, Any]) -> str:
        seen.append(dict(given_config))
        given_config["lr"] = 99.0  # the caller's config must not change
        return "done"

    assert call_train_fn(train_fn, config) == "done"
    assert seen == [{"lr": 0.1}]
    assert config == {"lr": 0.1}
    assert call_train_fn(train_fn, None) == "done"
    assert seen[1] == {}, "no config: an empty dict, as Ray Train"


def test_a_train_fn_without_a_parameter_is_called_without_one() -> None:
    def train_fn() -> int:
        return 7

    assert call_train_fn(train_fn, None) == 7


def test_a_config_for_a_train_fn_that_takes_none_is_refused_naming_it() -> None:
    def my_train_loop() -> None:
        raise AssertionError("must not be called")

    with pytest.raises(TypeError, match=r"'my_train_loop' takes no argument"):
        call_train_fn(my_train_loop, {"lr": 0.1})


def test_report_outside_a_run_logs_at_info(caplog: pytest.LogCaptureFixture) -> None:
    assert get_context() is None
    with caplog.at_level(logging.INFO, logger="gradsync.ray"):
        report({"step": 3, "loss": 0.25})
    records = [r for r in caplog.records if r.name == "gradsync.ray"]
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.INFO, "report: {'step': 3, 'loss': 0.25}")
    ]
    assert get_context() is None


def test_report_sink_counts_starts_and_drains_each_report_once() -> None:
    sink = ReportSink()
    assert sink.drain() == ([], {})
    assert sink.started(0) == 1
    assert sink.started(1) == 1
    assert sink.started(1) == 2  # rank 1's actor was restarted
    sink.put(0, 1, 10.0, {"loss": 1.0})
    sink.put(1, 2, 11.0, {"loss": 0.5})
    assert sink.drain() == (
        [(0, 1, 10.0, {"loss": 1.0}), (1, 2, 11.0, {"loss": 0.5})],
        {0: 1, 1: 2},
    )
    assert sink.drain() == ([], {0: 1, 1: 2})
    sink.put(0, 1, 12.0, {"loss": 0.1})
    reports, starts = sink.drain()
    assert reports == [(0, 1, 12.0, {"loss": 0.1})]
    starts[0] = 100  # a copy: the sink's own count stays
    assert sink.drain() == ([], {0: 1, 1: 2})


def test_a_token_in_the_environment_replaces_the_node_s_token_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(auth.ENV_TOKEN_FILE, "/etc/gradsync/other-job-token")
    monkeypatch.delenv(auth.ENV_TOKEN, raising=False)
    monkeypatch.delenv(ENV_COORDINATOR, raising=False)
    # Removed again by monkeypatch at teardown, whatever apply_environment set.
    monkeypatch.setenv(auth.ENV_TOKEN, "placeholder")
    monkeypatch.setenv(ENV_COORDINATOR, "placeholder")
    apply_environment({ENV_COORDINATOR: "10.0.0.7:29500", auth.ENV_TOKEN: TOKEN})
    assert auth.ENV_TOKEN_FILE not in os.environ
    assert os.environ[auth.ENV_TOKEN] == TOKEN
    assert os.environ[ENV_COORDINATOR] == "10.0.0.7:29500"


def test_without_a_token_the_node_s_token_file_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.ENV_TOKEN_FILE, "/etc/gradsync/token")
    monkeypatch.setenv(ENV_COORDINATOR, "placeholder")
    apply_environment({ENV_COORDINATOR: "10.0.0.7:29500"})
    assert os.environ[auth.ENV_TOKEN_FILE] == "/etc/gradsync/token"
    assert os.environ[ENV_COORDINATOR] == "10.0.0.7:29500"


# --- coordinator: options refused before Ray, what workers get ---------------------------


@pytest.fixture
def no_ray() -> Iterator[None]:
    """The test runs without a Ray cluster, and must not start one."""
    assert not ray.is_initialized()
    yield
    assert not ray.is_initialized(), "the call started Ray before refusing its options"


@pytest.mark.usefixtures("no_ray")
def test_start_coordinator_refuses_zero_shards() -> None:
    with pytest.raises(ValueError, match=r"shards must be at least 1 \(the leader\), got 0"):
        start_coordinator(2, shards=0)


@pytest.mark.usefixtures("no_ray")
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"port": 29500}, "port"),
        ({"shard_count": 2}, "shard_count"),
        ({"local_shards": True}, "local_shards"),
        ({"shard_count": 2, "port": 1}, "port, shard_count"),
    ],
)
def test_start_coordinator_refuses_the_options_it_sets_itself(
    options: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{named} are set by start_coordinator"):
        start_coordinator(2, **options)


@pytest.mark.usefixtures("no_ray")
def test_world_size_is_the_argument_not_an_option() -> None:
    options: dict[str, Any] = {"world_size": 4}
    with pytest.raises(TypeError, match="multiple values for argument 'world_size'"):
        start_coordinator(2, **options)


@pytest.mark.usefixtures("no_ray")
def test_start_coordinator_refuses_an_unknown_server_option() -> None:
    with pytest.raises(TypeError, match="on_failur"):
        start_coordinator(2, on_failur="elastic")


@pytest.mark.usefixtures("no_ray")
@pytest.mark.parametrize(
    ("world_size", "options", "message"),
    [
        (
            2,
            {"on_failure": "sometimes"},
            "on failure must be 'abort' or 'elastic', got 'sometimes'",
        ),
        (0, {}, "world size must be at least 1, got 0"),
    ],
)
def test_start_coordinator_refuses_a_bad_value_with_server_config_s_message(
    world_size: int, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        start_coordinator(world_size, **options)


@pytest.mark.usefixtures("no_ray")
def test_start_coordinator_refuses_a_negative_resource_before_ray() -> None:
    with pytest.raises(ValueError, match="resource 'CPU' must be >= 0, got -1"):
        start_coordinator(2, resources={"CPU": -1})


def _coordinator(token: str | None) -> Coordinator:
    return Coordinator("demo", "10.0.0.7:29500", 4, token, leader=object())


def test_coordinator_environment_carries_the_address_and_the_token() -> None:
    assert _coordinator(TOKEN).environment() == {
        ENV_COORDINATOR: "10.0.0.7:29500",
        auth.ENV_TOKEN: TOKEN,
    }


def test_coordinator_environment_without_a_token_has_no_token_key() -> None:
    assert _coordinator(None).environment() == {ENV_COORDINATOR: "10.0.0.7:29500"}


def test_coordinator_repr_never_shows_the_token() -> None:
    coordinator = _coordinator(TOKEN)
    assert TOKEN not in repr(coordinator)
    assert TOKEN not in str(coordinator)
    assert "10.0.0.7:29500" in repr(coordinator)


# --- the Ray Train backend config --------------------------------------------------------


def test_gradsync_config_names_its_backend() -> None:
    assert GradsyncConfig().backend_cls is GradsyncBackend


def test_gradsync_config_never_shows_or_exports_a_token() -> None:
    config = GradsyncConfig(
        coordinator="10.0.0.7:29500",
        token=TOKEN,
        shards=2,
        serve_options={"token": TOKEN, "on_failure": "elastic"},
        env={auth.ENV_TOKEN: TOKEN, "GRADSYNC_HIERARCHICAL": "0"},
    )
    assert config.to_dict() == {"coordinator": "10.0.0.7:29500", "shards": 2}
    for shown in (repr(config), str(config), config._repr_html_()):
        assert TOKEN not in shown
    assert "on_failure" in repr(config)
    assert "GRADSYNC_HIERARCHICAL" in repr(config)


# --- the loop thread an actor serves on --------------------------------------------------


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread("test-loop")
    yield thread
    thread.close()


def test_call_returns_the_coroutine_s_result(loop_thread: LoopThread) -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert loop_thread.call(answer(), timeout_s=5.0) == 42


def test_call_raises_what_the_coroutine_raised(loop_thread: LoopThread) -> None:
    async def fail() -> None:
        raise KeyError("shard 3")

    with pytest.raises(KeyError, match="shard 3"):
        loop_thread.call(fail(), timeout_s=5.0)


def test_call_times_out_and_cancels_the_coroutine(loop_thread: LoopThread) -> None:
    cancelled = threading.Event()

    async def sleep_past_the_bound() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        loop_thread.call(sleep_past_the_bound(), timeout_s=0.05)
    assert cancelled.wait(5.0), "the timed-out coroutine is still running"


def test_close_cancels_pending_tasks_and_ends_the_thread() -> None:
    thread = LoopThread("test-loop")
    cancelled = threading.Event()

    async def pending() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def start_in_background() -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(pending())

    task = thread.call(start_in_background(), timeout_s=5.0)
    thread.close()
    assert cancelled.is_set()
    assert task.cancelled()
    assert not thread._thread.is_alive()
    assert thread.loop.is_closed()
    thread.close()  # twice: nothing left to do


def test_close_right_after_start_ends_the_thread() -> None:
    """The thread may not run its loop yet when close() comes; it must end all the same.

    (A race: when close() only checked `loop.is_running()`, a few in a thousand returned
    early here and left a loop running for good.)"""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: close() then often comes first
    threads: list[LoopThread] = []
    try:
        for _ in range(500):
            threads.append(LoopThread("test-loop"))
            threads[-1].close()
    finally:
        sys.setswitchinterval(interval)
    assert [t for t in threads if t._thread.is_alive() or not t.loop.is_closed()] == []


# --- the CLI -----------------------------------------------------------------------------


def test_demo_ray_address_without_ray_exits_2_naming_ray(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--ray-address", "10.0.0.7:6379"])
    assert exited.value.code == 2
    assert "--ray-address needs --ray" in capsys.readouterr().err
