"""deploy/k8s (Kubernetes) is valid and agrees with the code.

No cluster runs here. Every Kubernetes object is checked against the OpenAPI schema of
`KUBERNETES_VERSION` by kubernetes-validate, strictly: an unknown field is an error, as under
`kubectl apply --validate=strict`.

A schema cannot see what the manifests mean, so the rest is checked against the real code
and between the objects. Each workload's pods are simulated as Kubernetes would make them
(`support.manifests`: pod names, the completion-index annotation and the
JOB_COMPLETION_INDEX variable of an Indexed Job, downward-API and ConfigMap values, $(VAR)
expansion in env values, command and args); then every `gradsync` command line must parse
with gradsync's own parser, each worker pod must get the rank of its completion index, the
probes must parse with the probe's parser and ask for the service the process registers,
the counts (world size, shards) must agree across objects, every selector must select pods
that exist, the network policies must admit exactly the intended peers, and every gradsync
container must read the token from the mounted Secret. Each check has a twin that breaks a
loaded manifest in memory and expects the check to fail. deploy/ray is checked in
test_ray_cluster_config.py.
"""

from __future__ import annotations

import argparse
import copy
import functools
from collections.abc import Callable

import kubernetes_validate
import pytest
import yaml
from gradsync.healthcheck import build_parser as build_probe_parser
from gradsync_proto import auth
from gradsync_server.rpc.servicer import (
    SERVICE_NAME as COORDINATOR_SERVICE,
    SHARD_SERVICE_NAME as SHARD_SERVICE,
)
from support.manifests import (
    ANY_POD,
    INDEX_ANNOTATION,
    KUSTOMIZATION,
    SHARD_TOKEN_SECRET,
    TEMPLATE_SUFFIX,
    TOKEN_KEY,
    TOKEN_SECRET,
    Object,
    admitted,
    applied_objects,
    container_argv,
    container_environment,
    every_document,
    gradsync_containers,
    image_uid,
    is_indexed_job,
    label,
    load_documents,
    manifest_files,
    mebibytes,
    named,
    named_workload,
    one_parsed,
    parse_in_environment,
    parsed_commands,
    pod_labels,
    pod_template,
    pods_of,
    selected_workloads,
    selects,
    service_for,
    service_selector,
    target_port,
    the_workload,
    token_paths,
    workloads,
)

pytestmark = pytest.mark.timeout(30)

#: The Kubernetes release whose API the manifests are validated against (the newest that
#: kubernetes-validate bundles; older clusters may lack fields such as podReplacementPolicy).
KUBERNETES_VERSION = "1.37.0"
NAMESPACE = "gradsync"
IMAGE = "gradsync:local"
PROBE_MODULE = ["python", "-m", "gradsync.healthcheck"]
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
#: The memory of a coordinator or shard beyond its two buffer pools (--max-buffered-mb each).
PROCESS_MEMORY_MIB = 512


@pytest.fixture
def parse_gradsync(
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[[list[str], dict[str, str]], argparse.Namespace]:
    """Parse a gradsync command line with gradsync's own parser, in the container's environment."""
    return functools.partial(parse_in_environment, monkeypatch)


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
    assert [s["metadata"]["name"] for s in secrets] == [TOKEN_SECRET, SHARD_TOKEN_SECRET]
    for secret in secrets:
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


def check_shard_token(workload: Object, expected: bool) -> None:
    """Coordinator and shard pods read the shard token from its Secret; workers never see it."""
    for container in gradsync_containers(workload):
        environment = container.get("env", [])
        names = [e["name"] for e in environment]
        assert auth.ENV_SHARD_TOKEN not in names, "the shard token itself is in the pod spec"
        files = [e for e in environment if e["name"] == auth.ENV_SHARD_TOKEN_FILE]
        paths = token_paths(workload, SHARD_TOKEN_SECRET)
        if not expected:
            assert not files and not paths, f"{label(workload)} can read the shard token"
            continue
        assert len(files) == 1, f"{label(workload)}: no ${auth.ENV_SHARD_TOKEN_FILE}"
        assert files[0].get("value") in paths, (
            f"{label(workload)}: ${auth.ENV_SHARD_TOKEN_FILE} is not the mounted shard Secret"
        )


def test_only_the_coordinator_and_the_shards_read_the_shard_token() -> None:
    objects = applied_objects()
    check_shard_token(named(objects, "Deployment", "gradsync-coordinator"), expected=True)
    check_shard_token(named(objects, "StatefulSet", "gradsync-shard"), expected=True)
    check_shard_token(named(objects, "Job", "gradsync-workers"), expected=False)


def test_a_worker_that_mounts_the_shard_token_is_caught() -> None:
    objects = applied_objects()
    job = named(objects, "Job", "gradsync-workers")
    coordinator = named(objects, "Deployment", "gradsync-coordinator")
    shard_volume = next(
        v
        for v in pod_template(coordinator)["spec"]["volumes"]
        if v.get("secret", {}).get("secretName") == SHARD_TOKEN_SECRET
    )
    spec = pod_template(job)["spec"]
    spec["volumes"].append(shard_volume)
    spec["containers"][0].setdefault("volumeMounts", []).append(
        {"name": shard_volume["name"], "mountPath": "/var/run/secrets/s", "readOnly": True}
    )
    with pytest.raises(AssertionError, match="can read the shard token"):
        check_shard_token(job, expected=False)


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
