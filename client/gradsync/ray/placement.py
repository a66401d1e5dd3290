"""Pure helpers of the Ray integration: resource options, local ranks, addresses, names.

Kept apart from the actors so the rules are unit-tested without a Ray cluster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: The Ray namespace every gradsync actor is named in, so any driver finds them.
NAMESPACE = "gradsync"

#: Resources of one worker actor when `resources_per_worker` is not given (as Ray Train).
DEFAULT_WORKER_RESOURCES: Mapping[str, float] = {"CPU": 1.0}
#: Resources of the leader and of each shard: averaging needs a core.
DEFAULT_COORDINATOR_RESOURCES: Mapping[str, float] = {"CPU": 1.0}


def actor_options(
    resources: Mapping[str, float] | None, default: Mapping[str, float]
) -> dict[str, Any]:
    """Ray `.options()` keywords for a resource request written as Ray Train writes it.

    {"CPU": 2, "GPU": 1, "memory": 2**30, "head": 0.01} becomes num_cpus=2, num_gpus=1,
    memory=2**30 and resources={"head": 0.01}. A missing "CPU" asks for none, so a
    custom resource alone can pin an actor to a node type without taking a core.

    Raises:
        ValueError: a negative amount (naming the resource and the value).
    """
    request = dict(default if resources is None else resources)
    for name, amount in request.items():
        if amount < 0:
            raise ValueError(f"resource {name!r} must be >= 0, got {amount!r}")
    options: dict[str, Any] = {"num_cpus": float(request.pop("CPU", 0.0))}
    if "GPU" in request:
        options["num_gpus"] = float(request.pop("GPU"))
    if "memory" in request:
        options["memory"] = float(request.pop("memory"))
    if request:
        options["resources"] = {name: float(amount) for name, amount in request.items()}
    return options


def local_ranks(node_of_rank: Sequence[str]) -> list[tuple[int, int]]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) of each rank, from the node each rank runs on.

    As torchrun: a rank's local rank is its place, in rank order, among the ranks on its
    node, and its local world size is how many ranks share that node. gradsync's
    hierarchical aggregation checks LOCAL_WORLD_SIZE against the ranks that share the host.
    """
    counts: dict[str, int] = {}
    places: list[int] = []
    for node in node_of_rank:
        places.append(counts.get(node, 0))
        counts[node] = places[-1] + 1
    return [(place, counts[node]) for place, node in zip(places, node_of_rank, strict=True)]


def host_port(host: str, port: int) -> str:
    """ "host:port", with an IPv6 literal in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def leader_actor_name(name: str) -> str:
    """The Ray name of coordinator `name`'s leader actor."""
    return f"gradsync-coordinator:{name}"


def shard_actor_name(name: str, index: int) -> str:
    """The Ray name of coordinator `name`'s shard `index` (1..shards-1; 0 is the leader)."""
    return f"gradsync-shard:{name}:{index}"
