"""The Kubernetes manifests of deploy/k8s as Kubernetes would run them, for the manifest tests.

Loads the objects `kubectl apply -k deploy/k8s` creates and simulates each workload's pods
as Kubernetes would make them: pod names, the completion-index annotation and the
JOB_COMPLETION_INDEX variable of an Indexed Job, downward-API and ConfigMap values, $(VAR)
expansion in env values, command and args. Then a `gradsync` command line is parsed with
gradsync's own parser in the container's environment. Label selectors, Service ports and
network-policy peers are resolved here too, so tests can ask which pods reach which port.
No cluster runs; a failed expectation is an AssertionError that names the object.
"""

from __future__ import annotations

import argparse
import os
import posixpath
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from gradsync.arguments import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "k8s"
KUSTOMIZATION = K8S_DIR / "kustomization.yaml"
DOCKERFILE = ROOT / "Dockerfile"

TOKEN_SECRET = "gradsync-token"
#: The shards' credential at the leader: mounted by the coordinator and the shards only.
SHARD_TOKEN_SECRET = "gradsync-shard-token"
TOKEN_KEY = "token"
#: Files shown for their shape only (the token Secret): validated, never applied.
TEMPLATE_SUFFIX = ".example.yaml"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
#: Environment variables gradsync's parser reads, cleared before each simulated pod's own.
PARSER_ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

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


def named_workload(objects: list[Object], name: str) -> Object:
    found = [w for w in workloads(objects) if w["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one workload {name}"
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


def parse_in_environment(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], environment: dict[str, str]
) -> argparse.Namespace:
    """Parse a gradsync command line with gradsync's own parser, in the container's environment
    (the parser takes RANK, WORLD_SIZE and GRADSYNC_* defaults from it when it is built)."""
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


# --- services, secrets, sizes -------------------------------------------------------------------


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


def token_paths(workload: Object, secret_name: str = TOKEN_SECRET) -> set[str]:
    """Paths inside the pod where Secret `secret_name`'s `token` key appears as a file."""
    spec = pod_template(workload)["spec"]
    paths: set[str] = set()
    for volume in spec.get("volumes", []):
        secret = volume.get("secret")
        if secret is None or secret["secretName"] != secret_name:
            continue
        items = secret.get("items") or [{"key": TOKEN_KEY, "path": TOKEN_KEY}]
        for container in spec["containers"]:
            for mount in container.get("volumeMounts", []):
                if mount["name"] == volume["name"]:
                    assert mount.get("readOnly") is True, (
                        f"{label(workload)}: token mounted writable"
                    )
                    paths.update(
                        posixpath.join(mount["mountPath"], item["path"])
                        for item in items
                        if item["key"] == TOKEN_KEY
                    )
    return paths


def image_uid() -> int:
    match = re.search(r"useradd\b[^\n]*--uid (\d+)", DOCKERFILE.read_text())
    assert match, "the Dockerfile creates its user with useradd --uid"
    return int(match.group(1))


def mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti)", quantity)
    assert match, f"write memory in Ki/Mi/Gi/Ti: {quantity!r}"
    return float(match.group(1)) * units[match.group(2)]
