"""deploy/k8s (Kubernetes) and deploy/ray (the Ray autoscaler) are valid and agree with the code.

No cluster runs here. Every Kubernetes object is checked against the OpenAPI schema of
`KUBERNETES_VERSION` by kubernetes-validate, strictly: an unknown field is an error, as under
`kubectl apply --validate=strict`. The Ray cluster config is checked against Ray's own
schema (ray/autoscaler/ray-schema.json) and by Ray's own config checks.

A schema cannot see what the manifests mean, so the rest is checked against the real code
and between the objects. Each workload's pods are simulated as Kubernetes would make them
(pod names, the completion-index annotation and the JOB_COMPLETION_INDEX variable of an
Indexed Job, downward-API and ConfigMap values, $(VAR) expansion in env values, command and
args); then every `gradsync` command line must parse with gradsync's own parser, each worker
pod must get the rank of its completion index, the probes must parse with the probe's parser
and ask for the service the process registers, the counts (world size, shards) must agree
across objects, every selector must select pods that exist, the network policies must admit
exactly the intended peers, and every gradsync container must read the token from the
mounted Secret. Each check has a twin that breaks a loaded manifest in memory and expects
the check to fail.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import posixpath
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from gradsync.arguments import build_parser
from gradsync.healthcheck import build_parser as build_probe_parser
from gradsync.protocol import auth
from gradsync.server.servicer import SERVICE_NAME as COORDINATOR_SERVICE
from gradsync.server.shard_servicer import SERVICE_NAME as SHARD_SERVICE

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "k8s"
KUSTOMIZATION = K8S_DIR / "kustomization.yaml"
RAY_CLUSTER = ROOT / "deploy" / "ray" / "cluster.yaml"
DOCKERFILE = ROOT / "Dockerfile"

#: The Kubernetes release whose API the manifests are validated against (the newest that
#: kubernetes-validate bundles; older clusters may lack fields such as podReplacementPolicy).
KUBERNETES_VERSION = "1.37.0"
NAMESPACE = "gradsync"
IMAGE = "gradsync:local"
TOKEN_SECRET = "gradsync-token"
TOKEN_KEY = "token"
#: Files shown for their shape only (the token Secret): validated, never applied.
TEMPLATE_SUFFIX = ".example.yaml"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
PROBE_MODULE = ["python", "-m", "gradsync.healthcheck"]
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
#: Environment variables gradsync's parser reads, cleared before each simulated pod's own.
PARSER_ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
#: The memory of a coordinator or shard beyond its two buffer pools (--max-buffered-mb each).
PROCESS_MEMORY_MIB = 512

Object = dict[str, Any]


# --- loading -------------------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    """Every Kubernetes manifest in deploy/k8s (the kustomization is not a Kubernetes object)."""
    return sorted(path for path in K8S_DIR.glob("*.yaml") if path != KUSTOMIZATION)


def load_documents(path: Path) -> list[Object]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def applied_objects() -> list[Object]:
    """The objects `kubectl apply -k deploy/k8s` creates (templates left out)."""
    return [
        document
        for path in manifest_files()
        if not path.name.endswith(TEMPLATE_SUFFIX)
        for document in load_documents(path)
    ]


def label(document: Object) -> str:
    return f"{document['kind']}/{document['metadata']['name']}"


def every_document() -> list[tuple[str, Object]]:
    return [
        (f"{path.name}:{label(document)}", document)
        for path in manifest_files()
        for document in load_documents(path)
    ]


def named(objects: list[Object], kind: str, name: str) -> Object:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(objects: list[Object]) -> list[Object]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def pod_template(workload: Object) -> Object:
    template: Object = workload["spec"]["template"]
    return template


def pod_labels(workload: Object) -> dict[str, str]:
    labels: dict[str, str] = pod_template(workload)["metadata"].get("labels", {})
    return labels


def runs_gradsync(container: Object) -> bool:
    return bool(container.get("command", [None])[0] == "gradsync")


def gradsync_containers(workload: Object) -> list[Object]:
    return [c for c in pod_template(workload)["spec"]["containers"] if runs_gradsync(c)]


def the_workload(objects: list[Object], subcommand: str) -> Object:
    """The one workload whose container runs `gradsync SUBCOMMAND`."""
    found = [
        w
        for w in workloads(objects)
        for c in gradsync_containers(w)
        if c.get("args", [None])[0] == subcommand
    ]
    assert len(found) == 1, f"expected one workload running `gradsync {subcommand}`"
    return found[0]


# --- pods as Kubernetes makes them ----------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    """What Kubernetes gives one pod of a workload: its name, namespace and annotations."""

    name: str
    namespace: str
    annotations: dict[str, str]


def is_indexed_job(workload: Object) -> bool:
    return bool(workload["kind"] == "Job" and workload["spec"].get("completionMode") == "Indexed")


def pods_of(workload: Object) -> list[Pod]:
    """A `Pod` per pod the workload runs: per index of an Indexed Job, per StatefulSet ordinal."""
    name, namespace = workload["metadata"]["name"], workload["metadata"]["namespace"]
    annotations = dict(pod_template(workload)["metadata"].get("annotations", {}))
    spec = workload["spec"]
    if is_indexed_job(workload):
        return [
            Pod(f"{name}-{index}-x7k2p", namespace, {**annotations, INDEX_ANNOTATION: str(index)})
            for index in range(spec["completions"])
        ]
    if workload["kind"] == "StatefulSet":
        return [
            Pod(f"{name}-{ordinal}", namespace, annotations) for ordinal in range(spec["replicas"])
        ]
    return [Pod(f"{name}-5d9c7b4f6-x7k2p", namespace, annotations)]


VARIABLE_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, variables: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined variable is replaced, an undefined reference
    stays as it is, and `$$` is a literal `$`."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return variables.get(match.group(1), match.group(0))

    return VARIABLE_REFERENCE.sub(replace, text)


def field_value(field_path: str, pod: Pod) -> str:
    if field_path == "metadata.name":
        return pod.name
    if field_path == "metadata.namespace":
        return pod.namespace
    if field_path == "status.podIP":
        return "10.244.1.7"
    match = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", field_path)
    if match:
        assert match.group(1) in pod.annotations, f"{pod.name} has no annotation {match.group(1)}"
        return pod.annotations[match.group(1)]
    raise AssertionError(f"fieldRef {field_path!r} is not simulated here")


def config_map_value(objects: list[Object], reference: Object) -> str:
    config_map = named(objects, "ConfigMap", reference["name"])
    data: dict[str, str] = config_map.get("data", {})
    assert reference["key"] in data, f"ConfigMap {reference['name']} has no key {reference['key']}"
    return data[reference["key"]]


def container_environment(
    objects: list[Object], workload: Object, container: Object, pod: Pod
) -> dict[str, str]:
    """The container's environment in `pod`: its env list in order, each value expanded with
    the variables defined before it, then what the Job controller appends."""
    assert "envFrom" not in container, "envFrom is not simulated: list variables in env"
    entries = list(container.get("env", []))
    if is_indexed_job(workload) and all(e["name"] != "JOB_COMPLETION_INDEX" for e in entries):
        # The Job controller appends it after the container's own variables.
        reference = f"metadata.annotations['{INDEX_ANNOTATION}']"
        entries.append(
            {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"fieldPath": reference}}}
        )
    environment: dict[str, str] = {}
    for entry in entries:
        if "value" in entry:
            environment[entry["name"]] = expand(entry["value"], environment)
            continue
        source = entry["valueFrom"]
        if "fieldRef" in source:
            environment[entry["name"]] = field_value(source["fieldRef"]["fieldPath"], pod)
        elif "configMapKeyRef" in source:
            environment[entry["name"]] = config_map_value(objects, source["configMapKeyRef"])
        else:
            raise AssertionError(
                f"{entry['name']}: only fieldRef and configMapKeyRef are simulated"
            )
    return environment


def container_argv(container: Object, environment: dict[str, str]) -> list[str]:
    argv = [expand(part, environment) for part in container["command"] + container.get("args", [])]
    unresolved = [part for part in argv if VARIABLE_REFERENCE.search(part)]
    assert not unresolved, f"references Kubernetes leaves unexpanded: {unresolved}"
    return argv


@pytest.fixture
def parse_gradsync(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[str], dict[str, str]], Any]:
    """Parse a gradsync command line with gradsync's own parser, in the container's environment
    (the parser takes RANK, WORLD_SIZE and GRADSYNC_* defaults from it when it is built)."""

    def parse(argv: list[str], environment: dict[str, str]) -> argparse.Namespace:
        with monkeypatch.context() as patch:
            for name in PARSER_ENVIRONMENT:
                patch.delenv(name, raising=False)
            for name in [n for n in os.environ if n.startswith("GRADSYNC_")]:
                patch.delenv(name)
            for name, value in environment.items():
                patch.setenv(name, value)
            assert argv[0] == "gradsync", f"not a gradsync command: {argv}"
            try:
                return build_parser().parse_args(argv[1:])
            except SystemExit as exc:
                raise AssertionError(f"gradsync refuses `{shlex.join(argv)}`") from exc

    return parse


def parsed_commands(
    objects: list[Object], workload: Object, parse: Callable[..., argparse.Namespace]
) -> Iterator[tuple[Pod, Object, dict[str, str], argparse.Namespace]]:
    """(pod, container, environment, parsed args) of every gradsync container of every pod."""
    for pod in pods_of(workload):
        for container in gradsync_containers(workload):
            environment = container_environment(objects, workload, container, pod)
            args = parse(container_argv(container, environment), environment)
            yield pod, container, environment, args


def one_parsed(
    objects: list[Object], subcommand: str, parse: Callable[..., argparse.Namespace]
) -> argparse.Namespace:
    """The parsed command line of the first pod of the workload running `subcommand`."""
    return next(parsed_commands(objects, the_workload(objects, subcommand), parse))[3]


# --- selectors ----------------------------------------------------------------------------------


def selects(selector: Object, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels and matchExpressions) selects `labels`."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def service_selector(service: Object) -> Object:
    """A Service's selector (a plain map) as a label selector."""
    return {"matchLabels": service["spec"]["selector"]}


def selected_workloads(objects: list[Object], selector: Object) -> list[str]:
    return [w["metadata"]["name"] for w in workloads(objects) if selects(selector, pod_labels(w))]


ANY_POD = "<any pod>"


def admitted(objects: list[Object], component: str, port: int) -> set[str]:
    """The workloads (or ANY_POD) whose pods the network policies let reach `port` of the pods
    of the workload named `component`; every pod when no policy selects them."""
    target = pod_labels(named_workload(objects, component))
    policies = [
        p
        for p in objects
        if p["kind"] == "NetworkPolicy" and selects(p["spec"]["podSelector"], target)
    ]
    if not policies:
        return {ANY_POD}
    allowed: set[str] = set()
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = [entry["port"] for entry in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            for peer in rule.get("from", [{}]):
                if "namespaceSelector" in peer or not peer:
                    allowed.add(ANY_POD)
                else:
                    allowed.update(selected_workloads(objects, peer["podSelector"]))
    return allowed


def named_workload(objects: list[Object], name: str) -> Object:
    found = [w for w in workloads(objects) if w["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one workload {name}"
    return found[0]


# --- Kubernetes: the schema ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "document", [document for _, document in every_document()], ids=[i for i, _ in every_document()]
)
def test_every_kubernetes_object_is_valid_for_its_api_strictly(document: Object) -> None:
    validated = kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    assert validated == ".".join(KUBERNETES_VERSION.split(".")[:2])
    if document["kind"] != "Namespace":
        assert document["metadata"]["namespace"] == NAMESPACE


def _unknown_container_field(job: Object) -> None:
    pod_template(job)["spec"]["containers"][0]["imagePulPolicy"] = "Always"


def _counts_as_strings(job: Object) -> None:
    job["spec"]["completions"] = "3"


def _misspelt_job_field(job: Object) -> None:
    job["spec"]["backofLimitPerIndex"] = 3


def _command_as_a_string(job: Object) -> None:
    pod_template(job)["spec"]["containers"][0]["command"] = "gradsync"


@pytest.mark.parametrize(
    "breaks",
    [_unknown_container_field, _counts_as_strings, _misspelt_job_field, _command_as_a_string],
)
def test_schema_validation_rejects_a_broken_manifest(breaks: Callable[[Object], None]) -> None:
    job = named(applied_objects(), "Job", "gradsync-workers")
    kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)
    breaks(job)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)


def test_kustomization_applies_every_manifest_but_the_templates() -> None:
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    assert kustomization["kind"] == "Kustomization"
    assert kustomization["namespace"] == NAMESPACE
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources)), "a resource listed twice"
    expected = {p.name for p in manifest_files() if not p.name.endswith(TEMPLATE_SUFFIX)}
    assert set(resources) == expected
    namespaces = [o for o in applied_objects() if o["kind"] == "Namespace"]
    assert [n["metadata"]["name"] for n in namespaces] == [NAMESPACE]


def test_the_token_template_holds_no_usable_token() -> None:
    templates = [p for p in manifest_files() if p.name.endswith(TEMPLATE_SUFFIX)]
    secrets = [d for p in templates for d in load_documents(p) if d["kind"] == "Secret"]
    assert [s["metadata"]["name"] for s in secrets] == [TOKEN_SECRET]
    secret = secrets[0]
    assert "data" not in secret, "a template must not carry a token"
    assert set(secret["stringData"]) == {TOKEN_KEY}
    # Applied by mistake, it makes every gradsync process refuse to start.
    with pytest.raises(auth.TokenError):
        auth.check_token(secret["stringData"][TOKEN_KEY], "the template")
    text = "\n".join(p.read_text() for p in templates)
    assert "kubectl" in text and "create secret generic" in text, "say how to make the real one"


# --- Kubernetes: the command lines ----------------------------------------------------------------


def test_every_gradsync_command_parses_with_gradsync_s_own_parser(
    parse_gradsync: Callable[..., argparse.Namespace],
) -> None:
    objects = applied_objects()
    commands = set()
    for workload in workloads(objects):
        for _, container, _, args in parsed_commands(objects, workload, parse_gradsync):
            assert container["image"] == IMAGE
            commands.add(args.command)
    assert commands == {"serve", "shard", "worker"}


def test_a_misspelt_flag_or_an_unknown_variable_is_caught(
    parse_gradsync: Callable[..., argparse.Namespace],
) -> None:
    objects = applied_objects()
    coordinator = the_workload(objects, "serve")
    container = gradsync_containers(coordinator)[0]
    misspelt = copy.deepcopy(container)
    misspelt["args"][misspelt["args"].index("--min-workers")] = "--min-worker-count"
    pod = pods_of(coordinator)[0]
    environment = container_environment(objects, coordinator, misspelt, pod)
    with pytest.raises(AssertionError, match="gradsync refuses"):
        parse_gradsync(container_argv(misspelt, environment), environment)
    unknown = copy.deepcopy(container)
    unknown["args"][unknown["args"].index("$(WORLD_SIZE)")] = "$(WORLDSIZE)"
    with pytest.raises(AssertionError, match="unexpanded"):
        container_argv(unknown, container_environment(objects, coordinator, unknown, pod))


def test_sizes_agree_across_the_objects(parse_gradsync: Callable[..., argparse.Namespace]) -> None:
    objects = applied_objects()
    serve = one_parsed(objects, "serve", parse_gradsync)
    job = the_workload(objects, "worker")
    shards = the_workload(objects, "shard")
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == serve.world_size
    assert shards["spec"]["replicas"] == serve.wait_for_shards
    assert serve.on_failure == "elastic", "a replaced rank rejoins only an elastic job"
    assert 1 <= serve.min_workers <= serve.world_size
    for _, _, _, worker in parsed_commands(objects, job, parse_gradsync):
        assert worker.world_size == serve.world_size


def test_each_worker_pod_gets_the_rank_of_its_completion_index(
    parse_gradsync: Callable[..., argparse.Namespace],
) -> None:
    objects = applied_objects()
    job = the_workload(objects, "worker")
    assert is_indexed_job(job)
    ranks = [
        (int(pod.annotations[INDEX_ANNOTATION]), args.rank)
        for pod, _, _, args in parsed_commands(objects, job, parse_gradsync)
    ]
    assert ranks == [(index, index) for index in range(job["spec"]["completions"])]


def test_rank_from_job_completion_index_in_an_env_value_stays_unexpanded(
    parse_gradsync: Callable[..., argparse.Namespace],
) -> None:
    """Why workers.yaml reads the annotation: the variable the Job controller adds comes after
    the container's own, so an env value cannot refer to it (args can)."""
    objects = applied_objects()
    job = the_workload(objects, "worker")
    container = copy.deepcopy(gradsync_containers(job)[0])
    rank = next(e for e in container["env"] if e["name"] == "RANK")
    rank.pop("valueFrom")
    rank["value"] = "$(JOB_COMPLETION_INDEX)"
    pod = pods_of(job)[1]
    environment = container_environment(objects, job, container, pod)
    assert environment["RANK"] == "$(JOB_COMPLETION_INDEX)"
    with pytest.raises(AssertionError, match="gradsync refuses"):
        parse_gradsync(container_argv(container, environment), environment)
    # In args the variable is known: --rank $(JOB_COMPLETION_INDEX) would work.
    container["args"] += ["--rank", "$(JOB_COMPLETION_INDEX)"]
    assert parse_gradsync(container_argv(container, environment), environment).rank == 1


def test_a_failed_rank_is_replaced_never_doubled(
    parse_gradsync: Callable[..., argparse.Namespace],
) -> None:
    objects = applied_objects()
    job = the_workload(objects, "worker")
    spec = job["spec"]
    pod_spec = pod_template(job)["spec"]
    # The API's own rules: backoffLimitPerIndex needs Indexed, podFailurePolicy needs Never.
    assert spec["completionMode"] == "Indexed"
    assert spec["backoffLimitPerIndex"] >= 1, "a failed rank must be retried"
    assert pod_spec["restartPolicy"] == "Never"
    # A second live process of one rank is refused (ALREADY_EXISTS): no overlap.
    assert spec["podReplacementPolicy"] == "Failed"
    containers = {c["name"] for c in pod_spec["containers"]}
    fail_job = [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert [r["onExitCodes"]["values"] for r in fail_job] == [[2]], "bad flags exit 2"
    assert all(r["onExitCodes"]["containerName"] in containers for r in fail_job)


def test_the_coordinator_runs_alone_and_drains_within_its_grace_period(
    parse_gradsync: Callable[..., argparse.Namespace],
) -> None:
    objects = applied_objects()
    coordinator = the_workload(objects, "serve")
    assert coordinator["kind"] == "Deployment"
    assert coordinator["spec"]["replicas"] == 1
    assert coordinator["spec"]["strategy"] == {"type": "Recreate"}
    serve = one_parsed(objects, "serve", parse_gradsync)
    grace = pod_template(coordinator)["spec"]["terminationGracePeriodSeconds"]
    assert grace > serve.shutdown_grace_s, "SIGKILL would cut the drain short"


def service_for(objects: list[Object], address: str) -> tuple[Object, Object]:
    """The Service a same-namespace `name:port` address reaches, and its port entry."""
    host, _, port = address.rpartition(":")
    service = named(objects, "Service", host)
    ports = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    assert ports, f"Service {host} has no port {port}"
    return service, ports[0]


def target_port(workload: Object, port: Object) -> int:
    """The container port a Service port entry forwards to in `workload`'s pods."""
    target = port.get("targetPort", port["port"])
    if isinstance(target, int):
        return target
    numbers: list[int] = [
        p["containerPort"]
        for c in pod_template(workload)["spec"]["containers"]
        for p in c.get("ports", [])
        if p.get("name") == target
    ]
    assert len(numbers) == 1, f"no container port named {target} in {label(workload)}"
    return numbers[0]


def test_workers_and_shards_reach_the_coordinator_through_its_service(
    parse_gradsync: Callable[..., argparse.Namespace],
) -> None:
    objects = applied_objects()
    coordinator = the_workload(objects, "serve")
    serve = one_parsed(objects, "serve", parse_gradsync)
    addresses = [one_parsed(objects, "worker", parse_gradsync).coordinator]
    addresses.append(one_parsed(objects, "shard", parse_gradsync).leader)
    for address in addresses:
        service, port = service_for(objects, address)
        assert selected_workloads(objects, service_selector(service)) == [
            coordinator["metadata"]["name"]
        ]
        assert target_port(coordinator, port) == serve.port


def test_shards_advertise_their_stable_dns_name(
    parse_gradsync: Callable[..., argparse.Namespace],
) -> None:
    objects = applied_objects()
    shards = the_workload(objects, "shard")
    assert shards["kind"] == "StatefulSet"
    governing = named(objects, "Service", shards["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None", "pod DNS names need a headless Service"
    assert selected_workloads(objects, service_selector(governing)) == [shards["metadata"]["name"]]
    advertised = []
    for pod, _, _, args in parsed_commands(objects, shards, parse_gradsync):
        domain = f"{governing['metadata']['name']}.{pod.namespace}.svc.cluster.local"
        assert args.advertise == f"{pod.name}.{domain}:{args.port}"
        advertised.append(args.advertise)
    assert len(set(advertised)) == shards["spec"]["replicas"]


def test_every_selector_selects_pods_that_exist() -> None:
    objects = applied_objects()
    for workload in workloads(objects):
        selector = workload["spec"].get("selector")
        if selector is not None:  # a Job's is generated
            assert selects(selector, pod_labels(workload)), f"{label(workload)} selects no pod"
    for service in [o for o in objects if o["kind"] == "Service"]:
        selected = selected_workloads(objects, service_selector(service))
        assert len(selected) == 1, f"{label(service)} selects {selected}"
        for port in service["spec"]["ports"]:
            target_port(named_workload(objects, selected[0]), port)
    for policy in [o for o in objects if o["kind"] == "NetworkPolicy"]:
        assert selected_workloads(objects, policy["spec"]["podSelector"]), label(policy)
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" in peer:
                    assert selected_workloads(objects, peer["podSelector"]), label(policy)


def test_a_service_with_a_misspelt_selector_is_caught() -> None:
    objects = applied_objects()
    service = named(objects, "Service", "gradsync-coordinator")
    service["spec"]["selector"]["app.kubernetes.io/component"] = "coordinater"
    assert selected_workloads(objects, service_selector(service)) == []


def test_network_policies_admit_only_the_intended_peers(
    parse_gradsync: Callable[..., argparse.Namespace],
) -> None:
    objects = applied_objects()
    coordinator = the_workload(objects, "serve")["metadata"]["name"]
    shards = the_workload(objects, "shard")["metadata"]["name"]
    workers = the_workload(objects, "worker")["metadata"]["name"]
    serve = one_parsed(objects, "serve", parse_gradsync)
    shard = one_parsed(objects, "shard", parse_gradsync)
    redis_service, redis_port = service_for(objects, serve.checkpoint_store.split("/")[2])
    (redis,) = selected_workloads(objects, service_selector(redis_service))
    assert admitted(objects, coordinator, serve.port) == {workers, shards}
    assert admitted(objects, shards, shard.port) == {workers}
    assert admitted(objects, redis, redis_port["port"]) == {coordinator}
    # Metrics are open to a scraper; nothing else of a worker listens.
    for name, port in [(coordinator, serve.metrics_port), (shards, shard.metrics_port)]:
        assert admitted(objects, name, port) == {ANY_POD}
    assert admitted(objects, workers, serve.port) == set()


def test_a_policy_that_lets_everyone_reach_redis_is_caught() -> None:
    objects = applied_objects()
    policy = named(objects, "NetworkPolicy", "redis")
    policy["spec"]["ingress"][0]["from"] = [{"namespaceSelector": {}}]
    assert admitted(objects, "redis", 6379) == {ANY_POD}


# --- Kubernetes: security, probes, resources ------------------------------------------------------


def token_paths(workload: Object) -> set[str]:
    """Paths inside the pod where the token Secret's `token` key appears as a file."""
    spec = pod_template(workload)["spec"]
    paths: set[str] = set()
    for volume in spec.get("volumes", []):
        secret = volume.get("secret")
        if secret is None or secret["secretName"] != TOKEN_SECRET:
            continue
        items = secret.get("items") or [{"key": TOKEN_KEY, "path": TOKEN_KEY}]
        for container in spec["containers"]:
            for mount in container.get("volumeMounts", []):
                if mount["name"] == volume["name"]:
                    assert mount.get("readOnly") is True
                    paths.update(
                        posixpath.join(mount["mountPath"], item["path"])
                        for item in items
                        if item["key"] == TOKEN_KEY
                    )
    return paths


def check_token_from_secret(objects: list[Object], workload: Object) -> None:
    for container in gradsync_containers(workload):
        environment = container.get("env", [])
        names = [e["name"] for e in environment]
        assert auth.ENV_TOKEN not in names, "the token itself in an env value is in the pod spec"
        token_file = [e for e in environment if e["name"] == auth.ENV_TOKEN_FILE]
        assert len(token_file) == 1, f"{label(workload)}: no ${auth.ENV_TOKEN_FILE}"
        assert token_file[0].get("value") in token_paths(workload), (
            f"{label(workload)}: ${auth.ENV_TOKEN_FILE} is not the mounted Secret's token"
        )
        assert "--token-file" not in container.get("args", [])


def test_every_gradsync_container_reads_the_token_from_the_mounted_secret() -> None:
    objects = applied_objects()
    checked = [w for w in workloads(objects) if gradsync_containers(w)]
    assert len(checked) == 3
    for workload in checked:
        check_token_from_secret(objects, workload)


def test_a_token_file_outside_the_secret_is_caught() -> None:
    objects = applied_objects()
    job = named(objects, "Job", "gradsync-workers")
    volume = next(v for v in pod_template(job)["spec"]["volumes"] if "secret" in v)
    volume["secret"]["items"][0]["path"] = "gradsync-token"
    with pytest.raises(AssertionError, match="not the mounted Secret"):
        check_token_from_secret(objects, job)


def probe_argv(container: Object, probe: str) -> list[str]:
    spec = container.get(probe)
    assert spec is not None, f"{container['name']} has no {probe}"
    assert "grpc" not in spec, "Kubernetes' grpc probe cannot send the token"
    command: list[str] = spec["exec"]["command"]
    return command


@pytest.mark.parametrize(
    ("subcommand", "service"), [("serve", COORDINATOR_SERVICE), ("shard", SHARD_SERVICE)]
)
def test_probes_ask_the_health_service_the_process_registers(
    parse_gradsync: Callable[..., argparse.Namespace], subcommand: str, service: str
) -> None:
    objects = applied_objects()
    workload = the_workload(objects, subcommand)
    args = one_parsed(objects, subcommand, parse_gradsync)
    for container in gradsync_containers(workload):
        for probe in PROBES:
            argv = probe_argv(container, probe)
            assert argv[:3] == PROBE_MODULE
            probe_args = build_probe_parser().parse_args(argv[3:])
            assert probe_args.address == f"127.0.0.1:{args.port}"
            assert probe_args.service == service
            assert container[probe]["timeoutSeconds"] > probe_args.timeout_s


def test_redis_is_probed_and_durable(parse_gradsync: Callable[..., argparse.Namespace]) -> None:
    objects = applied_objects()
    serve = one_parsed(objects, "serve", parse_gradsync)
    store = serve.checkpoint_store
    assert store.startswith("redis://")
    service, _ = service_for(objects, store.split("/")[2])
    (name,) = selected_workloads(objects, service_selector(service))
    redis = named_workload(objects, name)
    assert redis["kind"] == "StatefulSet"
    assert redis["spec"]["replicas"] == 1
    (container,) = pod_template(redis)["spec"]["containers"]
    command = " ".join(container["command"] + container.get("args", []))
    assert "--appendonly yes --appendfsync always" in command
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == ["redis-cli", "ping"]
    claims = {c["metadata"]["name"] for c in redis["spec"]["volumeClaimTemplates"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts.get(claims.pop()) == "/data"


def image_uid() -> int:
    match = re.search(r"useradd\b[^\n]*--uid (\d+)", DOCKERFILE.read_text())
    assert match, "the Dockerfile creates its user with useradd --uid"
    return int(match.group(1))


def mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti)", quantity)
    assert match, f"write memory in Ki/Mi/Gi/Ti: {quantity!r}"
    return float(match.group(1)) * units[match.group(2)]


def test_gradsync_pods_run_as_the_image_user_unprivileged_and_bounded(
    parse_gradsync: Callable[..., argparse.Namespace],
) -> None:
    objects = applied_objects()
    uid = image_uid()
    for workload in [w for w in workloads(objects) if gradsync_containers(w)]:
        spec = pod_template(workload)["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == uid
        assert spec["enableServiceLinks"] is False, "service links set <SERVICE>_PORT variables"
        for pod, container, _, args in parsed_commands(objects, workload, parse_gradsync):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"]["drop"] == ["ALL"]
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"])
            limit = mebibytes(resources["limits"]["memory"])
            if args.command in ("serve", "shard"):
                # Gradient buffers and result queues: a pool of --max-buffered-mb each.
                assert limit >= 2 * args.max_buffered_mb + PROCESS_MEMORY_MIB
            # A scraper finds the metrics where the process serves them.
            assert pod.annotations["prometheus.io/scrape"] == "true"
            assert int(pod.annotations["prometheus.io/port"]) == args.metrics_port
            ports = {p["containerPort"] for p in container["ports"]}
            assert args.metrics_port in ports
            if args.command != "worker":
                assert args.port in ports


# --- Ray -----------------------------------------------------------------------------------------


def ray_schema() -> Object:
    """Ray's own cluster-config schema, read from the installed ray package (not imported)."""
    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None, "ray is not installed: gradsync[ray]"
    schema: Object = json.loads(
        (Path(spec.origin).parent / "autoscaler" / "ray-schema.json").read_text()
    )
    return schema


def load_ray_cluster() -> Object:
    config: Object = yaml.safe_load(RAY_CLUSTER.read_text())
    return config


def test_ray_cluster_config_is_valid_for_ray_s_schema() -> None:
    config = load_ray_cluster()
    jsonschema.validate(config, ray_schema())
    node_types = config["available_node_types"]
    assert config["head_node_type"] in node_types
    workers = [t for name, t in node_types.items() if name != config["head_node_type"]]
    assert [(t["min_workers"], t["max_workers"]) for t in workers] == [(0, 4)]
    assert sum(t.get("min_workers", 0) for t in node_types.values()) <= config["max_workers"]
    assert config["provider"]["type"] == "aws"
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any(
        "ray start --address=$RAY_HEAD_IP:6379" in c for c in config["worker_start_ray_commands"]
    )
    setup = " ".join(config["setup_commands"])
    assert re.search(r"pip install [^\n]*gradsync\[[^\]]*\bray\b", setup)
    # gradsync.ray hands each job's token to its workers as $GRADSYNC_TOKEN; a cluster-wide
    # token variable as well would make them refuse to start (both set).
    commands = [
        command
        for key in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands")
        for command in config.get(key, [])
    ]
    assert not [c for c in commands if "GRADSYNC_TOKEN" in c]


@pytest.mark.parametrize(
    "breaks",
    [
        lambda c: c.update(max_worker=4),
        lambda c: c["available_node_types"]["ray.head"].pop("resources"),
        lambda c: c.update(setup_commands="pip install gradsync"),
    ],
    ids=["unknown-key", "node-type-without-resources", "commands-not-a-list"],
)
def test_ray_schema_rejects_a_broken_cluster_config(breaks: Callable[[Object], Any]) -> None:
    config = load_ray_cluster()
    breaks(config)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, ray_schema())


def test_ray_accepts_the_cluster_config_once_it_fills_in_its_defaults() -> None:
    """What `ray up` does first: merge the provider's defaults, then Ray's own checks."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(load_ray_cluster()))
    validate_config(prepared)
    assert prepared["max_workers"] == 4
