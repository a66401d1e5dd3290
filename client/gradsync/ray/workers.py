"""Workers on Ray: `run(train_fn, num_workers=N)` runs an unchanged torchrun script's function.

Each rank is one actor. Its environment is what torchrun would give it (`RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`) plus `GRADSYNC_COORDINATOR` and the
coordinator's token, so `gradsync.DistributedDataParallel(model)` needs no argument.

Restarts: with `max_restarts=K` each actor may be restarted by Ray K times and its
`train_fn` call is retried on the new process. The coordinator that `run` starts then
uses the elastic policy: the survivors go on without the lost rank, and the restarted
one rejoins with the live ranks' state (parameters, buffers, optimizer state, step), so a
loop written `while model.step < total_steps` finishes with every rank equal.

Reports: `gradsync.ray.report(metrics)` inside `train_fn` streams a dict back to the
driver while training runs (`on_report`, and `RunResult.reports`). Outside `run` (under
torchrun) it only logs, so the same function runs everywhere.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from gradsync_proto import auth

from gradsync.config import (
    ENV_COORDINATOR,
    ENV_JOB_ID,
    ENV_LOCAL_RANK,
    ENV_LOCAL_WORLD_SIZE,
    ENV_RANK,
    ENV_WORLD_SIZE,
)
from gradsync.ray.coordinator import Coordinator, cluster_resources, fetch, start_coordinator
from gradsync.ray.placement import DEFAULT_WORKER_RESOURCES, NAMESPACE, actor_options, local_ranks

log = logging.getLogger("gradsync.ray")

#: How often the driver collects reports while it waits for the ranks.
REPORT_POLL_S = 0.2
#: Default bound on placing and starting the worker actors: long enough for an
#: autoscaler to add nodes, short enough that a request no cluster can meet is named.
WORKER_START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Report:
    """One `gradsync.ray.report` call: who sent it, when, and what."""

    rank: int
    metrics: Mapping[str, Any]
    attempt: int
    time: float


@dataclass(frozen=True)
class RunResult:
    """What `run` returns.

    Attributes:
        results: `train_fn`'s return value of each rank, by rank.
        reports: every report, in the order the driver received them.
        restarts: how many times Ray restarted each rank's actor, by rank.
        coordinator: the address the ranks trained through.
    """

    results: list[Any]
    reports: list[Report]
    restarts: list[int]
    coordinator: str


class WorkerFailedError(RuntimeError):
    """A rank's `train_fn` raised (or its actor died beyond `max_restarts`); the run ended.

    Attributes:
        rank: the rank that failed first.
    """

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class WorkerContext:
    """Where this process is in a `run`: set in a worker actor, None elsewhere."""

    rank: int
    world_size: int
    attempt: int
    sink: Any = field(repr=False)


_context: WorkerContext | None = None


def get_context() -> WorkerContext | None:
    """This process's place in a `gradsync.ray.run`, or None outside one (torchrun)."""
    return _context


def report(metrics: Mapping[str, Any]) -> None:
    """Send `metrics` (a picklable dict) to the driver of this `gradsync.ray.run`.

    It does not wait for the driver. Outside a run (torchrun, a plain process) the
    metrics are logged at INFO instead, so a training function can call it anywhere.
    """
    context = _context
    if context is None:
        log.info("report: %s", dict(metrics))
        return
    context.sink.put.remote(context.rank, context.attempt, time.time(), dict(metrics))


class ReportSink:
    """Ray actor body: collects reports from every rank until the driver drains them."""

    def __init__(self) -> None:
        self._reports: list[tuple[int, int, float, dict[str, Any]]] = []
        self._starts: dict[int, int] = {}

    def started(self, rank: int) -> int:
        """Count a start of `rank`'s actor; return its attempt number (1 = first)."""
        self._starts[rank] = self._starts.get(rank, 0) + 1
        return self._starts[rank]

    def put(self, rank: int, attempt: int, at: float, metrics: dict[str, Any]) -> None:
        """Keep one report."""
        self._reports.append((rank, attempt, at, metrics))

    def drain(self) -> tuple[list[tuple[int, int, float, dict[str, Any]]], dict[int, int]]:
        """Reports since the last drain, and the starts of every rank so far."""
        reports, self._reports = self._reports, []
        return reports, dict(self._starts)


class Worker:
    """Ray actor body: one rank. Ray re-runs `__init__` when it restarts the actor."""

    def __init__(
        self, rank: int, world_size: int, environment: dict[str, str], sink_name: str
    ) -> None:
        global _context
        # The sink by name, not by handle: a handle is a constructor argument held in the
        # object store, which Ray warns may be gone when it restarts the actor.
        sink = ray.get_actor(sink_name, namespace=NAMESPACE)
        apply_environment(environment)
        os.environ[ENV_RANK] = str(rank)
        os.environ[ENV_WORLD_SIZE] = str(world_size)
        attempt = int(fetch(sink.started.remote(rank)))
        _context = WorkerContext(rank, world_size, attempt, sink)
        if attempt > 1:
            log.warning("rank %d: restarted (attempt %d), rejoining its job", rank, attempt)

    def node(self) -> str:
        """The id of the node this rank runs on."""
        return str(ray.get_runtime_context().get_node_id())

    def pid(self) -> int:
        """This rank's process id (tests kill it)."""
        return os.getpid()

    def train(
        self,
        train_fn: Callable[..., Any],
        config: Mapping[str, Any] | None,
        local_rank: int,
        local_world_size: int,
    ) -> Any:
        """Run `train_fn` with torchrun's local variables set; return its result."""
        os.environ[ENV_LOCAL_RANK] = str(local_rank)
        os.environ[ENV_LOCAL_WORLD_SIZE] = str(local_world_size)
        return call_train_fn(train_fn, config)


def apply_environment(environment: Mapping[str, str]) -> None:
    """Set `environment` in this process; a token given here replaces a token file.

    The node may carry $GRADSYNC_TOKEN_FILE for other jobs; a worker that had both would
    refuse to start (two tokens), and this run's coordinator wants the one given here.
    """
    if auth.ENV_TOKEN in environment:
        os.environ.pop(auth.ENV_TOKEN_FILE, None)
    os.environ.update(environment)


def call_train_fn(train_fn: Callable[..., Any], config: Mapping[str, Any] | None) -> Any:
    """`train_fn(config)`, or `train_fn()` for a function that takes no argument (as Ray Train).

    Raises:
        TypeError: `config` was given to a function that takes no argument.
    """
    if inspect.signature(train_fn).parameters:  # it takes the config
        return train_fn(dict(config or {}))
    if config is not None:
        raise TypeError(
            f"config was given but {getattr(train_fn, '__name__', train_fn)!r} takes no "
            "argument: define it as train_fn(config)"
        )
    return train_fn()


# Any: ray's typed handles do not see the methods of a class made remote this way.
_WorkerActor: Any = ray.remote(Worker)
_SinkActor: Any = ray.remote(ReportSink)


def run(
    train_fn: Callable[..., Any],
    *,
    num_workers: int,
    config: Mapping[str, Any] | None = None,
    resources_per_worker: Mapping[str, float] | None = None,
    max_restarts: int = 0,
    coordinator: Coordinator | str | None = None,
    env: Mapping[str, str] | None = None,
    on_report: Callable[[Report], None] | None = None,
    timeout_s: float | None = None,
    job_id: str | None = None,
    start_timeout_s: float = WORKER_START_TIMEOUT_S,
    scheduling_strategy: Any = None,
) -> RunResult:
    """Train `train_fn` on `num_workers` Ray actors through a gradsync coordinator.

    Args:
        train_fn: the per-rank training function, `train_fn(config)` or `train_fn()`;
            it reads its rank from the environment as under torchrun.
        num_workers: the world size.
        config: passed to `train_fn`.
        resources_per_worker: each rank's resources ({"CPU": 1} by default; {"GPU": 1}).
        max_restarts: how often Ray may restart each rank's actor. Above 0 the
            coordinator that `run` starts is elastic, so a restarted rank rejoins.
        coordinator: a running `Coordinator`, or the address of one (workers then need
            `GRADSYNC_TOKEN` in `env` if it asks for one); None starts one for this run
            (and stops it at the end).
        env: more environment variables for every rank.
        on_report: called in the driver for each `report` as it arrives (default: log it).
        timeout_s: bound on the whole run; None leaves it to gradsync's own timeouts
            (every wait of a rank is bounded, so a lost peer ends the run with an error).
        job_id: the gradsync job id (default: a fresh one per run).
        start_timeout_s: bound on placing and starting every worker actor.
        scheduling_strategy: Ray's placement of the worker actors: None (Ray's default),
            "SPREAD" (one node after another: a rank per host where there are enough),
            or a Ray strategy object (a placement group, a node affinity).

    Returns:
        A `RunResult` with every rank's return value, the reports and restart counts.

    Raises:
        WorkerFailedError: a rank's `train_fn` raised, or its actor died more than
            `max_restarts` times; the other ranks are stopped first.
        TimeoutError: `timeout_s` passed, or the workers were not all placed within
            `start_timeout_s` (the message names the request and the free resources).
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, got {num_workers}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    if not ray.is_initialized():
        ray.init()  # $RAY_ADDRESS, else a local cluster
    owned: Coordinator | None = None
    if coordinator is None:
        policy: dict[str, Any] = {"on_failure": "elastic"} if max_restarts else {}
        owned = coordinator = start_coordinator(
            num_workers, name=f"run-{uuid.uuid4().hex[:12]}", **policy
        )
    if isinstance(coordinator, Coordinator):
        if coordinator.world_size != num_workers:
            raise ValueError(
                f"num_workers {num_workers} differs from the coordinator's world size "
                f"{coordinator.world_size}"
            )
        environment = coordinator.environment()
    else:
        environment = {ENV_COORDINATOR: coordinator}
    environment.update(env or {})
    environment.setdefault(ENV_JOB_ID, job_id or f"ray-{uuid.uuid4().hex[:12]}")
    sink_name = f"gradsync-reports:{environment[ENV_JOB_ID]}:{uuid.uuid4().hex[:8]}"
    sink = _SinkActor.options(name=sink_name, namespace=NAMESPACE, num_cpus=0).remote()
    placement = actor_options(resources_per_worker, DEFAULT_WORKER_RESOURCES)
    # A retried task runs `train` again on the restarted actor: the rank rejoins.
    worker_options = dict(placement, max_restarts=max_restarts, max_task_retries=max_restarts)
    if scheduling_strategy is not None:
        worker_options["scheduling_strategy"] = scheduling_strategy
    actors = [
        _WorkerActor.options(**worker_options).remote(rank, num_workers, environment, sink_name)
        for rank in range(num_workers)
    ]
    try:
        nodes = _placed(actors, placement, start_timeout_s)
        calls = [
            actor.train.remote(train_fn, config, local_rank, local_size)
            for actor, (local_rank, local_size) in zip(actors, local_ranks(nodes), strict=True)
        ]
        return _collect(calls, sink, on_report or _log_report, timeout_s, environment)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        ray.kill(sink, no_restart=True)
        if owned is not None:
            owned.stop(grace_s=1.0)


def _placed(actors: list[Any], placement: Mapping[str, Any], timeout_s: float) -> list[str]:
    """The node of every worker actor, once all run; a clear error when some cannot be placed."""
    pending = {actor.node.remote(): rank for rank, actor in enumerate(actors)}
    _, waiting = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    if waiting:
        ranks = sorted(pending[ref] for ref in waiting)
        raise TimeoutError(
            f"ranks {ranks} of {len(actors)} did not start within {timeout_s:g} s: each asks "
            f"for {dict(placement)} and the cluster has {cluster_resources()} (give "
            "resources_per_worker= that fits, or add nodes)"
        )
    return [str(node) for node in fetch([actor.node.remote() for actor in actors])]


def _collect(
    calls: list[Any],
    sink: Any,
    on_report: Callable[[Report], None],
    timeout_s: float | None,
    environment: Mapping[str, str],
) -> RunResult:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    reports: list[Report] = []
    pending = list(calls)
    results: dict[int, Any] = {}
    while True:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=REPORT_POLL_S)
        starts = _drain(sink, reports, on_report)
        for rank, call in enumerate(calls):
            if rank in results or call in pending:
                continue
            try:
                results[rank] = fetch(call)
            except ray.exceptions.RayError as exc:
                _drain(sink, reports, on_report)  # what was sent before the failure
                raise WorkerFailedError(rank, f"rank {rank} failed: {exc}") from exc
        if not pending:
            break
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(
                f"the run did not finish within {timeout_s:g} s: ranks "
                f"{[calls.index(call) for call in pending]} still training"
            )
    return RunResult(
        [results[rank] for rank in range(len(calls))],
        reports,
        [max(0, starts.get(rank, 1) - 1) for rank in range(len(calls))],
        environment[ENV_COORDINATOR],
    )


def _drain(sink: Any, reports: list[Report], on_report: Callable[[Report], None]) -> dict[int, int]:
    """Hand the reports that arrived to `on_report` and keep them; return the starts by rank."""
    batch, starts = fetch(sink.drain.remote())
    for rank, attempt, at, metrics in batch:
        reports.append(Report(rank, metrics, attempt, at))
        on_report(reports[-1])
    return dict(starts)


def _log_report(report: Report) -> None:
    log.info("rank %d: %s", report.rank, dict(report.metrics))
