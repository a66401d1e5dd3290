"""Shared fixtures (real coordinator processes, real Redis servers) and the test tiers.

Tests live in one folder per tier, and each folder is also a marker, so a
tier runs alone with either `pytest tests/unit` or `pytest -m unit`:

- unit: pure logic, no sockets or processes.
- protocol: an in-process `grpc.aio` coordinator on a free port, real gRPC.
- multiprocess: real `gradsync serve` and worker processes, real signals.
- system: real Redis, Prometheus, network namespaces, the benchmarks.

Two guards run around every session: it fails if a test created or modified a
file in the repository (tests write under `tmp_path`), and its last words say how
many tests skipped because a real component (redis-server, Prometheus, iproute2)
is missing, with the command that installs them. Helpers live in tests/support.
"""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gradsync_server.store.high_water_file import ENV_STATE_DIR
from support import prefork, repoguard
from support.components import INSTALL_COMMAND, MISSING_COMPONENT, NO_REDIS_SERVER, REDIS_SERVER
from support.processes import CoordinatorProcess
from support.redisserver import RedisServer

#: The two layouts of ranks that share this host (`layout` fixture): "hierarchical" is
#: the default, hierarchical="auto" (every rank of one host joins its local group);
#: "flat" stands for one rank per host (GRADSYNC_HIERARCHICAL=0, hierarchical=False).
LAYOUTS = ("flat", "hierarchical")


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test once per layout; every rank process it starts inherits the choice.

    The suite runs the default (hierarchical="auto") everywhere else: a test that
    stands for one rank per host says so itself, with this fixture or its own
    GRADSYNC_HOST_ID / hierarchical=False.
    """
    if request.param == "flat":
        monkeypatch.setenv("GRADSYNC_HIERARCHICAL", "0")
    else:
        monkeypatch.delenv("GRADSYNC_HIERARCHICAL", raising=False)
    return str(request.param)


@pytest.fixture(autouse=True)
def _state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every `gradsync serve` a test starts keeps its high-water marks in a folder of its own.

    The default (~/.local/state/gradsync) would outlive the test and leak into the next:
    Redis test servers reuse ports, so a mark left by one test would name the same store
    URL as another test's fresh, empty Redis. Not under `tmp_path`, whose contents some
    tests list; the test's own folder comes from `tmp_path_factory` and is made lazily.
    """
    path = tmp_path_factory.getbasetemp() / f"state-{next(_STATE_DIRS)}"
    monkeypatch.setenv(ENV_STATE_DIR, str(path))
    return path


_STATE_DIRS = itertools.count()


@pytest.fixture
def coordinator_factory() -> Iterator[type[CoordinatorProcess]]:
    """Start coordinators on demand; every one is stopped after the test."""
    started: list[CoordinatorProcess] = []

    def start(world_size: int, *extra: str) -> CoordinatorProcess:
        coordinator = CoordinatorProcess(world_size, *extra)
        started.append(coordinator)
        return coordinator

    yield start  # type: ignore[misc]
    for coordinator in started:
        coordinator.stop()


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start real redis-servers on demand; every one is stopped after the test."""
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS_SERVER)
    pytest.importorskip("redis", reason="the redis package is not installed: gradsync[redis]")
    started: list[RedisServer] = []

    def start(name: str = "redis", *durability_args: str) -> RedisServer:
        server = RedisServer(tmp_path / name, *durability_args)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.process is not None and server.process.poll() is None:
            server.process.send_signal(signal.SIGCONT)  # in case a test left it stopped
        server.stop()


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A redis-server with the append-only file fsync'd on every write."""
    return redis_server_factory()


TIERS = ("unit", "protocol", "multiprocess", "system")


#: Modules whose tests take a minute or more each on two cores, in the order they start.
LONGEST_FIRST = (
    "test_containers.py",
    "test_bench.py",
    "test_wan_bench.py",
    "test_churn.py",
    "test_ray_integration.py",
    "test_ddp_parity.py",
    "test_diloco_restart.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its tier, taken from the folder it lives in, and order the run
    longest first: the modules above, then the tiers from system to unit. Parallel workers
    (pytest-xdist) take tests in this order, so the short unit tests fill the end of the run
    instead of one worker finishing a benchmark alone while the others idle."""
    for item in items:
        tier = item.path.parent.name
        if tier not in TIERS:
            raise pytest.UsageError(
                f"{item.nodeid}: tests belong in one of the tier folders {TIERS}"
            )
        item.add_marker(getattr(pytest.mark, tier))

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        first = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
        return first, -TIERS.index(item.path.parent.name)

    items.sort(key=rank)


def pytest_configure(config: pytest.Config) -> None:
    """Fork the suite's worker programs from a zygote that has imported torch (support/prefork.py:
    most of the suite's CPU was fresh interpreters importing torch)."""
    prefork.install()


_REPOSITORY = pytest.StashKey[tuple[Path, repoguard.Snapshot] | None]()
_WRITTEN = pytest.StashKey[list[str]]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Note what git sees as changed before any test runs (nothing outside a checkout)."""
    root = repoguard.repository_root(Path(__file__).parent)
    session.stash[_REPOSITORY] = None if root is None else (root, repoguard.snapshot(root))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the session if tests created or modified files in the repository."""
    repository = session.stash.get(_REPOSITORY, None)
    if repository is None:
        return
    root, before = repository
    written = repoguard.changes(before, repoguard.snapshot(root))
    if written:
        session.config.stash[_WRITTEN] = written
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say what each tier cost; name the files tests wrote into the repository, if any (the
    session has failed then)."""
    totals = _TIER_SECONDS
    if totals:
        terminalreporter.write_sep("-", "time per tier (setup + call + teardown)")
        terminalreporter.write_line(
            ", ".join(f"{tier} {totals[tier]:.0f} s" for tier in TIERS if tier in totals)
            + f"; {sum(totals.values()):.0f} s in all"
        )
    written = terminalreporter.config.stash.get(_WRITTEN, [])
    if written:
        terminalreporter.section("TESTS WROTE INTO THE REPOSITORY", sep="!", red=True, bold=True)
        terminalreporter.line(
            f"{len(written)} path(s) outside .gitignore were created or modified during this "
            "session (tests must write under tmp_path):",
            red=True,
        )
        for path in written:
            terminalreporter.line(f"  {path}", red=True)


#: Seconds per tier in this session (setup, call and teardown of its tests).
_TIER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each test's setup, call and teardown time to its tier's total (README's costs)."""
    path = report.nodeid.replace("\\", "/")
    tier = next((t for t in TIERS if path.startswith(f"tests/{t}/")), None)
    if tier is not None:
        _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the zygotes; then the run's last words: how many tests skipped for a missing real
    component, and the command that installs them (after pytest's own summary, so that nobody
    misses it)."""
    prefork.uninstall()
    terminalreporter = config.pluginmanager.get_plugin("terminalreporter")
    if terminalreporter is None:
        return
    missing = [
        report
        for report in terminalreporter.stats.get("skipped", [])
        if MISSING_COMPONENT in _skip_reason(report)
    ]
    if not missing:
        return
    reasons = sorted(
        {_skip_reason(report).split(f"{MISSING_COMPONENT}: ")[1] for report in missing}
    )
    terminalreporter.write_sep("!", "REAL COMPONENTS MISSING", yellow=True, bold=True)
    terminalreporter.write_line(
        f"{len(missing)} test(s) SKIPPED because a real component is missing: "
        + "; ".join(reasons),
        yellow=True,
        bold=True,
    )
    terminalreporter.write_line(
        f"Install them and run again:  {INSTALL_COMMAND}", yellow=True, bold=True
    )
    terminalreporter.write_sep("!", yellow=True, bold=True)


def _skip_reason(report: pytest.TestReport) -> str:
    """The reason of a skip report (pytest keeps it as (path, line, "Skipped: reason"))."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)
