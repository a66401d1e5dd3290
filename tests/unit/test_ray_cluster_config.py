"""deploy/ray/cluster.yaml (the Ray autoscaler's example cluster) is valid and fits gradsync.

No cluster runs here. The config is checked against Ray's own schema
(ray/autoscaler/ray-schema.json) and by Ray's own config checks, as `ray up` would run
them; a twin breaks the loaded config in memory and expects the schema to refuse it.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from support.manifests import ROOT, Object

pytestmark = pytest.mark.timeout(30)

RAY_CLUSTER = ROOT / "deploy" / "ray" / "cluster.yaml"


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
