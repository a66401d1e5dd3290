"""The deployment files: docker-compose.yml (and its sharded override), the Dockerfile, the
Prometheus configs and the Grafana dashboard agree with each other and with the code.

No container runs here; what can drift is checked statically against the real code: every
`gradsync` command is parsed by the real CLI parser, every metric the dashboard queries is one
the real metrics classes export, and where Prometheus is installed it checks the config file
(promtool) and the syntax of every dashboard query (a real server's query API).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from gradsync.cli import build_parser
from gradsync.healthcheck import build_parser as build_probe_parser
from gradsync.metrics import WorkerMetrics
from gradsync_server.arguments import frame_port_of
from gradsync_server.metrics import CoordinatorMetrics, ShardSample
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import compose
from support.components import NO_PROMETHEUS, PROMETHEUS, PROMTOOL
from support.promserver import PrometheusServer

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_PATH = compose.BASE
DOCKERFILE_PATH = ROOT / "Dockerfile"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD_PATH = ROOT / "deploy" / "grafana" / "dashboards" / "gradsync.json"
GRAFANA_PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
PROBE_MODULE = ["python", "-m", "gradsync.healthcheck"]


#: Tests marked with this run on docker-compose.yml alone and with the sharded override.
each_variant = pytest.mark.parametrize("variant", list(compose.VARIANTS))


def load_compose(variant: str = "base") -> dict[str, Any]:
    """The compose document `docker compose` sees for `variant` (see support.compose)."""
    return compose.load_compose(*compose.VARIANTS[variant])


def services(variant: str = "base") -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = load_compose(variant)["services"]
    return found


def runs_our_image(service: dict[str, Any]) -> bool:
    """Built from this repository's Dockerfile (entrypoint `gradsync`)."""
    build = service.get("build")
    if build is None:
        return False
    context = build if isinstance(build, str) else build.get("context", ".")
    return (ROOT / context).resolve() == ROOT


command_argv = compose.command_argv


def dependencies(service: dict[str, Any]) -> dict[str, str]:
    """depends_on in either form, as {service: condition}."""
    depends_on = service.get("depends_on", {})
    if isinstance(depends_on, list):
        return dict.fromkeys(depends_on, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in depends_on.items()}


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def frame_port(argv: list[str]) -> str | None:
    """The frame port a `serve` command line listens on (None: a shard, or off)."""
    if "serve" not in argv:
        return None
    raw, shards = flag(argv, "--frame-port"), flag(argv, "--shards")
    port = frame_port_of(
        None if raw is None else int(raw), int(flag(argv, "--port") or 0), int(shards or 1)
    )
    return str(port) if port else None


# --- Dockerfile ----------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE_PATH.read_text().splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, arguments = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


def dockerfile_json(keyword: str) -> list[str]:
    """The exec-form (JSON array) argument of the last `keyword` instruction."""
    values = [arguments for name, arguments in dockerfile_instructions() if name == keyword]
    assert values, f"Dockerfile has no {keyword}"
    parsed: list[str] = json.loads(values[-1])
    return parsed


def test_dockerfile_builds_a_slim_non_root_image_with_our_health_probe() -> None:
    instructions = dockerfile_instructions()
    stages = [arguments.split() for name, arguments in instructions if name == "FROM"]
    assert len(stages) >= 2, "multi-stage: a builder and a runtime stage"
    # Each stage's base, through the stages it is built on, is the slim Python image.
    bases = {words[2]: words[0] for words in stages if len(words) == 3 and words[1] == "AS"}
    for words in stages:
        base = words[0]
        while base in bases:
            base = bases[base]
        assert base == "python:3.11-slim", words
    runtime = instructions[
        len(instructions) - 1 - [n for n, _ in instructions[::-1]].index("FROM") :
    ]
    copied = [arguments for name, arguments in runtime if name == "COPY"]
    assert copied == ["--from=builder /dist /tmp/dist"], "the runtime takes only the wheel"
    users = [arguments for name, arguments in runtime if name == "USER"]
    assert users and users[-1] not in ("root", "0"), "runs as a non-root user"
    envs = " ".join(arguments for name, arguments in runtime if name == "ENV")
    assert "PYTHONUNBUFFERED=1" in envs
    builder = " ".join(arguments for name, arguments in instructions if name == "RUN")
    assert '--index-url "$TORCH_INDEX_URL" torch==2.13.0' in builder
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in [
        f"{name} {arguments}" for name, arguments in instructions
    ]
    exposed = {int(port) for name, args in runtime if name == "EXPOSE" for port in args.split()}
    assert exposed == {50051, 50052, 9100}
    healthcheck = [arguments for name, arguments in runtime if name == "HEALTHCHECK"]
    assert len(healthcheck) == 1
    probe = json.loads(healthcheck[0].split(" CMD ", 1)[1])
    assert probe[:3] == PROBE_MODULE
    build_probe_parser().parse_args(probe[3:])
    assert dockerfile_json("ENTRYPOINT") == ["gradsync"]
    command = dockerfile_json("CMD")
    # The probe, EXPOSE and the default command agree on the ports.
    assert probe[3] == f"127.0.0.1:{flag(command, '--port')}"
    listening = {flag(command, "--port"), flag(command, "--metrics-port"), frame_port(command)}
    assert {int(port or 0) for port in listening} == exposed


def test_dockerignore_keeps_what_the_build_copies() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copied = [
        source
        for name, arguments in dockerfile_instructions()
        if name == "COPY" and not arguments.startswith("--from=")
        for source in arguments.split()[:-1]
    ]
    assert copied, "the builder copies the source"
    for source in copied:
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
        assert source not in ignored, f"Dockerfile copies {source}, which .dockerignore drops"


# --- docker-compose.yml: structure ----------------------------------------------------------------


@each_variant
def test_compose_services_are_complete_and_consistent(variant: str) -> None:
    document = load_compose(variant)
    found = document["services"]
    assert {
        "coordinator",
        "worker-0",
        "worker-1",
        "worker-2",
        "redis",
        "prometheus",
        "grafana",
    } <= (set(found))
    declared_volumes = set(document.get("volumes") or {})
    host_ports: list[int] = []
    for name, service in found.items():
        assert "image" in service or "build" in service, f"{name}: neither image nor build"
        if "build" in service:
            build = service["build"]
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            dockerfile = (
                build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile"
            )
            assert (context / dockerfile).is_file(), f"{name}: no {dockerfile} in {context}"
        for target in dependencies(service):
            assert target in found, f"{name} depends on {target!r}, which is no service"
        for mapping in service.get("ports", []):
            published, _, container = str(mapping).rpartition(":")
            assert published and container, f"{name}: publish ports explicitly, got {mapping!r}"
            host_ports.append(int(published))
            if runs_our_image(service):
                argv = command_argv(service)
                listening = {flag(argv, "--port"), flag(argv, "--metrics-port"), frame_port(argv)}
                assert container in listening, (
                    f"{name} publishes {container}, listens on {listening}"
                )
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in declared_volumes, f"{name}: volume {source!r} is not declared"
    assert len(host_ports) == len(set(host_ports)), f"a host port is published twice: {host_ports}"


@each_variant
def test_service_healthy_dependencies_have_a_healthcheck(variant: str) -> None:
    found = services(variant)
    image_has_healthcheck = any(name == "HEALTHCHECK" for name, _ in dockerfile_instructions())
    waited_on = {
        target
        for service in found.values()
        for target, condition in dependencies(service).items()
        if condition == "service_healthy"
    }
    assert {"redis", "coordinator"} <= waited_on
    for target in waited_on:
        healthcheck = found[target].get("healthcheck")
        if healthcheck is None:
            assert runs_our_image(found[target]) and image_has_healthcheck, (
                f"{target} is waited on as service_healthy but has no healthcheck"
            )
        else:
            assert not healthcheck.get("disable"), f"{target} is waited on but disables its check"
            assert healthcheck.get("test"), f"{target}'s healthcheck has no test"


@each_variant
def test_only_the_coordinator_keeps_the_images_coordinator_probe(variant: str) -> None:
    # The image's HEALTHCHECK asks for a coordinator on 127.0.0.1:50051: a worker (or shard)
    # container would be marked unhealthy forever unless it turns the check off.
    for name, service in services(variant).items():
        if not runs_our_image(service):
            continue
        argv = command_argv(service)
        healthcheck = service.get("healthcheck", {})
        if argv[0] == "serve":
            test = healthcheck.get(
                "test", ["CMD", *PROBE_MODULE, f"127.0.0.1:{flag(argv, '--port')}"]
            )
            assert test[0] == "CMD" and test[1:4] == PROBE_MODULE, name
            probe = build_probe_parser().parse_args(test[4:])
            assert probe.address == f"127.0.0.1:{flag(argv, '--port')}", name
        else:
            assert healthcheck.get("disable") is True, f"{name} ({argv[0]}) must disable the probe"


@each_variant
def test_workers_form_one_job_against_the_coordinator(variant: str) -> None:
    found = services(variant)
    coordinator = command_argv(found["coordinator"])
    world_size = int(flag(coordinator, "--world-size") or 0)
    workers = {
        name: command_argv(service) for name, service in found.items() if name.startswith("worker-")
    }
    assert len(workers) == world_size
    assert sorted(int(flag(argv, "--rank") or -1) for argv in workers.values()) == list(
        range(world_size)
    )
    for name, argv in workers.items():
        assert flag(argv, "--coordinator") == f"coordinator:{flag(coordinator, '--port')}", name
        assert int(flag(argv, "--world-size") or 0) == world_size, name
        assert dependencies(found[name]).get("coordinator") == "service_healthy", name
    checkpoint_store = flag(coordinator, "--checkpoint-store") or ""
    assert checkpoint_store.startswith("redis://redis:"), "checkpoints go to the compose Redis"
    redis = found["redis"]
    assert dependencies(found["coordinator"]).get("redis") == "service_healthy"
    assert " ".join(command_argv(redis)).endswith("--appendonly yes --appendfsync always")
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


# --- Every gradsync command parses with the real CLI --------------------------------------------


def gradsync_commands() -> Iterator[Any]:
    yield pytest.param(dockerfile_json("CMD"), id="Dockerfile-CMD")
    seen: list[list[str]] = []
    for variant in compose.VARIANTS:
        for name, service in services(variant).items():
            argv = command_argv(service)
            if runs_our_image(service) and argv not in seen:
                seen.append(argv)
                yield pytest.param(argv, id=f"compose-{variant}-{name}")


@pytest.mark.parametrize("argv", list(gradsync_commands()))
def test_gradsync_command_parses_with_the_real_cli(argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"`gradsync {shlex.join(argv)}` is rejected by the CLI (exit {exc.code})")


# --- Prometheus and Grafana ----------------------------------------------------------------------


def prometheus_config(variant: str) -> Path:
    """The config file the variant's prometheus service mounts (host side)."""
    for volume in services(variant)["prometheus"]["volumes"]:
        host, container, *_ = str(volume).split(":")
        if container == "/etc/prometheus/prometheus.yml":
            return ROOT / host
    raise AssertionError(f"{variant}: prometheus mounts no /etc/prometheus/prometheus.yml")


def scrape_targets(config_path: Path = PROMETHEUS_CONFIG) -> list[str]:
    config = yaml.safe_load(config_path.read_text())
    return [
        target
        for job in config["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    ]


@each_variant
def test_prometheus_scrapes_every_gradsync_service_on_its_metrics_port(variant: str) -> None:
    found = services(variant)
    config_path = prometheus_config(variant)
    targets = scrape_targets(config_path)
    for target in targets:
        host, _, port = target.rpartition(":")
        assert host in found, f"scrape target {target}: no compose service {host!r}"
        assert flag(command_argv(found[host]), "--metrics-port") == port, target
    exporters = {
        name for name, service in found.items() if "--metrics-port" in command_argv(service)
    }
    assert {target.rpartition(":")[0] for target in targets} == exporters
    mounts = [str(volume).split(":") for volume in found["prometheus"]["volumes"]]
    host_path = "./" + str(config_path.relative_to(ROOT))
    assert [host_path, "/etc/prometheus/prometheus.yml", "ro"] in mounts
    assert variant != "base" or config_path == PROMETHEUS_CONFIG


@each_variant
def test_prometheus_config_passes_promtool(variant: str) -> None:
    if PROMTOOL is None:
        pytest.skip(NO_PROMETHEUS)
    result = subprocess.run(
        [PROMTOOL, "check", "config", str(prometheus_config(variant))],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_points_at_the_compose_prometheus_and_the_dashboard() -> None:
    found = services()
    grafana_mounts = dict(
        str(volume).split(":")[:2] for volume in found["grafana"]["volumes"]
    )  # host path -> container path
    by_container = {container: host for host, container in grafana_mounts.items()}
    assert by_container["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    datasources = yaml.safe_load(
        (GRAFANA_PROVISIONING / "datasources" / "prometheus.yml").read_text()
    )
    (datasource,) = datasources["datasources"]
    url = datasource["url"]
    host, _, port = url.removeprefix("http://").rpartition(":")
    assert host in found, f"datasource {url}: no compose service {host!r}"
    # 9090: the port the prom/prometheus image listens on.
    assert found[host]["image"].startswith("prom/prometheus") and port == "9090", url
    providers = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "gradsync.yml").read_text())
    (provider,) = providers["providers"]
    dashboards_host_dir = by_container[provider["options"]["path"]]
    assert (ROOT / dashboards_host_dir / DASHBOARD_PATH.name).is_file()
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    for panel in dashboard_panels(dashboard):
        if panel.get("type") != "row":
            assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]


def dashboard_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    return [
        target["expr"]
        for panel in dashboard_panels(dashboard)
        for target in panel.get("targets", [])
    ]


def exported_series_names() -> dict[str, str]:
    """Every sample name a real scrape of fresh metrics shows -> its family's type.

    Every labelled metric is touched once so that its series appear.
    """
    coordinator = CoordinatorMetrics()
    coordinator.observe_bucket_arrival(0, 0.0)
    coordinator.observe_rejection("INVALID_ARGUMENT")
    coordinator.observe_abort("ABORTED")
    coordinator.observe_error("RuntimeError")
    # The leader's view of its shards (index 0 is the leader itself), as a sharded leader
    # exports it.
    coordinator.watch_shards(
        lambda: [
            ShardSample(0, "", True, 1, 1, 0.0),
            ShardSample(1, "10.0.0.2:50051", True, 1, 1, 0.5),
        ]
    )
    worker = WorkerMetrics(rank=0)
    worker.observe_abort("ABORTED")
    names: dict[str, str] = {}
    for registry in (coordinator.registry, worker.registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                names[sample.name] = family.type
    return names


def test_dashboard_queries_only_metrics_we_export_and_covers_the_essentials() -> None:
    expressions = dashboard_expressions()
    assert expressions
    exported = exported_series_names()
    used = {name for expr in expressions for name in re.findall(r"\bgradsync_\w+", expr)}
    for name in used:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in exported, f"the dashboard queries {name}, which no metrics class exports"
        if base != name:
            assert exported[name] == "histogram", f"{name}: a suffix of a non-histogram"
    essentials = {
        "gradsync_received_bytes_total",  # throughput
        "gradsync_step_sync_seconds_bucket",  # step sync p50/p95
        "gradsync_rank_lag_seconds_sum",  # per-rank lag
        "gradsync_workers_alive",
        "gradsync_membership_epoch",
        "gradsync_current_step",
        "gradsync_worker_exposed_comm_seconds_bucket",
    }
    assert essentials <= used, f"the dashboard lost {essentials - used}"


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    if PROMETHEUS is None:
        pytest.skip(NO_PROMETHEUS)
    prometheus = PrometheusServer(tmp_path / "prometheus", targets=[])
    try:
        for expression in dashboard_expressions():
            # Grafana substitutes its interval variables before the query reaches Prometheus.
            query = expression.replace("$__rate_interval", "1m").replace("$__interval", "15s")
            answer = prometheus.query(query)
            assert answer["status"] == "success", f"{expression}: {answer.get('error')}"
    finally:
        prometheus.stop()


# --- The sharded variant ------------------------------------------------------------------------


def test_sharded_variant_adds_shards_that_register_with_the_leader() -> None:
    base, found = services("base"), services("sharded")
    leader = command_argv(found["coordinator"])
    port = flag(leader, "--port")
    shards = {
        name: command_argv(s) for name, s in found.items() if command_argv(s)[:1] == ["shard"]
    }
    assert shards and set(shards).isdisjoint(base), "the override adds the shard services"
    assert int(flag(leader, "--wait-for-shards") or 0) == len(shards)
    # Apart from the wait, the leader runs what the unsharded coordinator runs.
    unsharded = command_argv(base["coordinator"])
    assert [a for a in leader if a not in ("--wait-for-shards", str(len(shards)))] == unsharded
    for name, argv in shards.items():
        assert flag(argv, "--leader") == f"coordinator:{port}", name
        # Workers reach a shard at the address it advertises: its service name, its port.
        assert flag(argv, "--advertise") == f"{name}:{flag(argv, '--port')}", name
        assert flag(argv, "--host") == "0.0.0.0", f"{name} must listen beyond loopback"
        assert runs_our_image(found[name]), name
        assert "coordinator" in dependencies(found[name]), name
        assert found[name].get("restart") == "unless-stopped", f"{name}: restarted at its address"
    # The workers are unchanged: they know only the leader's address.
    for name, service in base.items():
        if name.startswith("worker-"):
            assert command_argv(found[name]) == command_argv(service), name


def row_panels(dashboard: dict[str, Any], title: str) -> list[dict[str, Any]]:
    """The panels under the row titled `title` (up to the next row)."""
    panels, inside = [], False
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            inside = panel["title"] == title
            panels += panel.get("panels", []) if inside else []
        elif inside:
            panels.append(panel)
    return panels


def test_dashboard_has_per_shard_panels_on_what_the_leader_exports() -> None:
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    panels = row_panels(dashboard, "Shards")
    assert panels, "the dashboard has no Shards row"
    expressions = [t["expr"] for panel in panels for t in panel.get("targets", [])]
    used = {name for expr in expressions for name in re.findall(r"\bgradsync_\w+", expr)}
    assert {
        "gradsync_shard_bytes_received_total",
        "gradsync_shard_bytes_sent_total",
        "gradsync_shard_up",
        "gradsync_shard_last_seen_seconds",
        "gradsync_shards_registered",
    } <= used
    exported = exported_series_names()
    assert used <= set(exported), f"not exported by the leader: {used - set(exported)}"
    # Throughput per shard: the byte counters as rates, one line per shard.
    throughput = [e for e in expressions if "bytes_" in e]
    assert throughput and all("rate(" in e and "by (shard)" in e for e in throughput)
