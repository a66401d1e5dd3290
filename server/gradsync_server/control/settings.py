"""What a job is configured with: the coordinator's flags that shape one job.

`CoordinatorConfig.job_settings()` builds it from the flags, and `Job` takes it
whole, so a new job-level knob is added in one place and reaches every
component without another keyword argument. Policies are enums (their values
are the flags' spellings). Pure, frozen, validated by `CoordinatorConfig` at
start-up; unit tests may build one with any sizes (a 64-byte chunk, say).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gradsync_server import defaults
from gradsync_server.dataplane.nonfinite import NonFinitePolicy

__all__ = ["JobSettings", "NonFinitePolicy", "OnFailure"]


class OnFailure(enum.StrEnum):
    """What a lost rank does to a running job (`--on-failure`)."""

    #: The step is aborted and the job ends: every rank restarts (from a checkpoint).
    ABORT = "abort"
    #: The job goes on over the live ranks (down to `min_workers`); a restarted rank heals.
    ELASTIC = "elastic"


@dataclass(frozen=True)
class JobSettings:
    """One job's configuration.

    Attributes:
        world_size: ranks the job needs.
        chunk_bytes: chunk size every rank must use.
        max_message_bytes: gRPC message limit (advertised in Welcome).
        heartbeat_interval_s: how often workers send a sign of life (advertised in Welcome).
        checkpoint_every: rank 0 uploads a checkpoint every this many steps (0 = on request).
        on_failure: what a lost rank does (see `OnFailure`).
        min_workers: under the elastic policy, the fewest live ranks to go on with.
        max_collective_bytes: cap on one rank's input to a collective.
        shard_count: coordinator shards, the leader included: it aggregates range 0.
        nonfinite: the `--nonfinite` policy (see `gradsync_server.dataplane.nonfinite`).
        screen: the `--screen` floor of DiLoCo jobs' contribution screens.
        max_checkpoint_bytes: the largest checkpoint or healing state accepted (None:
            the byte budget's limit). Its bytes count in the budget as they arrive.
    """

    world_size: int
    chunk_bytes: int
    max_message_bytes: int
    heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S
    checkpoint_every: int = defaults.CHECKPOINT_EVERY_STEPS
    on_failure: OnFailure = OnFailure.ABORT  # defaults.ON_FAILURE
    min_workers: int = defaults.MIN_WORKERS
    max_collective_bytes: int = defaults.MAX_COLLECTIVE_BYTES
    shard_count: int = 1
    nonfinite: NonFinitePolicy = NonFinitePolicy.REPORT  # defaults.NONFINITE
    max_checkpoint_bytes: int | None = None
    screen: str = defaults.SCREEN

    def __post_init__(self) -> None:
        # The flags' spellings are accepted too ("elastic"); an unknown one raises ValueError.
        object.__setattr__(self, "on_failure", OnFailure(self.on_failure))
        object.__setattr__(self, "nonfinite", NonFinitePolicy(self.nonfinite))
